"""The samplers' side of the weight channel: follow the learner's announcements and load each new version into a
`WeightTarget` (the sampler's engine adapter; a plain torch module in the channel's own tests).

    subscriber = WeightSubscriber(cfg.weights, target, expected_shapes=checkpoint_shapes(model_path))
    await subscriber.start()   # catches up to the latest published version BEFORE the replica reports SERVING
    ...
    await subscriber.stop()

Per version: check the announcement (protocol revision, run, manifest names and shapes against the checkpoint),
fetch the bytes into a local staging segment (tcp transport), `target.stage` (verify the checksums in place while
generation keeps running), then under `target.paused()`: `target.apply` (load in place, then confirm that no write
overlapped the load) and `target.set_version`. A corrupt version is rejected at staging and the replica keeps
serving the previous one. Streamed versions (`weights.stream`, shm: announced when the learner starts writing) skip
staging: `apply` loads each tensor as soon as it is written and checked, so the write and the load overlap.

A load that failed after touching the model (a rewrite overlapped it; a streamed version turned out corrupt, was
abandoned or stalled) leaves the model mixed: generation stays paused and the newest complete version, or else the
one served before, is loaded at once, so no token is ever sampled from torn weights. Announcements that queue up
during a load are coalesced: only the newest is loaded.

Late joiners: PUB/SUB drops what was sent before a subscription is live, so the learner's XPUB socket answers
every new subscription with the latest announcement. `start()` waits (bounded by `catch_up_timeout_s`) for that
first message and loads the version it names before returning; nothing published after it can be missed.

Collective transport (samplers on another host than the learner): the bytes reach the host once, through its relay
replica (weights/relay.py, elected among the host's replicas), which names each verified version in the host's index
file. Every replica follows that index instead of the announcements and loads from the relay's shared-memory slots
through the same shm path; at start it waits (bounded by `fetch_timeout_s`) until the index holds the learner's
latest version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from dgrpo.common import tracing
from dgrpo.weights import protocol
from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.lora import check_adapter
from dgrpo.weights.protocol import Announcement, ProtocolError
from dgrpo.weights.shm import ShmSegment, owner_tag, reclaim_stale
from dgrpo.weights.slot import WeightIntegrityError, completed_manifest_xxh3
from dgrpo.weights.target import SlotRef, WeightChannelBroken, WeightTarget
from dgrpo.weights.transports import transport_for, transport_of_wire

log = logging.getLogger(__name__)

HOST_POLL_S = 0.02
"""collective: how often a replica checks its host's index for a version the relay wrote (a stat call)."""
MAX_TORN_RETRIES = 3
"""Loads in a row that failed after touching the model before the replica gives up and stops serving."""


@dataclass
class LoadStats:
    """Seconds spent on one version, from announcement to serving it."""

    version: int
    nbytes: int
    streamed: bool
    """Loaded while the learner was still writing it (stage skipped; the load waited for each tensor)."""
    fetch_s: float
    """tcp only: bytes from the learner into the local staging segment."""
    stage_s: float
    """Checksums verified in place (generation still running)."""
    pause_s: float
    load_s: float
    """Load into the engine and the overlap check (generation paused)."""
    resume_s: float
    """Recording the version + resume."""
    total_s: float
    done_at: float
    """time.perf_counter() when the version was recorded (requests fenced on it were released)."""


