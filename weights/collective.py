"""The learner side of `weights.transport=collective`: each version crosses to every other host once, over a
torch.distributed group with that host's relay replica (weights/relay.py), which writes it into the host's shared
memory for all the replicas there.

    learner (rank 0 of each host's group)                  host B's relay (rank 1)
      join(host_key) on the control socket   <──────────   elected by a lock in host B's /dev/shm
      group port  ─────────────────────────────────────▶   PairGroup(rank 1)
      per version: broadcast [kind, lengths], the announcement, the slot header, the slot body in chunks
      allreduce [ack]  ◀────────────────────────────────   the version it verified (checksums) and wrote to shm
      idle: a keep-alive (kind + ack) every third of weights.collective_timeout_s

One thread per host (`HostLink`) sends the newest version not yet acknowledged; a host that lags gets only the newest
(versions in between are never wanted). No lock is held while the bytes cross, so a slow host never blocks `publish()`;
a slot rewritten under a transfer fails the relay's checksums and is never served. Every call is bounded
(weights.collective_timeout_s): a host whose relay died, froze or lost its link is logged by name, its group is torn
down, and its relay (or the replica that replaces it) joins again and is sent the latest version at once. A slow host
never delays another: their links are independent, and `publish()` never waits for any of them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from dgrpo.weights.collective_group import (
    WILDCARDS,
    CollectiveError,
    CollectiveRefused,
    PairGroup,
    listen_socket,
    local_address_towards,
)
from dgrpo.weights.protocol import Announcement

log = logging.getLogger(__name__)

KIND_VERSION, KIND_KEEPALIVE = 1, 2
HEAD = 5
"""Fields of the first broadcast of each exchange: kind, announcement length, slot header length, slot bytes,
chunk bytes (the relay receives in the sender's chunks)."""
SLOT_HEADER_BYTES = 4096  # weights/slot.py HEADER_BYTES: the header crosses apart from the body


@dataclass
class HostState:
    """What the learner knows of one host (for logs and tests)."""

    name: str
    acked: int = 0
    """Newest version the host's relay verified and wrote into its shared memory."""
    joins: int = 0
    failures: int = 0


class HostLink:
    """The learner's end of one host's group: a thread that forms the group and sends versions until it fails."""

    def __init__(self, sender: CollectiveSender, key: str, name: str, sock, address: str):
        """`address`: where this end of the group listens (weights.bind_host, or the interface towards the relay
        when that is a wildcard)."""
        self.sender, self.key, self.name, self.address = sender, key, name, address
        self._sock = sock
        self._group: PairGroup | None = None
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"dgrpo-weights-{name}"[:15], daemon=True)

    def stop(self) -> None:
        self._stopped.set()
        if self._group is not None:
            self._group.abort()  # a call blocked on a dead peer returns now instead of at its timeout
        with self.sender.cond:
            self.sender.cond.notify_all()

    def _run(self) -> None:
        cfg = self.sender.cfg
        state = self.sender.hosts[self.key]
        version, floor = 0, 0
        try:
            self._group = PairGroup(0, self.address, 0, cfg.collective_timeout_s, self.address,
                                    self.sender.backend, listen=self._sock, device=self.sender.device)
            log.info("weights: host %s joined (collective group, %s); sending it version %d", self.name,
                     self.sender.backend, self.sender.latest_version())
            while not self._stopped.is_set():
                ann = self.sender.wait_newer(max(floor, state.acked), cfg.collective_timeout_s / 3, self._stopped)
                if self._stopped.is_set():
                    return
                if ann is None:
                    version = 0
                    self._exchange(None)  # keep-alive: a silent peer is found while idle, not at the next version
                    continue
                t0, version = time.perf_counter(), ann.version
                acked = self._exchange(ann)
                if acked is None:
                    continue  # the slot was rewritten meanwhile: the newer version goes next
                if acked != ann.version:
                    log.error("weights: host %s REJECTED version %d (its relay's checksums did not verify); it gets "
                              "the next version", self.name, ann.version)
                    state.failures += 1
                    floor = ann.version
                    continue
                state.acked = acked
                seconds = time.perf_counter() - t0
                log.info("weights: host %s has version %d (%.1f MB in %.3fs, %.2f Gbit/s)", self.name, acked,
                         ann.nbytes / 1e6, seconds, ann.nbytes * 8 / max(seconds, 1e-9) / 1e9)
        except CollectiveRefused as e:
            state.failures += 1
            log.error("weights: host %s: %s", self.name, e)
        except CollectiveError as e:
            if self._stopped.is_set():
                return
            state.failures += 1
            what = f"during version {version}" if version else "while idle"
            log.error("weights: host %s stopped answering %s (%s); its group is torn down and the latest version "
                      "is sent again when its relay rejoins", self.name, what, e)
        except Exception:
            log.exception("weights: the link to host %s failed", self.name)
        finally:
            if self._group is not None:
                self._group.abort()
            self.sender.forget(self)

    def _exchange(self, ann: Announcement | None) -> int | None:
        """One round: the head, then (a version) its announcement, slot header and body; the relay's ack (the
        version it verified and wrote, 0 if none). None: the slot no longer holds `ann`, nothing was sent."""
        group, cfg = self._group, self.sender.cfg
        if ann is None:
            group.broadcast(torch.tensor([KIND_KEEPALIVE, 0, 0, 0, 0], dtype=torch.int64))
            return self._ack()
        buf = self.sender.slot_buffer(ann)
        if buf is None:
            return None
        raw = ann.SerializeToString()
        chunk = cfg.collective_chunk_mb << 20
        group.broadcast(torch.tensor([KIND_VERSION, len(raw), SLOT_HEADER_BYTES, ann.nbytes, chunk], dtype=torch.int64))
        group.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        data = torch.frombuffer(buf, dtype=torch.uint8, count=ann.nbytes)
        group.broadcast(data[:SLOT_HEADER_BYTES].clone())
        for start in range(SLOT_HEADER_BYTES, ann.nbytes, chunk):
            group.broadcast(data[start:start + chunk])
        acked = self._ack()
        if acked != ann.version and self.sender.slot_buffer(ann) is None:
            return None  # rewritten while it crossed: the relay's checksums caught it, the newer version goes next
        return acked

    def _ack(self) -> int:
        ack = torch.zeros(1, dtype=torch.int64)
        self._group.allreduce(ack)  # the learner adds 0: the sum is what the relay reports
        return int(ack.item())


