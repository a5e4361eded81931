"""A reward worker process: builds the spec's functions from a snapshot and runs calls sent by the server.

Started by rewarder/pool.py as `python -m dgrpo.rewarder.worker FD` (a plain subprocess, not multiprocessing:
spawn would re-run the `dgrpo` entry point as its main module). FD is one end of a socketpair speaking
multiprocessing's Connection protocol (pickled messages):

  server -> worker: the SpecSnapshot, then ("call", fn_index, prompts, completions, kwargs, trainer_state) ... or
                    None to exit
  worker -> server: ("ready", pid) | ("load_error", message), then per call ("ok", Scored) | ("error", message)

`Scored.values` holds, per completion, a float, None ("not applicable"), or a str explaining why that one value is
unusable (NaN, inf, not a number); how functions are called is rewarder/calling.py. A hang or a crash is noticed
by the server (timeout / closed connection).
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

from dgrpo.common.logs import setup_logging
from dgrpo.rewarder.calling import (  # noqa: F401 - check_values: re-exported for the tests
    TrainerState,
    call_function,
    check_values,
    describe_exception,
)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the server dies, even while user code hangs.

    The signal fires when the *thread* that spawned us exits: the pool spawns from its executor's threads,
    which live exactly as long as the pool."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us itself
    setup_logging("rewarder")  # load failures log their traceback here (stderr, shared with the server)
    _die_with_parent()
    conn = Connection(fd)
    snap = conn.recv()
    from dgrpo.rewarder.spec import SpecError, build_functions

    try:
        fns = build_functions(snap)
    except SpecError as e:
        conn.send(("load_error", str(e)))
        return 1
    except Exception as e:  # noqa: BLE001 - anything else while loading is reported, not a silent exit
        conn.send(("load_error", f"loading the reward spec {describe_exception(e)}"))
        return 1
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0  # the server went away
        if msg is None:
            return 0
        _, index, prompts, completions, kwargs, state = msg
        conn.send(call_function(fns[index], prompts, completions, kwargs, TrainerState(**(state or {}))))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
