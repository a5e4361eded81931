"""Weight sync: time from `publish` to every sampler replica serving the new version, with its breakdown.

The learner's fp32 weights of the bundled SmolLM2-135M-Instruct are published as bf16 (270 MB) to two vLLM-CPU
replicas, `--rounds` times. Printed: medians of the learner's write (cast + copy + checksums) and announce, each
replica's stage (tcp fetch; checksums verified in place, generation still running), pause, layerwise reload through
vLLM's weight-transfer API + prefix-cache reset, resume, and the end-to-end time until the last replica records the
version.
Next to them, this machine's anchors: memcpy bandwidth (13-16 GB/s measured here) and vLLM's own `reload_weights`
from a safetensors folder in /dev/shm (0.27 s for 270 MB measured here), both re-measured now.

The replicas' API sides share this process (each AsyncLLM in its own event-loop thread), their vLLM engines and
workers are separate processes as in `dgrpo sampler`; the heavy steps (verify, reload) run in those workers.

    python benchmarks/bench_weight_sync.py [--rounds 5] [--replicas 2] [--transport shm|tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path


class Replica:
    """A SamplerEngine + its WeightSubscriber on its own event loop thread."""

    def __init__(self, model_path: str, cfg):
        from dgrpo.common.model_config import ModelConfig
        from dgrpo.sampler.config import SamplerConfig
        from dgrpo.sampler.engine import SamplerEngine
        from dgrpo.sampler.weight_target import EngineWeightTarget
        from dgrpo.weights.subscriber import WeightSubscriber, checkpoint_shapes

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def create():
            return SamplerEngine.create(
                ModelConfig(path=model_path, dtype="bfloat16"),
                SamplerConfig(enforce_eager=True, max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.5),
                model_path, "cpu",
            )

        self.engine = self.run(create(), 600)
        target = EngineWeightTarget(self.engine, cfg.pause_mode)
        self.run(target.start())
        self.loader = WeightSubscriber(cfg, target, checkpoint_shapes(model_path))
        self.run(self.loader.start())

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.loader.stop())
        self.engine.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    import numpy as np

    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def vllm_reload_from_shm(replica: Replica, model_path: str, repeats: int) -> float:
    """vLLM's own `reload_weights(weights_path=...)` from a copy of the checkpoint in /dev/shm (median seconds)."""
    folder = Path(tempfile.mkdtemp(prefix="dgrpo-bench-ckpt-", dir="/dev/shm"))
    try:
        for f in Path(model_path).iterdir():
            if f.is_file():
                shutil.copy(f, folder / f.name)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            replica.run(replica.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)}))
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed publishes (after one warm-up)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import torch
    from transformers import AutoModelForCausalLM

    from dgrpo.common.models import resolve_model_path
    from dgrpo.weights.config import WeightSyncConfig
    from dgrpo.weights.publisher import WeightPublisher

    model_path = str(resolve_model_path(None))
    cfg = WeightSyncConfig(transport=args.transport, host="127.0.0.1", bind_host="127.0.0.1",
                           announce_port=free_port(), control_port=free_port())
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # fp32 master weights
    state = dict(learner.named_parameters())
    print(f"starting {args.replicas} replicas of {model_path} ...", flush=True)
    replicas = [Replica(model_path, cfg) for _ in range(args.replicas)]
    rows = []
    with WeightPublisher(cfg, "bench", dtype="bfloat16") as pub:
        for version in range(1, args.rounds + 2):
            with torch.no_grad():
                for p in state.values():
                    p.mul_(1.0 + 1e-3)  # new weights every round, as after an optimizer step
            t0 = time.perf_counter()
            stats = pub.publish(state.items(), version)
            for r in replicas:
                r.run(r.engine.wait_for_version(version, 120), 150)
                while r.loader.last_stats is None or r.loader.last_stats.version < version:
                    time.sleep(0.001)  # stats are recorded just after the version (after resume)
            loads = [r.loader.last_stats for r in replicas]
            end_to_end = max(s.done_at for s in loads) - t0
            if version > 1:  # the first round pays page faults of fresh segments and buffers
                rows.append((stats, loads, end_to_end))
        nbytes = rows[0][0].nbytes
        reload_s = vllm_reload_from_shm(replicas[0], model_path, repeats=3)
    for r in replicas:
        r.close()
    bandwidth = memcpy_gbps(nbytes)

    def med(values) -> float:
        return statistics.median(values)

    write = med([s.write_s for s, _, _ in rows])
    announce = med([s.announce_s for s, _, _ in rows])
    e2e = med([e for _, _, e in rows])
    print(f"\nweight sync, {args.transport}, {args.replicas} replicas, {nbytes / 1e6:.0f} MB bf16 per version, "
          f"median of {len(rows)} rounds (seconds):")
    print(f"  learner write (fp32->bf16 cast + copy + xxh3) {write:.3f}   ({nbytes / write / 1e9:.2f} GB/s)")
    print(f"  announce                                      {announce:.4f}")
    for i in range(args.replicas):
        parts = {k: med([getattr(loads[i], k) for _, loads, _ in rows])
                 for k in ("fetch_s", "stage_s", "pause_s", "load_s", "resume_s", "total_s")}
        print(f"  replica {i}: fetch {parts['fetch_s']:.3f}  stage (verify in place) {parts['stage_s']:.3f}  "
              f"pause {parts['pause_s']:.3f}  reload+cache reset {parts['load_s']:.3f}  resume {parts['resume_s']:.3f}  "
              f"= {parts['total_s']:.3f} after announce")
    print(f"  END TO END publish -> every replica serving   {e2e:.3f}   (target < 0.3)   "
          f"{nbytes / e2e / 1e9:.2f} GB/s effective")
    print("\nanchors, measured now (quiet-machine figures in docs/weight_sync.md: memcpy 13-16 GB/s, "
          "vLLM reload_weights from /dev/shm 0.27 s):")
    print(f"  memcpy {bandwidth:.1f} GB/s -> one copy of {nbytes / 1e6:.0f} MB = {nbytes / bandwidth / 1e9:.3f} s; "
          f"end to end = {e2e / (nbytes / bandwidth / 1e9):.1f}x one memcpy")
    print(f"  vLLM reload_weights from a safetensors folder in /dev/shm: {reload_s:.3f} s (one replica); "
          f"dgrpo end to end (all replicas) / that = {e2e / reload_s:.2f}x")


if __name__ == "__main__":
    main()
