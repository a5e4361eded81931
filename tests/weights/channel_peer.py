"""A sampler replica without vLLM, for the weight channel's process tests (tests/weights/test_channel.py).

    python channel_peer.py --config '<WeightSyncConfig JSON>' --shapes '{"name": [rows, cols], ...}' [hooks]
    python channel_peer.py --argv-from-stdin   # the same arguments as one JSON line, once torch is imported

Runs a `WeightSubscriber` that loads into `ModuleTarget`, the second real `WeightTarget` next to the sampler's vLLM
adapter: a plain dict of bf16 tensors read in place from the slot. Every event is one JSON line on stdout
(`{"event": "serving", "version": 2, "sums": {...}}`), flushed at once so the test sees it while the peer runs;
logs go to stderr. A line on stdin (or its end) stops the peer; exit status 0, or 3 when the channel broke.
Test hooks: --apply-delay-s (between copying and the overlap check, so that a test can rewrite the slot during the
load), --resume-delay-s (before generation resumes, so that announcements queue up behind a finished load) and
--fail-streamed-loads N (the first N streamed loads fail once their write has finished, after --apply-delay-s: a
fault in the load itself, with the version intact in its slot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
import xxhash

from dgrpo.weights.config import WeightSyncConfig
from dgrpo.weights.slot import SlotReader, WeightIntegrityError, open_slot
from dgrpo.weights.subscriber import WeightSubscriber
from dgrpo.weights.target import SlotRef, TornLoad, WeightChannelBroken


def emit_json(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class ModuleTarget:
    """Loads weight versions into a dict of bf16 tensors; reports each step through `emit(event, **fields)`."""

    def __init__(self, shapes: dict[str, list[int]], emit: Callable[..., None] = emit_json, *,
                 apply_delay_s: float = 0.0, resume_delay_s: float = 0.0, fail_streamed_loads: int = 0,
                 report_sums: bool = True):
        self.state = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
        self.emit = emit
        self.apply_delay_s, self.resume_delay_s = apply_delay_s, resume_delay_s
        self.fail_streamed_loads = fail_streamed_loads
        self.report_sums = report_sums
        self._version = 0
        self._staged: tuple[SlotReader, object] | None = None

    @property
    def weight_version(self) -> int:
        return self._version

    def sums(self) -> dict[str, float]:
        """Per-tensor sums of what is loaded (exact: the tests publish small integers)."""
        return {name: float(t.double().sum()) for name, t in self.state.items()}

    def digests(self) -> dict[str, int]:
        """Per-tensor xxh3-64 of the bytes loaded (what the learner's manifest says each tensor's bytes hash to)."""
        return {name: xxhash.xxh3_64_intdigest(t.view(torch.uint8).numpy()) for name, t in self.state.items()}

    def _open(self, ref: SlotRef) -> None:
        self._release()
        self._staged = open_slot(ref)  # the sampler's own opening and staging (sampler/vllm_transfer.py)

    async def stage(self, ref: SlotRef) -> None:
        self.emit("staging", version=ref.version, path=ref.path)
        self._open(ref)
        try:
            self._staged[0].stage(ref.verify)
        except BaseException:
            self._release()
            raise

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[float]:
        t0 = time.perf_counter()
        self.emit("paused")
        try:
            yield time.perf_counter() - t0
        except WeightChannelBroken:
            raise  # stays paused, as the sampler's target does: the state may be a mix of versions
        except BaseException:
            self.emit("resumed", version=self._version)
            raise
        await asyncio.sleep(self.resume_delay_s)
        self.emit("resumed", version=self._version)

    async def apply(self, ref: SlotRef) -> None:
        """Copy the staged version in; a streamed one (still being written) is opened here and each tensor checked
        as it is read. Any failure once copying began may leave a mix: it is reported as TornLoad."""
        if ref.streamed:
            self._open(ref)
        elif self._staged is None or self._staged[0].version != ref.version:
            raise RuntimeError(f"apply of weight version {ref.version}: it is not the staged one")
        reader = self._staged[0]
        try:
            try:
                self._copy(reader, verify=ref.streamed and ref.verify, streamed=ref.version if ref.streamed else None)
                self.emit("applying", version=ref.version, streamed=ref.streamed)
                await asyncio.sleep(self.apply_delay_s)
                reader.check_intact()
                if ref.streamed and self.fail_streamed_loads > 0:
                    self.fail_streamed_loads -= 1
                    raise WeightIntegrityError(f"version {ref.version}: injected fault in the streamed load")
            except WeightIntegrityError as e:
                self.emit("torn", version=ref.version, why=str(e))
                raise TornLoad(str(e)) from None
        finally:
            self._release()

    def set_version(self, version: int) -> None:
        self._version = version
        at = time.perf_counter()  # before the sums: when a benchmark's version started serving
        if self.report_sums:
            self.emit("serving", version=version, at=at, sums=self.sums(), digests=self.digests())
        else:
            self.emit("serving", version=version, at=at)

    def _copy(self, reader: SlotReader, verify: bool, streamed: int | None = None) -> None:
        """`streamed`: the version of a streamed load, whose every copied tensor is reported (`copied`), so a test
        can act while the load is under way rather than after a guessed sleep."""
        with torch.no_grad():
            for name, tensor in reader.tensors(verify=verify):
                if name not in self.state or tensor.shape != self.state[name].shape:
                    raise WeightIntegrityError(f"{name} {list(tensor.shape)} in the slot is not in the state")
                self.state[name].copy_(tensor)
                if streamed is not None:
                    self.emit("copied", version=streamed, name=name)

    def _release(self) -> None:
        if self._staged is not None:
            reader, mapped = self._staged
            self._staged = None
            reader.release()
            try:
                mapped.close()
            except BufferError:
                pass  # a view is still alive (a traceback); the mapping goes with it


async def run(args: argparse.Namespace) -> int:
    cfg = WeightSyncConfig.model_validate_json(args.config)
    shapes = json.loads(args.shapes)
    target = ModuleTarget(shapes, apply_delay_s=args.apply_delay_s, resume_delay_s=args.resume_delay_s,
                          fail_streamed_loads=args.fail_streamed_loads, report_sums=not args.no_sums)
    subscriber = WeightSubscriber(cfg, target, shapes)
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    # A daemon thread, not the loop's executor: a broken channel must exit without waiting on stdin.
    threading.Thread(target=lambda: (sys.stdin.readline(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    reported = 0

    def report_rejections() -> None:
        nonlocal reported
        for why in subscriber.rejected[reported:]:
            emit_json("rejected", why=why, version=target.weight_version, sums=target.sums())
        reported = len(subscriber.rejected)

    await subscriber.start()
    report_rejections()
    emit_json("started", version=target.weight_version)
    while not stop.is_set() and subscriber.failed is None:
        report_rejections()
        try:
            await asyncio.wait_for(stop.wait(), 0.02)
        except asyncio.TimeoutError:
            pass
    report_rejections()
    failed = subscriber.failed
    await subscriber.stop()
    if failed is not None:
        emit_json("broken", why=str(failed), version=target.weight_version)
        return 3
    emit_json("stopped", version=target.weight_version)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="WeightSyncConfig as JSON")
    parser.add_argument("--shapes", required=True, help="expected tensor shapes as JSON: {name: shape}")
    parser.add_argument("--apply-delay-s", type=float, default=0.0)
    parser.add_argument("--resume-delay-s", type=float, default=0.0)
    parser.add_argument("--fail-streamed-loads", type=int, default=0)
    parser.add_argument("--no-sums", action="store_true", help="serving events without sums and digests (a benchmark)")
    argv = sys.argv[1:]
    if argv == ["--argv-from-stdin"]:  # started ahead by a test: the arguments come once they are known
        argv = json.loads(sys.stdin.readline())
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