def checkpoint_shapes(model_path: str | Path) -> dict[str, list[int]]:
    """HF tensor name -> shape, read from the safetensors headers of the model folder (no tensor data)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    config = Path(model_path) / "config.json"
    tied = config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings", False)
    if tied and "model.embed_tokens.weight" in shapes and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]  # tied: a state_dict still names it
    return shapes


class WeightSubscriber:
    """Keeps one target on the newest weight version the learner has published."""

    def __init__(self, cfg: WeightSyncConfig, target: WeightTarget, expected_shapes: dict[str, list[int]],
                 token: bytes | None = None, adapters: bool = False):
        """`token`: the run's shared secret; with it only signed announcements and replies are accepted.
        `adapters`: the target serves LoRA adapters (learner.lora): versions must be adapters of the checkpoint whose
        shapes are `expected_shapes`, and full-weight versions are refused (and the other way round)."""
        self.cfg, self.target, self._shapes, self.adapters = cfg, target, expected_shapes, adapters
        self._signer = protocol.Signer(token)
        self.run_id: str | None = None
        self.current: Announcement | None = None
        """The (complete) announcement of the version served now."""
        self.last_stats: LoadStats | None = None
        self.rejected: list[str] = []
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._staging: ShmSegment | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._control = f"tcp://{cfg.host}:{cfg.control_port}"
        self._transport = transport_for(cfg)
        self._host = None  # collective: this host's relay (elected or not) and its index
        relay = self._transport.host_relay(token)
        if relay is not None:
            self._relay, self._host = relay

    # --- lifecycle ---

    async def start(self) -> None:
        """Subscribe, catch up to the latest published version (bounded wait), then follow announcements."""
        reclaim_stale(self.cfg.shm_dir)
        if self._host is not None:
            self._relay.start()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
        self._sub.connect(f"tcp://{self.cfg.host}:{self.cfg.announce_port}")
        try:
            frames = await asyncio.wait_for(self._sub.recv_multipart(), self.cfg.catch_up_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.info("no weight publisher answered at %s:%d; serving version %d until one announces",
                     self.cfg.host, self.cfg.announce_port, self.target.weight_version)
        else:
            try:
                await self._handle(frames)
            except WeightChannelBroken:
                raise
            except Exception:  # serve what we have rather than not at all; the failure is logged loudly
                log.exception("catching up on weights failed; serving version %d", self.target.weight_version)
        if self._host is not None:  # announcements only named the version to catch up on
            self._sub.close(linger=0)
        follow = self._listen() if self._host is None else self._follow_host()
        self._task = asyncio.get_running_loop().create_task(follow)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            self._sub.close(linger=0)
        self._ctx.term()
        if self._staging is not None:
            self._staging.close(unlink=True)
        if self._host is not None:
            await asyncio.to_thread(self._relay.stop)

    @property
    def failed(self) -> BaseException | None:
        """The error that ended the follower task (WeightChannelBroken), if it ended."""
        if self._task is None or not self._task.done() or self._task.cancelled():
            return None
        return self._task.exception()

    async def _listen(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            # Coalesce: while we were busy more announcements may have queued; only the newest matters.
            while await self._sub.poll(0):
                frames = await self._sub.recv_multipart()
            try:
                await self._handle(frames)
            except WeightChannelBroken:
                raise
            except Exception:  # keep following: the next announcement may well load
                log.exception("weight update failed; still serving version %d", self.target.weight_version)

    async def _handle(self, frames: list[bytes]) -> None:
        try:
            ann = protocol.decode_announcement(self._signer.open(frames, "announcement"))
            transport_of_wire(ann.transport).check_announcement(ann)
        except ProtocolError as e:
            self._reject(f"ignoring an announcement: {e}")
            return
        if ann.streaming and self._transport.fetches:
            return  # its bytes can only be fetched once complete: the complete announcement follows
        sent_by = transport_of_wire(ann.transport)
        if sent_by.relayed != self._transport.relayed and ann.version > 0:
            self._reject(f"weight version {ann.version} comes by weights.transport="
                         f"{sent_by.name}, this sampler's is {self.cfg.transport!r} (the "
                         "learner and its samplers need the same)")
            return
        if self._host is not None:
            if ann.version > 0:
                await self._catch_up_host(ann)
            return
        if ann.version > 0:  # 0: the learner is up but has published nothing yet
            await self.load(ann)

    async def _follow_host(self) -> None:
        """collective: load every version the host's relay names in the index."""
        while True:
            await asyncio.sleep(HOST_POLL_S)
            ann = self._host.changed()
            if ann is None:
                continue
            try:
                await self.load(ann)
            except WeightChannelBroken:
                raise
            except Exception:
                log.exception("weight update failed; still serving version %d", self.target.weight_version)

    async def _catch_up_host(self, learner: Announcement) -> None:
        """collective, at start: load versions from the host's index until it reaches the learner's `learner`."""
        deadline = time.monotonic() + self.cfg.fetch_timeout_s
        while True:
            ann = self._host.read()
            if ann is not None and (ann.run_id, ann.incarnation) == (learner.run_id, learner.incarnation):
                await self.load(ann)
                if self.current is not None and self.current.version >= learner.version and \
                        self.current.incarnation == learner.incarnation:
                    return
            if time.monotonic() > deadline:
                log.warning("the host's relay has not received weight version %d in %.0fs; serving version %d "
                            "and following the host's index", learner.version, self.cfg.fetch_timeout_s,
                            self.target.weight_version)
                return
            await asyncio.sleep(HOST_POLL_S)

    # --- loading one version ---

    def _reject(self, problem: str) -> None:
        self.rejected.append(problem)
        log.error("REJECTED %s — still serving version %d", problem, self.target.weight_version)

    def _is_new(self, ann: Announcement) -> bool:
        if self.run_id is not None and ann.run_id != self.run_id:
            log.warning("weights from a new run %r (was %r): following it", ann.run_id, self.run_id)
            return True
        if self.current is not None and ann.incarnation != self.current.incarnation:
            # A restarted learner resumed from its checkpoint: what it trains on is its version, whatever the number.
            log.warning("weights from a restarted learner of run %r (version %d; version %d came from the previous "
                        "one): following it", ann.run_id, ann.version, self.target.weight_version)
            return True
        return ann.version > self.target.weight_version

    def _check_manifest(self, ann: Announcement) -> str | None:
        adapter = ann.manifest.adapter_config
        if bool(adapter) != self.adapters:
            what = "a LoRA adapter" if adapter else "full weights"
            serves = "LoRA adapters" if self.adapters else "full weights (learner.lora off or merge_on_sync)"
            return f"weight version {ann.version} is {what}; this replica serves {serves}: its stack config differs"
        if adapter:
            problem = check_adapter([(t.name, list(t.shape)) for t in ann.manifest.tensors], adapter, self._shapes)
            return None if problem is None else f"weight version {ann.version}: {problem}"
        for t in ann.manifest.tensors:
            expected = self._shapes.get(t.name)
            if expected is None:
                return f"weight version {ann.version}: tensor {t.name!r} is not in the sampler's checkpoint"
            if list(expected) != list(t.shape):
                return f"weight version {ann.version}: {t.name} has shape {list(t.shape)}, the checkpoint {expected}"
        return None

    async def load(self, ann: Announcement) -> bool:
        """Load the announced version; False (and the old version kept) if it is stale, torn or corrupt."""
        async with self._lock:
            if not self._is_new(ann):
                return False
            # Each replica's load is a span of the step whose publish it loads (the traceparent in the announcement).
            with tracing.span_from("load_weights", ann.traceparent, weight_version=ann.version):
                return await self._load_new(ann)

    async def _load_new(self, ann: Announcement) -> bool:
        """`load` past the newness check, under the lock."""
        t0 = time.perf_counter()
        staged = await self._stage(ann)
        if staged is None:
            return False
        ref, fetch_s = staged
        t1 = time.perf_counter()
        async with self.target.paused() as pause_s:
            t2 = time.perf_counter()
            ref, ann = await self._apply_or_recover(ref, ann)
            t3 = time.perf_counter()
            # Streamed: the id of the manifest as completed (what the learner logs), read before the learner can
            # start rewriting this slot (two versions on), not the announced one (its checksums still unknown).
            manifest = completed_manifest_xxh3(ref) if ref.streamed else ann.manifest_xxh3
            self.target.set_version(ref.version)
            done_at = time.perf_counter()
            self.run_id, self.current = ann.run_id, ann
        t4 = time.perf_counter()
        self.last_stats = LoadStats(ref.version, ann.nbytes, ref.streamed, fetch_s, t1 - t0 - fetch_s, pause_s,
                                    t3 - t2, t4 - t3, t4 - t0, done_at)
        # The manifest id is the learner's `published ... manifest <id>` for the same version (complete or streamed).
        log.info("loaded weight version %d (%.1f MB%s) in %.3fs: fetch %.3f stage %.3f pause %.3f load %.3f "
                 "resume %.3f; %s", ref.version, ann.nbytes / 1e6, ", streamed" if ref.streamed else "",
                 t4 - t0, fetch_s, t1 - t0 - fetch_s, pause_s, t3 - t2, t4 - t3,
                 f"manifest {manifest:016x}" if manifest is not None
                 else f"manifest unknown (the slot was rewritten before its final id was read; announced with "
                      f"{ann.manifest_xxh3:016x}, its checksums not yet in)")
        return True

    async def _stage(self, ann: Announcement) -> tuple[SlotRef, float] | None:
        """Checked, fetched (tcp) and verified `ann`, or None after logging why it is rejected."""
        problem = self._check_manifest(ann)
        if problem is not None:
            self._reject(problem)
            return None
        t0 = time.perf_counter()
        try:
            if self._transport.fetches or transport_of_wire(ann.transport).fetches:
                ref = await self._fetch(ann)
            else:
                # The slot's name under our own shm_dir: a container may mount the learner's /dev/shm elsewhere.
                ref = SlotRef(str(Path(self.cfg.shm_dir) / ann.segment), ann.version, ann.seq, ann.manifest_xxh3,
                              self.cfg.verify_checksums, self.cfg.fetch_timeout_s)
            fetch_s = time.perf_counter() - t0
            if not ref.streamed:
                await self.target.stage(ref)
        except (WeightIntegrityError, ProtocolError, OSError) as e:
            self._reject(f"weight version {ann.version}: {e}")
            return None
        return ref, fetch_s

    async def _apply_or_recover(self, ref: SlotRef, ann: Announcement) -> tuple[SlotRef, Announcement]:
        """Apply `ref`; if that failed after touching the model, load the newest complete version, or else the one
        served before (its slot is untouched: the learner writes the slot not holding the previous version). A
        failed load is told apart by its write (`seq`), not only its version: a streamed version that failed can
        still load once complete, staged and verified like any other (what a replica's first version needs, with
        nothing served before to fall back to)."""
        for _ in range(MAX_TORN_RETRIES):
            try:
                await self.target.apply(ref)
                return ref, ann
            except WeightIntegrityError as e:
                log.warning("weight version %d failed during the load (%s): loading another before resuming",
                            ref.version, e)
                failed = (ann.run_id, ann.incarnation, ann.version, ann.seq)
            for candidate in (await self._latest(), self.current):
                if candidate is None or candidate.version == 0 or (
                        candidate.run_id, candidate.incarnation, candidate.version, candidate.seq) == failed:
                    continue
                staged = await self._stage(candidate)
                if staged is not None:
                    ref, ann = staged[0], candidate
                    break
            else:
                break
        raise WeightChannelBroken(f"no intact weight version after {MAX_TORN_RETRIES} tries (each was rewritten, "
                                  "abandoned or corrupt while it was loaded); this replica must not serve")

    async def _latest(self) -> Announcement | None:
        """The learner's latest complete announcement (collective: the host's), or None when it does not answer
        properly."""
        if self._host is not None:
            return self._host.read()
        reply = await self._request(protocol.latest_request(), self.cfg.catch_up_timeout_s)
        try:
            return None if reply is None else protocol.decode_reply(reply[0]).latest
        except ProtocolError as e:
            log.warning("asking the learner for its latest weights: %s", e)
            return None

    async def _fetch(self, ann: Announcement) -> SlotRef:
        """tcp transport: copy the version's bytes from the learner into our staging segment."""
        reply = await self._request(protocol.fetch_request(ann.version, ann.slot), self.cfg.fetch_timeout_s)
        if reply is None:
            raise ProtocolError(f"no bytes from {self._control} in {self.cfg.fetch_timeout_s}s")
        if len(reply) != 2:
            protocol.decode_reply(reply[0])  # an error reply raises with the learner's message
            raise ProtocolError(f"fetch reply of {len(reply)} frames")
        fetched = protocol.decode_reply(reply[0]).fetched
        data = reply[1].buffer
        if fetched.version != ann.version or fetched.nbytes != len(data):
            raise ProtocolError(f"fetched version {fetched.version} ({len(data)} bytes), announced {ann.version} "
                                f"({fetched.nbytes} bytes)")
        if self._staging is None:
            self._staging = ShmSegment(Path(self.cfg.shm_dir) / f"dgrpo-r-{owner_tag()}-{id(self) % 10**6}")
            weakref.finalize(self, self._staging.close)  # removed at exit even if stop() is never reached
        buf = self._staging.ensure(len(data))
        buf[: len(data)] = data
        return SlotRef(str(self._staging.path), ann.version, fetched.seq, ann.manifest_xxh3, self.cfg.verify_checksums,
                       self.cfg.fetch_timeout_s)

    async def _request(self, message: bytes, timeout_s: float) -> list | None:
        """One REQ/REP exchange on a fresh socket (a REQ socket that timed out cannot be reused): the reply's frames
        (the first as bytes, the others as zmq frames), its signature checked; None on timeout."""
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self._control)
            await sock.send_multipart(self._signer.seal([message]))
            if not await sock.poll(int(timeout_s * 1000)):
                return None
            frames = self._signer.open(await sock.recv_multipart(copy=False), "control reply")
            return [frames[0].bytes, *frames[1:]]
        finally:
            sock.close(linger=0)
