"""POSIX shared-memory segments for weight slots: owner-only files in /dev/shm, removed at exit, stale ones reclaimed.

On Linux `shm_open(name)` is `open("/dev/shm/name")`; using the file directly (instead of
multiprocessing.shared_memory) keeps the mode 0600 explicit and avoids Python's resource tracker, which unlinks a
segment when *any* process that attached to it exits.

Names carry the creating process's pid namespace and id (`dgrpo-w-<run>-<ns>-<pid>-s<slot>` for the learner's
slots, `dgrpo-r-<ns>-<pid>-<n>` for a sampler's tcp staging copy), so a starting process can tell a crashed run's
segments (pid gone) from a live one's. Only segments from our own pid namespace are judged: containers sharing
/dev/shm see each other's segments but not each other's processes.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "dgrpo-"
_NAME = re.compile(r"^dgrpo-(?:w-[A-Za-z0-9_.-]+|r)-(?P<ns>\d+)-(?P<pid>\d+)-(?:s[01]|\d+)$")
RUN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_path(shm_dir: str, run_id: str, slot: int) -> Path:
    """A learner slot's file (the publisher's with the shm transport; a relay's on its host)."""
    return Path(shm_dir) / f"dgrpo-w-{run_id}-{owner_tag()}-s{slot}"


def owner_tag() -> str:
    """`<pid namespace>-<pid>`: the part of a segment name that identifies its creator."""
    return f"{pid_namespace()}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def created_by(path: str | Path) -> int | None:
    """The pid that created dgrpo segment `path` in this pid namespace; None for any other file."""
    m = _NAME.match(Path(path).name)
    return int(m.group("pid")) if m and int(m.group("ns")) == pid_namespace() else None


def stale_segments(shm_dir: str | Path) -> list[Path]:
    """dgrpo segments in shm_dir whose creating process (in our pid namespace) is gone: a crashed or killed run's."""
    folder = Path(shm_dir)
    if not folder.is_dir():
        return []
    stale = []
    for path in folder.iterdir():
        m = _NAME.match(path.name)
        if m is None:
            continue
        pid = int(m.group("pid"))
        if int(m.group("ns")) != pid_namespace() or pid == os.getpid() or pid_alive(pid):
            continue
        stale.append(path)
    return stale


def stale_bytes(shm_dir: str | Path) -> int:
    """Memory that reclaiming the stale segments frees (their written pages, not their apparent size)."""
    total = 0
    for path in stale_segments(shm_dir):
        try:
            total += path.stat().st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def reclaim_stale(shm_dir: str | Path) -> list[str]:
    """Remove dgrpo segments whose creating process is gone (a crashed or SIGKILLed run); return their names."""
    removed = []
    for path in stale_segments(shm_dir):
        pid = int(_NAME.match(path.name).group("pid"))
        try:
            size = path.stat().st_size
            path.unlink()
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(path.name)
        log.warning("reclaimed stale shared-memory segment %s (%.1f MB) left by dead process %d",
                    path, size / 1e6, pid)
    return removed


class ShmSegment:
    """One owner-only shared-memory file, mapped read-write and grown on demand (tmpfs pages cost memory only once
    written, so growth slack is free)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        # O_EXCL: never adopt (and later corrupt) someone else's segment; 0600: weights are not world-readable.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(self._fd, 0o600)  # the umask cannot widen it, but may have narrowed it further: be exact
        self._maps: list[mmap.mmap] = []
        self.size = 0

    def ensure(self, nbytes: int) -> mmap.mmap:
        """A writable map of at least `nbytes` (earlier contents kept)."""
        if nbytes > self.size or not self._maps:
            size = max(nbytes, self.size * 3 // 2, 1 << 20)
            os.ftruncate(self._fd, size)
            self.size = size
            # Older maps stay open until close(): tensors viewing them may still be alive.
            self._maps.append(mmap.mmap(self._fd, size))
        return self._maps[-1]

    @property
    def buffer(self) -> mmap.mmap:
        return self.ensure(0)

    def close(self, unlink: bool = True) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still exported; the mapping dies with the process
        self._maps.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


class MemorySegment:
    """The same growable buffer in private process memory (the tcp transport's learner side)."""

    def __init__(self):
        self._buf = bytearray()
        self.size = 0

    def ensure(self, nbytes: int) -> bytearray:
        if nbytes > self.size:
            size = max(nbytes, self.size * 3 // 2, 1 << 20)
            grown = bytearray(size)
            grown[: self.size] = self._buf
            self._buf, self.size = grown, size
        return self._buf

    @property
    def buffer(self) -> bytearray:
        return self._buf

    def close(self, unlink: bool = True) -> None:
        self._buf, self.size = bytearray(), 0


def open_readonly(path: str | Path) -> mmap.mmap:
    """Map a slot for reading (the sampler side of the shm transport)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
