"""Reaping a local service completely: its whole process group, and the shared memory only it used.

A sampler is a process tree (the gRPC server, vLLM's engine core, its workers and multiprocessing's resource
tracker), started by `dgrpo up` as the leader of its own process group. When the leader dies hard (kill -9, the
OOM killer), the rest of the group lives on, holding gigabytes, and when the group is then killed too, the
segments vLLM and multiprocessing made in /dev/shm (`psm_*`, `sem.mp-*`, hundreds of MB each) stay: nobody is
left to unlink them. So `dgrpo up` notes which /dev/shm files a service's processes use while it runs, and after
killing the group it unlinks those no living process still uses. dgrpo's own segments (`dgrpo-*`: the learner's
weight slots, which samplers map too) are left to weights/shm.py, which judges them by their creator's pid.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = "/dev/shm"
OURS = "dgrpo-"  # weights/shm.py's segments: reclaimed by creator pid (reclaim_stale), never here


def group_pids(pgid: int) -> list[int]:
    """Living processes in process group `pgid` (zombies excluded: they hold nothing)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def shm_files(pids: Iterable[int]) -> set[str]:
    """/dev/shm files the processes have mapped or open."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.rstrip("\n").split(maxsplit=5)  # address perms offset dev inode [path]
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                        found.add(parts[5].removesuffix(" (deleted)"))
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith(SHM_DIR + "/"):
                    found.add(target.removesuffix(" (deleted)"))
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return found


def all_pids() -> list[int]:
    return [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]


def kill_group(pgid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process left in group `pgid` and wait (up to `timeout`) until none lives. Returns the pids
    that were killed."""
    pids = group_pids(pgid)
    if not pids:
        return []
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return []
    deadline = time.monotonic() + timeout
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def unlink_orphaned(paths: Iterable[str]) -> list[str]:
    """Unlink each /dev/shm file in `paths` that no living process maps or holds open. Returns what was removed."""
    candidates = {p for p in paths if p.startswith(SHM_DIR + "/") and not os.path.basename(p).startswith(OURS)
                  and os.path.exists(p)}
    if not candidates:
        return []
    in_use = shm_files(all_pids())
    removed = []
    for path in sorted(candidates - in_use):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
