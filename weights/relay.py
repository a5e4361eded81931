"""The sampler host's side of `weights.transport=collective`: one replica per host (the relay) receives each version
from the learner over a torch.distributed group (weights/collective.py) and writes it into the host's shared-memory
slots; every replica on the host, the relay included, then loads it from there exactly as with `shm`.

Who relays: every replica on a host runs a `HostRelay` thread that tries an exclusive `flock` on a lock file in the
host's `weights.shm_dir`; the one that holds it is the relay. The kernel drops the lock when its holder dies, however
it dies, so another replica takes over within `ELECTION_POLL_S` and joins the learner, which drops the dead relay's
group and sends the newcomer the latest version. A "host" is whatever shares that folder: the replicas that can read
each other's shared memory.

What the replicas follow: the relay writes a version into the slot not holding the previous one (its own segment
files, named as the learner's are, sequence-locked the same way), verifies every checksum there, and only then
replaces the host's index file (`dgrpo-relay-...ann`, a serialized `WeightAnnouncement` with transport shm naming the
local segment). Replicas watch the index (weights/subscriber.py) and load what it names through the unchanged shm
path: stage (verify in place), pause, apply, overlap check. A version that arrives torn, short or with a bad checksum
never reaches the index; the learner hears "not verified" in the acknowledgement.

What a relay leaves: nothing. `stop()` wakes the thread wherever it waits (the join's wait for the learner's reply is
polled in slices, a group call is aborted) and the thread retires: its slots, the index naming them and the lock file
removed. A thread still inside a call that cannot be woken (forming a group with a learner that vanished) after
`STOP_GRACE_S` is left to die with the process and `stop()` retires the relay itself. A SIGKILLed relay cannot clean
up: its slots are reclaimed by pid (weights/shm.py) and its index and lock by the lock itself, which the kernel
dropped: a replica that finds a host's lock free (at its start, or elected) knows the index beside it names slots
nobody writes, removes both and says so (`reclaimed the host's weight index ... left by a relay that is gone`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import struct
import threading
import time
from pathlib import Path

import torch
import zmq

from dgrpo.weights import protocol
from dgrpo.weights.collective import HEAD, KIND_KEEPALIVE, KIND_VERSION
from dgrpo.weights.collective_backends import CollectiveRefused, local_device
from dgrpo.weights.collective_group import CollectiveError, PairGroup, local_address_towards
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.protocol import Announcement, ProtocolError
from dgrpo.weights.shm import ShmSegment, reclaim_stale, segment_path
from dgrpo.weights.slot import SEQ_OFFSET, SlotReader, WeightIntegrityError

log = logging.getLogger(__name__)

ELECTION_POLL_S = 0.5
"""How often a replica that is not the relay tries the host's lock (how soon it takes over from a dead relay)."""
REJOIN_PAUSE_S = 1.0
MAX_REJOIN_PAUSE_S = 8.0
"""Pause before rejoining the learner after the group failed, doubling per failure in a row up to the maximum (a
learner that refuses, e.g. another weights.transport, is asked again every 8 s, not flooded)."""
JOIN_POLL_S = 0.1
"""The join waits for the learner's reply in slices this long, so that `stop()` interrupts it."""
STOP_GRACE_S = 2.0
"""How long `stop()` waits for the relay's thread to end before it retires the relay itself (a thread inside a call
that cannot be woken dies with the process; the relay's files do not outlive it)."""


def host_files(cfg: WeightSyncConfig) -> tuple[Path, Path]:
    """(lock, index) of the host's relay for the learner at weights.host:control_port, inside weights.shm_dir."""
    learner = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{cfg.host}-{cfg.control_port}")[:80]
    base = Path(cfg.shm_dir) / f"dgrpo-relay-{learner}"
    return base.with_name(base.name + ".lock"), base.with_name(base.name + ".ann")


_RELAY_FILE = re.compile(r"^(dgrpo-relay-.+)\.(?:lock|ann|ann\.\d+\.tmp)$")


