"""Cores of their own for CPU sampler replicas that share a host without being told which cores to use.

Under `sampler.cpu_cores: all` a replica binds vLLM's OpenMP threads to every core it may use. Alone that is right
(the CPU demo's sampler and learner take turns on the same cores). Two replicas doing it side by side, as
`docker compose --scale sampler=2` starts them, put both engines' threads on the same cores, and vLLM's CPU worker
binds its main thread to the lowest core of its list (it sorts the list): a replica joining a busy host loads and
warms up on the core where the busy replica's main thread runs. Measured on 2 cores with a generating replica and a
training learner: 217 s to SERVING on `all`, 48 s on the other core (benchmarks/bench_replica_join.py). vLLM's CPU
guide gives each instance on a host its own `VLLM_CPU_OMP_THREADS_BIND`; `dgrpo up` assigns them by replica index,
and replicas that nobody numbers (compose's scaled service) agree on them here.

A lease is a file in a directory every replica of the host sees (`/dev/shm`: compose's replicas share the `shm`
service's IPC namespace, processes on one machine share the machine's), holding the cores its replica binds and
flock-ed by that replica for as long as it lives. A replica starting takes the directory's lock, drops the leases
whose owner is gone (the kernel released their lock), and takes an equal share of the cores the fewest live
replicas hold, away from their lowest cores (where their main threads run); alone, every core. Replicas do not move
once started: after a scale-down the survivors keep their share until they restart.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LEASE_DIR = Path("/dev/shm/dgrpo-cpu-leases")


@dataclass
class CoreLease:
    """The cores one replica binds, held until `release` or the process's exit (the kernel drops the lock)."""

    cores: list[int]
    path: Path | None
    fd: int | None
    peers: list[list[int]]

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = None

    def binding(self) -> str:
        return ",".join(str(c) for c in self.cores)


def choose_cores(cores: list[int], peers: list[list[int]]) -> list[int]:
    """An equal share of `cores` for one more replica next to `peers` (each the cores a live replica binds): the
    cores the fewest peers hold, a peer's lowest core last (its engine's main thread runs there), then in order."""
    if not peers:
        return list(cores)
    share = max(1, len(cores) // (len(peers) + 1))
    held = {c: sum(c in p for p in peers) for c in cores}
    mains = {min(p) for p in peers if p}
    ranked = sorted(cores, key=lambda c: (held[c], c in mains, c))
    return sorted(ranked[:share])


def _live_peers(directory: Path) -> list[list[int]]:
    """Cores of every lease whose owner still holds it; the others (owner gone) are removed."""
    peers = []
    for path in sorted(directory.glob("*.cores")):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: its replica is alive
                text = os.pread(fd, 4096, 0).decode().strip()
                peers.append([int(c) for c in text.split(",") if c])
                continue
            path.unlink(missing_ok=True)  # nobody holds it: its replica exited or was killed
        finally:
            os.close(fd)
    return peers


def claim(name: str, cores: list[int] | None = None, directory: Path = LEASE_DIR) -> CoreLease:
    """Cores for replica `name` among the live leases in `directory`, leased until this process exits. Where the
    directory cannot be used (read-only, another user's), every core, no lease, and a warning saying so."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        lock = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        log.warning("sampler.cpu_cores=all: cannot keep core leases in %s (%s); binding every core, as replicas "
                    "started side by side on this host would too", directory, e)
        return CoreLease(cores, None, None, [])
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one replica chooses at a time
        peers = _live_peers(directory)
        mine = choose_cores(cores, peers)
        path = directory / f"{os.getpid()}-{secrets.token_hex(4)}-{_safe(name)}.cores"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, ",".join(str(c) for c in mine).encode())
        fcntl.flock(fd, fcntl.LOCK_SH)  # released by the kernel when this process exits, however it exits
        return CoreLease(mine, path, fd, peers)
    finally:
        os.close(lock)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:64] or "replica"