class CollectiveSender:
    """All hosts' links; the publisher calls `published` after each version and `join` for each relay's request."""

    def __init__(self, cfg, slots, backend: str = "gloo", device: torch.device | None = None):
        """`slots`: the publisher's `_Slots` (segments, locks, announced) the bytes are read from. `backend`: every
        host's group uses it (weights/collective_backends.py); `device`: where nccl / hccl stage each chunk (the
        learner's own device)."""
        self.cfg, self._slots, self.backend, self.device = cfg, slots, backend, device
        self.cond = threading.Condition()
        self._latest: Announcement | None = None
        self.hosts: dict[str, HostState] = {}
        self._links: dict[str, HostLink] = {}
        self._closed = False

    def join(self, key: str, name: str, relay_address: str = "") -> int:
        """A relay asks to join for host `key`: replace that host's earlier link, open a group; return its port."""
        address = self.cfg.bind_host
        if address in WILDCARDS and relay_address:
            address = local_address_towards(relay_address, 9)
        sock = listen_socket(self.cfg.bind_host)
        with self.cond:
            if self._closed:
                sock.close()
                raise RuntimeError("the weight publisher is closing")
            old = self._links.pop(key, None)
            state = self.hosts.setdefault(key, HostState(name))
            state.name, state.acked = name, 0  # a new relay: what the old one acknowledged says nothing of it
            state.joins += 1
            link = HostLink(self, key, name, sock, address)
            self._links[key] = link
        if old is not None:
            log.warning("weights: host %s has a new relay; dropping the previous one's group", name)
            old.stop()
        port = sock.getsockname()[1]
        link.thread.start()
        return port

    def published(self, ann: Announcement) -> None:
        with self.cond:
            self._latest = ann
            self.cond.notify_all()

    def latest_version(self) -> int:
        return self._latest.version if self._latest is not None else 0

    def wait_newer(self, acked: int, timeout_s: float, stopped: threading.Event) -> Announcement | None:
        """The latest announcement if newer than `acked` (or of another incarnation), else None after `timeout_s`
        (time for a keep-alive)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not stopped.is_set() and not self._closed:
                if self._latest is not None and self._latest.version != acked:
                    return self._latest
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
        return None

    def slot_buffer(self, ann: Announcement):
        """The slot's buffer while it still holds `ann` (else None). No lock is held while the bytes cross, so a
        slow host never blocks the publisher: a slot rewritten under a transfer fails the relay's checksums and is
        never served (the relay verifies every version before its host sees it)."""
        held = self._slots.announced[ann.slot]
        same = held is not None and held.version == ann.version and held.seq == ann.seq
        return self._slots.segments[ann.slot].buffer if same else None

    def forget(self, link: HostLink) -> None:
        with self.cond:
            if self._links.get(link.key) is link:
                del self._links[link.key]

    def close(self) -> None:
        with self.cond:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            self.cond.notify_all()
        for link in links:
            link.stop()
        for link in links:
            link.thread.join(timeout=5)