def reclaim_stale_relays(shm_dir: str | Path, held: Path | None = None) -> list[str]:
    """Remove what relays that are gone left in `shm_dir`: for every learner whose host lock no process holds, the
    index (it names slots nobody writes: a SIGKILLed relay's, which reclaim_stale removes), its temporary files and
    the lock file. A relay holds its lock as long as it lives and the kernel drops it however it dies, so a lock this
    call can take is one nobody relays under. `held`: the lock this replica holds (it was just elected): whatever index
    is beside it is a previous relay's. Returns the indexes removed; each is logged once."""
    folder = Path(shm_dir)
    if not folder.is_dir():
        return []
    bases = {m.group(1) for p in folder.glob("dgrpo-relay-*") if (m := _RELAY_FILE.match(p.name))}
    removed = []
    for base in sorted(bases):
        lock, index = folder / f"{base}.lock", folder / f"{base}.ann"
        try:
            if held is not None and lock == held:
                if _remove_index(index, lock):
                    removed.append(index.name)
                continue
            fd = _take(lock)
            if fd is None:
                continue  # a live relay's (or not ours to open)
            try:
                if _remove_index(index, lock):
                    removed.append(index.name)
                lock.unlink(missing_ok=True)  # before the unlock: a replica that opened it finds it gone and retries
            finally:
                os.close(fd)
        except OSError as e:  # another user's files in a shared folder
            log.warning("weights: cannot reclaim the relay files %s.*: %s", folder / base, e)
    return removed


def _take(lock: Path) -> int | None:
    """A descriptor holding `lock` (the file at that path, created if missing), or None if a process holds it."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # another user's, a read-only folder: not ours to judge
        log.debug("weights: cannot open %s: %s", lock, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == os.stat(lock).st_ino:
            return fd
    except (BlockingIOError, FileNotFoundError):
        pass
    os.close(fd)
    return None


def _remove_index(index: Path, lock: Path) -> bool:
    """Remove a gone relay's index (and temporaries) while holding its lock; True, logged, if there was one."""
    for tmp in index.parent.glob(f"{index.name}.*.tmp"):
        tmp.unlink(missing_ok=True)
    ann = read_index(index) if index.exists() else None
    try:
        index.unlink()
    except FileNotFoundError:
        return False
    what = f"version {ann.version} in {ann.segment}" if ann is not None else "no readable version"
    log.warning("weights: reclaimed the host's weight index %s (%s) left by a relay that is gone (nobody held %s)",
                index, what, lock.name)
    return True


def read_index(path: Path) -> Announcement | None:
    """The host's latest verified version (an shm announcement of the relay's slot), or None if there is none yet
    or it cannot be read as one."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        ann = protocol.decode_announcement([protocol.TOPIC, raw])
    except ProtocolError as e:
        log.error("the host's weight index %s is not a weight announcement: %s", path, e)
        return None
    return ann if ann.segment else None  # the host's own slot, read in place: an index without one names nothing


class HostIndex:
    """A replica's view of its host's index: `changed()` is the newest announcement when the file was replaced since
    the last call (one stat call otherwise)."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple | None = None

    def read(self) -> Announcement | None:
        return read_index(self.path)

    def changed(self) -> Announcement | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        identity = (st.st_ino, st.st_mtime_ns, st.st_size)
        if identity == self._seen:
            return None
        self._seen = identity
        return read_index(self.path)


def host_key(cfg: WeightSyncConfig) -> str:
    """This host as the learner tells hosts apart: the hostname and the device of the shared-memory folder (two
    network namespaces or containers may share a hostname, never a tmpfs they do not share)."""
    return f"{socket.gethostname()}:{os.stat(cfg.shm_dir).st_dev}"


