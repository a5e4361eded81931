"""The sampler side of weight sync: follow the learner's announcements and load each new version into the engine.

    loader = WeightLoader(engine, cfg.weights, model_path)
    await loader.start()   # catches up to the latest published version BEFORE the replica reports SERVING
    ...
    await loader.stop()

Per version: stage (tcp: fetch the bytes into a local staging segment; then every worker copies the slot under its
sequence lock and verifies the checksums — generation keeps running meanwhile), and only if every worker staged
cleanly: pause generation, load through vLLM's layerwise reload, reset the prefix cache, record the version,
resume. A torn or corrupt version is rejected at staging, logged at ERROR, and the replica keeps serving the
previous one; the next announcement supersedes it. Announcements that queue up during a load are coalesced: only
the newest is loaded.

Late joiners: PUB/SUB drops what was sent before a subscription is live, so the learner's XPUB socket answers
every new subscription with the latest announcement. `start()` waits (bounded by `catch_up_timeout_s`) for that
first message and loads the version it names before returning, i.e. before the replica reports SERVING; nothing
published after it can be missed. A learner that starts (or restarts) later sends the same on reconnection.
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

from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.publisher import TOPIC
from dgrpo.weights.shm import ShmSegment, owner_tag, reclaim_stale

log = logging.getLogger(__name__)


@dataclass
class LoadStats:
    """Seconds spent on one version, from announcement to serving it."""

    version: int
    nbytes: int
    fetch_s: float
    """tcp only: bytes from the learner into the local staging segment."""
    stage_s: float
    """Workers copy the slot under its sequence lock and verify checksums (generation still running)."""
    pause_s: float
    load_s: float
    """Layerwise reload inside the workers (generation paused)."""
    reset_s: float
    """Prefix-cache reset + resume."""
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


class WeightLoader:
    """Keeps one sampler engine on the newest weight version the learner has published."""

    def __init__(self, engine, cfg: WeightSyncConfig, model_path: str | Path):
        self.engine, self.cfg = engine, cfg
        self.run_id: str | None = None
        self.last_stats: LoadStats | None = None
        self.rejected: list[str] = []
        self._shapes = checkpoint_shapes(model_path)
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._staging: ShmSegment | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._control = f"tcp://{cfg.host}:{cfg.control_port}"

    # --- lifecycle ---

    async def start(self) -> None:
        """Subscribe, catch up to the latest published version (bounded wait), then follow announcements."""
        reclaim_stale(self.cfg.shm_dir)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(f"tcp://{self.cfg.host}:{self.cfg.announce_port}")
        try:
            frames = await asyncio.wait_for(self._sub.recv_multipart(), self.cfg.catch_up_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            log.info("no weight publisher answered at %s:%d; serving version %d until one announces",
                     self.cfg.host, self.cfg.announce_port, self.engine.weight_version)
        else:
            try:
                await self._handle(frames)
            except Exception:  # serve what we have rather than not at all; the failure is logged loudly
                log.exception("catching up on weights failed; serving version %d", self.engine.weight_version)
        self._task = asyncio.get_running_loop().create_task(self._listen())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub is not None:
            self._sub.close(linger=0)
        self._ctx.term()
        if self._staging is not None:
            self._staging.close(unlink=True)

    async def _listen(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            # Coalesce: while we were busy more announcements may have queued; only the newest matters.
            while await self._sub.poll(0):
                frames = await self._sub.recv_multipart()
            try:
                await self._handle(frames)
            except Exception:  # keep following: the next announcement may well load
                log.exception("weight update failed; still serving version %d", self.engine.weight_version)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != TOPIC:
            log.warning("ignoring a malformed weight announcement (%d frames)", len(frames))
            return
        announcement = json.loads(frames[1])
        if announcement.get("version", 0) > 0:  # 0: the learner is up but has published nothing yet
            await self.load(announcement)

    # --- loading one version ---

    def _is_new(self, ann: dict) -> bool:
        if self.run_id is not None and ann["run_id"] != self.run_id:
            log.warning("weights from a new run %r (was %r): following it", ann["run_id"], self.run_id)
            return True
        return ann["version"] > self.engine.weight_version

    def _check_manifest(self, ann: dict) -> str | None:
        for t in ann["manifest"]["tensors"]:
            expected = self._shapes.get(t["name"])
            if expected is None:
                return f"version {ann['version']}: tensor {t['name']!r} is not in the sampler's checkpoint"
            if list(expected) != list(t["shape"]):
                return f"version {ann['version']}: {t['name']} has shape {t['shape']}, the checkpoint {expected}"
        return None

    async def load(self, ann: dict) -> bool:
        """Load the announced version; False (and the old version kept) if it is stale, torn or corrupt."""
        async with self._lock:
            if not self._is_new(ann):
                return False
            version, t0 = ann["version"], time.perf_counter()
            problem = self._check_manifest(ann)
            # The slot's name, under our own shm_dir: a container may mount the learner's /dev/shm elsewhere.
            path = str(Path(self.cfg.shm_dir) / Path(ann["path"]).name) if ann["path"] else None
            seq, fetch_s = ann["seq"], 0.0
            if problem is None and (self.cfg.transport == "tcp" or path is None):
                path, seq, problem = await self._fetch(ann)
                fetch_s = time.perf_counter() - t0
            if problem is None:
                problem = await self._stage(path, version, seq, ann["manifest_xxh3"])
            if problem is not None:
                self.rejected.append(problem)
                log.error("REJECTED weight version %d: %s — still serving version %d", version, problem,
                          self.engine.weight_version)
                return False
            t1 = time.perf_counter()
            llm = self.engine.llm
            # clear_cache=False: the prefix cache is reset explicitly after the load (below), once.
            await llm.pause_generation(mode=self.cfg.pause_mode, clear_cache=False)
            t2 = time.perf_counter()
            try:
                await llm.collective_rpc("dgrpo_apply_weights", args=(version,))
                t3 = time.perf_counter()
                # KV blocks computed by the old weights must not be reused for new prompts.
                await llm.reset_prefix_cache()
                self.engine.set_weight_version(version)
                done_at = time.perf_counter()
                self.run_id = ann["run_id"]
            finally:
                await llm.resume_generation()
            t4 = time.perf_counter()
            self.last_stats = LoadStats(version, ann["nbytes"], fetch_s, t1 - t0 - fetch_s, t2 - t1, t3 - t2,
                                        t4 - t3, t4 - t0, done_at)
            log.info("loaded weight version %d (%.1f MB) in %.3fs: fetch %.3f stage %.3f pause %.3f load %.3f "
                     "reset %.3f", version, ann["nbytes"] / 1e6, t4 - t0, fetch_s, t1 - t0 - fetch_s, t2 - t1,
                     t3 - t2, t4 - t3)
            return True

    async def _stage(self, path: str, version: int, seq: int, manifest_xxh3: int) -> str | None:
        results = await self.engine.llm.collective_rpc(
            "dgrpo_stage_weights", args=(path, version, seq, manifest_xxh3, self.cfg.verify_checksums)
        )
        errors = [r["error"] for r in results if not r["ok"]]
        return errors[0] if errors else None

    async def _fetch(self, ann: dict) -> tuple[str | None, int, str | None]:
        """tcp transport: copy the version's bytes from the learner into our staging segment."""
        reply = await self._request({"op": "fetch", "version": ann["version"], "slot": ann["slot"]},
                                    self.cfg.fetch_timeout_s, copy=False)
        if reply is None:
            return None, 0, f"version {ann['version']}: no bytes from {self._control} in {self.cfg.fetch_timeout_s}s"
        meta = json.loads(reply[0].bytes)
        if "error" in meta:
            return None, 0, meta["error"]
        data = reply[1].buffer
        if self._staging is None:
            self._staging = ShmSegment(Path(self.cfg.shm_dir) / f"dgrpo-r-{owner_tag()}-{id(self) % 10**6}")
            weakref.finalize(self, self._staging.close)  # removed at exit even if stop() is never reached
        buf = self._staging.ensure(len(data))
        buf[: len(data)] = data
        return str(self._staging.path), meta["seq"], None

    async def _request(self, message: dict, timeout_s: float, copy: bool = True) -> list | None:
        """One REQ/REP exchange on a fresh socket (a REQ socket that timed out cannot be reused)."""
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self._control)
            await sock.send(json.dumps(message).encode())
            if not await sock.poll(int(timeout_s * 1000)):
                return None
            return await sock.recv_multipart(copy=copy)
        finally:
            sock.close(linger=0)
