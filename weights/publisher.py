"""The learner side of weight sync: write each version into one of two slots, announce it, serve late joiners.

    with WeightPublisher(cfg.weights, run_id, dtype=cfg.model.dtype) as pub:
        pub.publish(model.named_parameters(), version=step)   # HF checkpoint names; fp32 is cast to `dtype`

Two slots: version v goes to the slot not holding v-1, so samplers still loading v-1 are not disturbed while v is
written; a sampler that lags two versions behind sees the slot's sequence lock change and rejects the torn read
(it then loads the newest version instead). The learner never tracks replicas: announcements go out on a pyzmq
XPUB socket (any number of subscribers), and a REP control socket answers "latest" and, for the tcp transport,
"fetch" (the slot bytes). Every message is a typed one of proto/dgrpo/v1/weights.proto (weights/protocol.py); a
malformed request gets an error reply and the control thread goes on serving.

Late joiners: PUB/SUB drops whatever was sent before a subscription reached the publisher. The XPUB socket sees
each subscription arrive and answers it by re-sending the latest announcement (version 0 if none yet), so a new
subscriber learns the current version the moment its subscription is live, with no gap in between. Sockets are
not thread-safe: one control thread owns XPUB and REP; publish() hands announcements to it over an inproc pipe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import ItemsView, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq

from dgrpo.common import tracing
from dgrpo.weights import protocol
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.protocol import Announcement, ProtocolError
from dgrpo.weights.shm import RUN_ID, ShmSegment
from dgrpo.weights.slot import SlotWriter, WrittenSlot, dtype_name
from dgrpo.weights.transports import WeightTransport, transport_for

log = logging.getLogger(__name__)


@dataclass
class PublishStats:
    """What one publish cost (seconds) and moved."""

    version: int
    slot: int
    nbytes: int
    num_tensors: int
    write_s: float
    """Cast + copy into the slot + per-tensor checksums (includes gathering, if the iterable gathers lazily)."""
    announce_s: float
    total_s: float

    @property
    def write_gbps(self) -> float:
        return self.nbytes / max(self.write_s, 1e-9) / 1e9


class _Slots:
    """Two segments plus what each one holds; a lock per slot orders the writer and the tcp fetch server."""

    def __init__(self, transport: WeightTransport, run_id: str):
        self.segments = transport.learner_segments(run_id)
        self.writers = [SlotWriter(seg.ensure) for seg in self.segments]
        self.locks = [threading.Lock(), threading.Lock()]
        self.announced: list[Announcement | None] = [None, None]

    def close(self) -> None:
        for seg in self.segments:
            seg.close(unlink=True)


class WeightPublisher:
    """Publishes weight versions to every sampler; `close()` (or the context manager) removes the segments."""

    def __init__(self, cfg: WeightSyncConfig, run_id: str, dtype: str | torch.dtype = "bfloat16",
                 token: bytes | None = None, device: str | torch.device = "cpu"):
        """`token`: the run's shared secret; with it every message is signed and unsigned requests are refused.
        `device`: the learner's device (rank 0's); collective: weights.collective_backend=auto follows it, and nccl /
        hccl stage each chunk there."""
        if not RUN_ID.match(run_id):
            raise ValueError(f"run_id={run_id!r}: use 1-64 characters from A-Z a-z 0-9 _ . - (it names shm segments)")
        self.cfg, self.run_id, self.dtype = cfg, run_id, dtype_name(dtype)
        self._signer = protocol.Signer(token)
        self._transport = transport_for(cfg)
        self._slots = _Slots(self._transport, run_id)
        self._collective = self._transport.sender(self._slots, device)  # collective: the links to each host's relay
        self.incarnation = secrets.randbits(63) or 1
        """Tells this process's versions from an earlier learner's of the same run (subscriber.py follows a new one)."""
        self._latest: Announcement | None = None
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first, reaches us
        self._pub.bind(f"tcp://{cfg.bind_host}:{cfg.announce_port}")
        self._rep = self._ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(f"tcp://{cfg.bind_host}:{cfg.control_port}")
        inproc = f"inproc://dgrpo-announce-{id(self)}"
        self._announce_rx = self._ctx.socket(zmq.PAIR)
        self._announce_rx.bind(inproc)
        self._announce_tx = self._ctx.socket(zmq.PAIR)
        self._announce_tx.connect(inproc)
        self._announce_lock = threading.Lock()  # publish() may be called from any thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_control, name="dgrpo-weights-control", daemon=True)
        self._thread.start()
        # Segments go away on normal exit even when close() is forgotten; a SIGKILLed run's are reclaimed at the
        # next start (reclaim_stale).
        self._finalizer = weakref.finalize(self, WeightPublisher._cleanup, self._slots, self._stop, self._thread,
                                           self._ctx, [self._pub, self._rep, self._announce_rx, self._announce_tx],
                                           self._collective)
        log.info("weight publisher %s: %s transport, announcements on :%d, control on :%d, dtype %s",
                 run_id, cfg.transport, cfg.announce_port, cfg.control_port, self.dtype)

    # --- publishing ---

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                layout: list[tuple[str, list[int]]] | None = None, adapter_config: str | None = None) -> PublishStats:
        """Write `named_tensors` (HF checkpoint names) as `version` and announce it. Versions must increase.

        `layout` ([(name, shape)] in iteration order) lets a lazy iterable be streamed (`weights.stream`); a list or
        a dict's items give their own. `adapter_config` (PEFT's adapter_config.json) marks the version as a LoRA
        adapter whose tensors carry PEFT's saved names (dgrpo.weights.lora); an adapter is a few MB and is never
        streamed: samplers load it from files once it is complete."""
        if self._finalizer.alive is False:
            raise RuntimeError("publish() after close()")
        if not self._thread.is_alive():  # samplers would never hear of this version: fail the run loudly instead
            raise RuntimeError("the weight channel's control thread has stopped; samplers cannot follow new versions")
        last = self.latest_version
        if version <= last:
            raise ValueError(f"publish(version={version}): versions must increase (last published {last})")
        t0 = time.perf_counter()
        slot = 0 if self._latest is None else 1 - self._latest.slot
        if layout is None and isinstance(named_tensors, (list, tuple, ItemsView)):
            named_tensors = list(named_tensors)
            layout = [(name, list(t.shape)) for name, t in named_tensors]
        stream = self.cfg.stream and self._transport.streams and layout is not None and not adapter_config
        with self._slots.locks[slot]:
            self._slots.announced[slot] = None
            writer = self._slots.writers[slot]
            if stream:
                def started(head: WrittenSlot) -> None:
                    self._announce(self._announcement(version, slot, head, streaming=True))

                written = writer.write_streamed(layout, named_tensors, version, self.dtype, self.run_id, started)
            else:
                written = writer.write(named_tensors, version, self.dtype, self.run_id, adapter_config or "")
            announcement = self._announcement(version, slot, written)
            self._slots.announced[slot] = announcement
        t1 = time.perf_counter()
        if self._latest is None:
            log.info("weight slots: 2 x %.1f MB (%s, %d tensors as %s)", written.nbytes / 1e6,
                     self._transport.slots_place(),
                     len(written.manifest.tensors), self.dtype)
        self._latest = announcement
        self._announce(announcement)
        if self._collective is not None:
            self._collective.published(announcement)  # each host's link sends it; publish() does not wait
        t2 = time.perf_counter()
        stats = PublishStats(version, slot, written.nbytes, len(written.manifest.tensors),
                             write_s=t1 - t0, announce_s=t2 - t1, total_s=t2 - t0)
        log.info("published %s v%d to slot %d: %.1f MB in %.3fs (%.1f GB/s), manifest %016x",
                 "LoRA adapter" if adapter_config else "weights", version, slot, stats.nbytes / 1e6, stats.total_s,
                 stats.write_gbps, announcement.manifest_xxh3)
        return stats

    def _announcement(self, version: int, slot: int, written: WrittenSlot, streaming: bool = False) -> Announcement:
        seg = self._slots.segments[slot]
        return protocol.announcement(
            self.run_id, version, slot=slot, seq=written.seq, transport=self._transport.wire,
            segment=seg.path.name if isinstance(seg, ShmSegment) else "", nbytes=written.nbytes,
            manifest_xxh3=written.manifest_xxh3, manifest=written.manifest, streaming=streaming,
            incarnation=self.incarnation, traceparent=tracing.traceparent(),
        )

    def _announce(self, announcement: Announcement) -> None:
        with self._announce_lock:
            self._announce_tx.send(announcement.SerializeToString())

    @property
    def latest_version(self) -> int:
        return self._latest.version if self._latest else 0

    @property
    def latest(self) -> Announcement:
        """The latest announcement (version 0 when nothing is published yet)."""
        return self._latest if self._latest is not None else protocol.announcement(self.run_id,
                                                                                   incarnation=self.incarnation)

    @property
    def segment_paths(self) -> list[Path]:
        return [s.path for s in self._slots.segments if isinstance(s, ShmSegment)]

    # --- control socket (own thread: zmq sockets are not shared between threads) ---

    def _serve_control(self) -> None:
        poller = zmq.Poller()
        for sock in (self._rep, self._announce_rx, self._pub):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._announce_rx in ready:
                    self._pub.send_multipart(self._signer.seal([protocol.TOPIC, self._announce_rx.recv()]))
                if self._pub in ready and self._pub.recv()[:1] == b"\x01":
                    # A subscription went live: tell (everyone, harmlessly) the latest version.
                    self._pub.send_multipart(self._signer.seal(protocol.encode_announcement(self.latest)))
                if self._rep in ready:
                    self._answer(self._rep.recv_multipart())
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                log.exception("weight control socket failed")

    def _answer(self, frames: list[bytes]) -> None:
        """Exactly one reply per request (REP's contract), whatever the request holds: a peer's bad bytes must not
        end the control thread, or no later version could be fetched or caught up on."""
        try:
            frames = self._signer.open(frames, "control request")
            if len(frames) != 1:
                raise ProtocolError(f"control request: expected 1 frame, got {len(frames)}")
            request = protocol.decode_request(frames[0])
            if request.WhichOneof("request") == "latest":
                self._reply([protocol.latest_reply(self.latest)])
            elif request.WhichOneof("request") == "join":
                self._reply([self._join(request.join)])
            else:
                self._send_slot(request.fetch.version, request.fetch.slot)
        except ProtocolError as e:
            log.warning("weight control: refused a request: %s", e)
            self._reply([protocol.error_reply(str(e))])
        except Exception as e:  # the reply must go out, or the REP socket is stuck for good
            log.exception("weight control: answering a request failed")
            self._reply([protocol.error_reply(f"the learner failed to answer: {type(e).__name__}")])

    def _reply(self, frames: list) -> None:
        # copy=True: zmq owns a copy of a slot's bytes before the slot lock is released (the writer may reuse it).
        self._rep.send_multipart(self._signer.seal(frames), copy=True)

    def _send_slot(self, version: int, slot: int) -> None:
        if not self._transport.fetches:
            raise ProtocolError("weight bytes are served only with weights.transport=tcp (this learner shares "
                                "memory: samplers on other hosts need a learner with the tcp transport)")
        if slot not in (0, 1):
            raise ProtocolError(f"slot {slot} does not exist")
        with self._slots.locks[slot]:
            held = self._slots.announced[slot]
            if held is None or held.version != version:
                raise ProtocolError(f"version {version} is gone (latest is {self.latest_version})")
            seg = self._slots.segments[slot]
            self._reply([protocol.fetched_reply(version, held.seq, held.nbytes), memoryview(seg.buffer)[: held.nbytes]])

    def _join(self, join) -> bytes:
        if self._collective is None:
            raise ProtocolError(f"a relay asked to join a collective group, but this learner's weights.transport is "
                                f"{self.cfg.transport!r} (learner and samplers must both use collective)")
        port = self._collective.join(join.host_key, join.host_name, join.address)
        return protocol.group_reply(port, self._collective.backend, self.cfg.collective_timeout_s)

    @property
    def hosts(self) -> dict:
        """collective: what the learner knows of each host (name, newest acknowledged version, joins, failures)."""
        return dict(self._collective.hosts) if self._collective is not None else {}

    # --- lifecycle ---

    @staticmethod
    def _cleanup(slots: _Slots, stop: threading.Event, thread: threading.Thread, ctx, sockets, collective) -> None:
        stop.set()
        if collective is not None:
            collective.close()
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=2)
        for s in sockets:
            s.close(linger=0)
        ctx.term()
        slots.close()

    def close(self) -> None:
        """Stop serving, close sockets and remove the shared-memory segments (idempotent)."""
        self._finalizer()

    def __enter__(self) -> WeightPublisher:  # noqa: PYI034  (py3.10: no typing.Self)
        return self

    def __exit__(self, *exc) -> None:
        self.close()