class HostRelay:
    """Runs for the replica's lifetime; relays while it holds the host's lock. `stop()` ends it (bounded)."""

    def __init__(self, cfg: WeightSyncConfig, token: bytes | None = None):
        self.cfg = cfg
        self._signer = protocol.Signer(token)
        self.lock_path, self.index_path = host_files(cfg)
        self.is_relay = False
        self.received: list[int] = []
        """Versions this replica received and wrote as the relay (for logs and tests)."""
        self._stop = threading.Event()
        self._fd: int | None = None
        """The host lock's descriptor while this replica relays."""
        self._retiring = threading.Lock()
        self._group: PairGroup | None = None
        self._segments: dict[int, ShmSegment] = {}
        self._seq = [0, 0]
        self._run_id: str | None = None
        self._thread = threading.Thread(target=self._run, name="dgrpo-relay", daemon=True)

    def start(self) -> None:
        """Start the election thread; first remove what a relay that is gone left (before this replica reads the
        host's index)."""
        reclaim_stale_relays(self.cfg.shm_dir)
        self._thread.start()

    def stop(self) -> None:
        """End relaying and remove this relay's files, within STOP_GRACE_S however the learner behaves."""
        self._stop.set()
        group = self._group
        if group is not None:
            group.abort()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=STOP_GRACE_S)
        if self._thread.is_alive():
            log.warning("weights: the host relay is still inside a call to the learner at %s after %.0fs; retiring it "
                        "from here (the call ends with the process)", self.cfg.host, STOP_GRACE_S)
            self._release()

    # --- election ---

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._elect():
                    self._stop.wait(ELECTION_POLL_S)
                    continue
                try:
                    reclaim_stale(self.cfg.shm_dir)  # a dead relay's slots
                    reclaim_stale_relays(self.cfg.shm_dir, held=self.lock_path)  # and the index naming them
                    log.info("weights: this replica is the host's relay (lock %s)", self.lock_path)
                    self._relay()
                finally:
                    self._release()
        except Exception:
            log.exception("weights: the host relay failed; another replica takes over")

    def _elect(self) -> bool:
        """True if this replica now holds the host's lock (and is the relay). The file is opened afresh each try
        and must still be the one at the path once locked: a retiring relay removes it."""
        fd = _take(self.lock_path)
        if fd is None:
            return False
        with self._retiring:
            if self._stop.is_set():  # stopping: stop() may have retired already; hand the lock straight back
                self.lock_path.unlink(missing_ok=True)
                os.close(fd)
                return False
            self._fd = fd
            self.is_relay = True
        return True

    def _release(self) -> None:
        """Stop relaying (if relaying): remove this relay's slots, the index when it names them, and the lock file,
        then drop the lock. Run by the thread as it ends, or by stop() when the thread cannot end."""
        with self._retiring:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            self.is_relay = False
            try:
                self._retire()
            finally:
                self.lock_path.unlink(missing_ok=True)  # before the unlock: a waiter then finds it gone
                os.close(fd)

    def _relay(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._group = self._join()
                if self._group is None:
                    return  # stopped while waiting for the learner
                failures = 0  # joined: a later failure is a new outage
                self._receive()
            except CollectiveRefused as e:
                log.error("weights: no group with the learner at %s: %s", self.cfg.host, e)
            except CollectiveError as e:
                if not self._stop.is_set():
                    log.error("weights: the group with the learner at %s failed (%s); rejoining", self.cfg.host, e)
            except (ProtocolError, zmq.ZMQError, OSError) as e:
                if not self._stop.is_set():
                    log.warning("weights: joining the learner at %s:%d failed (%s); retrying", self.cfg.host,
                                self.cfg.control_port, e)
            finally:
                if self._group is not None:
                    self._group.abort()
                    self._group = None
            failures += 1
            self._stop.wait(min(REJOIN_PAUSE_S * 2 ** (failures - 1), MAX_REJOIN_PAUSE_S))

    def _join(self) -> PairGroup | None:
        """Ask the learner for this host's group (control socket, signed like every request), then join it. None
        when stop() came first."""
        address = local_address_towards(self.cfg.host, self.cfg.control_port)
        name = f"{socket.gethostname()} ({address})"
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{self.cfg.host}:{self.cfg.control_port}")
            sock.send_multipart(self._signer.seal([protocol.join_request(host_key(self.cfg), name, address)]))
            deadline = time.monotonic() + self.cfg.collective_timeout_s
            while not sock.poll(int(JOIN_POLL_S * 1000)):
                if self._stop.is_set():
                    return None
                if time.monotonic() >= deadline:
                    raise ProtocolError(f"no answer in {self.cfg.collective_timeout_s:.0f}s")
            frames = self._signer.open(sock.recv_multipart(), "control reply")
        finally:
            sock.close(linger=0)
        group = protocol.decode_reply(frames[0]).group
        mine = self.cfg.collective_backend
        if mine not in ("auto", group.backend):
            raise CollectiveRefused(f"the learner's group is {group.backend} (its weights.collective_backend), this "
                                    f"sampler's weights.collective_backend is {mine!r}: set the same on both")
        device = None if group.backend == "gloo" else local_device(group.backend)
        return PairGroup(1, self.cfg.host, group.port, group.timeout_s, address, group.backend, device=device)

    # --- receiving ---

    def _receive(self) -> None:
        group = self._group
        while not self._stop.is_set():
            head = torch.zeros(HEAD, dtype=torch.int64)
            group.broadcast(head)  # idle: the learner's keep-alive arrives every third of the timeout
            kind, ann_len, header_len, nbytes, chunk = head.tolist()
            if kind == KIND_KEEPALIVE:
                self._ack(0)
                continue
            if kind != KIND_VERSION or not 0 < ann_len < 1 << 30 or header_len <= 0 or nbytes < header_len \
                    or chunk <= 0:
                raise CollectiveError(f"unexpected message head {head.tolist()} (another dgrpo release?)")
            raw = torch.empty(ann_len, dtype=torch.uint8)
            group.broadcast(raw)
            header = torch.empty(header_len, dtype=torch.uint8)
            group.broadcast(header)
            ann = protocol.decode_announcement([protocol.TOPIC, raw.numpy().tobytes()])
            self._ack(self._write(ann, header, nbytes, chunk))

    def _ack(self, version: int) -> None:
        self._group.allreduce(torch.tensor([version], dtype=torch.int64))

    def _segment(self, run_id: str, slot: int) -> ShmSegment:

        if run_id != self._run_id:
            self._close_segments()
            self._run_id = run_id
        if slot not in self._segments:
            self._segments[slot] = ShmSegment(segment_path(self.cfg.shm_dir, run_id, slot))
        return self._segments[slot]

    def _write(self, ann: Announcement, header: torch.Tensor, nbytes: int, chunk: int) -> int:
        """Receive the body into the host slot under its sequence lock, verify it there, then name it in the host's
        index. Returns the version written, or 0 if it did not verify (the index keeps the previous one)."""
        t0 = time.perf_counter()
        seg = self._segment(ann.run_id, ann.slot)
        buf = seg.ensure(nbytes)
        # Odd: readers of this slot reject it until the write ends (a transfer that failed left it odd already).
        seq = self._seq[ann.slot] + (1 if self._seq[ann.slot] % 2 == 0 else 2)
        self._seq[ann.slot] = seq
        memoryview(buf)[: len(header)] = header.numpy().tobytes()
        _put_seq(buf, seq)
        body = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes - len(header), offset=len(header))
        for start in range(0, body.numel(), chunk):
            self._group.broadcast(body[start:start + chunk])
        seq += 1
        self._seq[ann.slot] = seq
        _put_seq(buf, seq)
        t1 = time.perf_counter()
        try:
            reader = SlotReader(buf, ann.version, seq, ann.manifest_xxh3)
            reader.verify()
            reader.check_intact()
            reader.release()
        except WeightIntegrityError as e:
            log.error("REJECTED weight version %d from the learner: %s (the host keeps the previous version)",
                      ann.version, e)
            return 0
        local = Announcement()
        local.CopyFrom(ann)
        local.transport, local.segment = protocol.TRANSPORTS["shm"], seg.path.name  # the host's slot, read in place
        local.seq, local.streaming = seq, False
        tmp = self.index_path.with_name(f"{self.index_path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(local.SerializeToString())
        os.replace(tmp, self.index_path)  # atomic: a replica reads the previous index or this one, never a mix
        self.received.append(ann.version)
        log.info("weights: relayed version %d (%.1f MB received in %.3fs, verified in %.3fs) into %s", ann.version,
                 nbytes / 1e6, t1 - t0, time.perf_counter() - t1, seg.path.name)
        return ann.version

    # --- retiring ---

    def _retire(self) -> None:
        """Stop relaying: remove this relay's slots (and the index when it names them). A replica still loading
        from them keeps its mapping; the next relay writes the latest version again when it joins."""
        index = read_index(self.index_path)
        names = {seg.path.name for seg in self._segments.values()}
        if index is not None and index.segment in names:
            try:
                self.index_path.unlink()
            except FileNotFoundError:
                pass
        self._close_segments()

    def _close_segments(self) -> None:
        for seg in self._segments.values():
            seg.close(unlink=True)
        self._segments.clear()
        self._seq = [0, 0]


def _put_seq(buf, seq: int) -> None:
    struct.pack_into("<Q", buf, SEQ_OFFSET, seq)
