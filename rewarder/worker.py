"""A reward worker process: builds the spec's functions from a snapshot and runs calls sent by the server.

Started by rewarder/pool.py as `python -m dgrpo.rewarder.worker FD` (a plain subprocess, not multiprocessing:
spawn would re-run the `dgrpo` entry point as its main module). FD is one end of a socketpair speaking
multiprocessing's Connection protocol (pickled messages):

  server -> worker: the SpecSnapshot, then ("call", fn_index, prompts, completions, kwargs) ... or None to exit
  worker -> server: ("ready", pid) | ("load_error", message), then per call ("ok", values) | ("error", message)

`values` holds, per completion, a float, None ("not applicable"), or a str explaining why that one value is
unusable (NaN, inf, not a number). A hang or a crash is noticed by the server (timeout / closed connection).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from dgrpo.common.logs import setup_logging


def check_values(values, n: int) -> list[float | None | str]:
    """Validate a reward function's return value for n completions (raises ValueError on a wrong shape)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"returned {type(values).__name__}, expected a list of {n} floats or None")
    if hasattr(values, "tolist"):  # numpy arrays, torch tensors
        values = values.tolist()
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    out: list[float | None | str] = []
    for v in values:
        if v is None:
            out.append(None)
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            out.append(f"returned {v!r} ({type(v).__name__}), not a number")
        elif not math.isfinite(float(v)):
            out.append(f"returned {float(v)} (not finite)")
        else:
            out.append(float(v))
    return out


def describe_exception(e: BaseException) -> str:
    """`TypeError: msg (at file.py:12)`: the innermost frame, which is usually the user's line. A SyntaxError
    (a file compiled or imported during the call) quotes that file, so it gets its type and place only."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, SyntaxError):
        return f"raised {type(e).__name__} (at {e.filename}:{e.lineno})"
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"raised {type(e).__name__}: {e}{where}"


def call_function(fn, prompts: list, completions: list, kwargs: dict) -> tuple[str, object]:
    """One call, TRL style (keywords, as TRL's trainer passes them); async functions run to completion."""
    try:
        result = fn(prompts=prompts, completions=completions, **kwargs)
        if inspect.isawaitable(result):
            result = _event_loop().run_until_complete(_await(result))
    except Exception as e:  # noqa: BLE001 - user code: every failure becomes an error for this call
        return "error", describe_exception(e)
    try:
        return "ok", check_values(result, len(completions))
    except ValueError as e:
        return "error", str(e)


async def _await(awaitable):
    return await awaitable


_LOOP: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One loop for the worker's life: an async function may keep a client (e.g. an HTTP session to a judge)
    bound to the loop it was created on across calls, which a fresh asyncio.run per call would break."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP


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
        _, index, prompts, completions, kwargs = msg
        conn.send(call_function(fns[index], prompts, completions, kwargs))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
