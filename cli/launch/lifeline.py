"""No orphans: every service `dgrpo up` starts ends, with its whole process tree and its shared memory, within
seconds of `up` dying, however `up` dies (SIGKILL and the OOM killer included: no handler of `up`'s runs then).

`up` holds the write end of a pipe; each service inherits only the read end (its number in DGRPO_LIFELINE_FD) and
watches it from a thread. The kernel closes the write end when `up` exits, so the read returns end-of-file: the
service is an orphan. It then does what `up`'s reaping would have done (cli/launch/procs.py): SIGKILL every other
process of its process group (vLLM's engine core and workers, multiprocessing's resource tracker), unlink the
/dev/shm files they and it used that no living process still uses (its own dgrpo weight segments included), and
SIGKILL itself. Why a pipe and not prctl(PR_SET_PDEATHSIG): the parent-death signal fires when the *thread* that
started the child ends (`up` restarts services from threads), and it reaches the direct child alone, which, killed
outright, cannot take its engine's processes along. What neither can end: a service frozen by SIGSTOP (it cannot
run its watcher); SIGCONT ends it then.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

ENV = "DGRPO_LIFELINE_FD"


class Lifeline:
    """`up`'s side: the pipe, and what a service needs to inherit it."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()  # both close-on-exec: a service inherits only what pass_fds names

    def child_env(self) -> dict[str, str]:
        return {ENV: str(self.read_fd)}

    def pass_fds(self) -> tuple[int, ...]:
        return (self.read_fd,)


def watch_from_env(name: str) -> bool:
    """In a service: when `up` handed it a lifeline, watch it (a daemon thread) and end the process group when it
    breaks. The variable is removed so that the service's own children do not watch it too. Returns whether it
    watches."""
    value = os.environ.pop(ENV, None)
    if value is None:
        return False
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        return False
    os.set_inheritable(fd, False)  # not for the engine's processes: they are ended with the group
    threading.Thread(target=_watch, args=(fd, name), name="dgrpo-lifeline", daemon=True).start()
    return True


def _watch(fd: int, name: str) -> None:
    while True:
        try:
            if not os.read(fd, 1):  # EOF: `up` is gone (it never writes)
                break
        except InterruptedError:
            continue
        except OSError:
            break
    end_orphaned_group(name)


def end_orphaned_group(name: str, grace_s: float = 5.0) -> None:
    """SIGKILL the rest of this process's group, unlink the /dev/shm files the group used that nobody else uses,
    then SIGKILL this process."""
    from dgrpo.cli.launch import procs

    me, group = os.getpid(), os.getpgrp()
    try:
        print(f"dgrpo {name}: dgrpo up is gone: ending this service, its processes and its shared memory",
              file=sys.stderr, flush=True)
    except OSError:  # the pipe to `up` is gone with it
        pass
    shm = procs.shm_files(procs.group_pids(group) if group == me else [me])
    deadline = time.monotonic() + grace_s
    while group == me and time.monotonic() < deadline:  # a group leader (as `up` starts every service)
        others = [p for p in procs.group_pids(group) if p != me]
        if not others:
            break
        shm |= procs.shm_files(others)
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    from dgrpo.weights.shm import created_by

    # Its own dgrpo segments (the learner's weight slots, a sampler's staging copy) go even while a peer that is
    # ending too still maps them; any other file only once no process outside the group uses it.
    in_use = procs.shm_files(p for p in procs.all_pids() if p != me)
    for path in sorted(p for p in shm if p not in in_use or created_by(p) == me):
        try:
            os.unlink(path)
        except OSError:
            pass
    os.kill(me, signal.SIGKILL)
