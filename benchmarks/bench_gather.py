"""Weight gather for publishing: one parameter at a time vs buckets of overlapped all-gathers, on FSDP2 shards.

Two gloo ranks on CPU (torch.multiprocessing, one thread each) shard the bundled SmolLM2-135M-Instruct with the
learner's own `shard_model` (a unit per decoder layer, then the root) and gather every full tensor the way a
publish does: every rank iterates, rank 0 receives the tensors. Paths, alternated round by round so a shared
machine's changing load hits them alike:

- per-parameter: `DTensor.full_tensor()` one parameter after the other, cast on the host afterwards;
- bucketed N MB: `dgrpo.weights.gather.full_tensors`, every all-gather of a bucket issued at once
  (`redistribute(async_op=True)`), the local shard cast before the gather.

Printed per path and gather dtype (fp32: what the stochastic bf16 publish gathers; bf16: the nearest-rounding
publish): median seconds per full gather, the speed relative to per-parameter, and rank 0's peak extra resident
memory while the tensors stream out. Memory is measured by a second pair of processes, one gather per path, with
glibc's mmap threshold fixed at 128 KB from the start (mallopt), so every freed tensor leaves RSS at once: RSS
sampled at every yielded tensor minus RSS before the gather is the peak of gathered tensors alive (pages written;
an all-gather's output counts once the data lands). The consumer drops each tensor as the slot writer does
after its copy; `--publish-cast` also runs the stochastic bf16 rounding of a publish on rank 0 (weights/rounding.py)
while the gathers are in flight.

    python benchmarks/bench_gather.py [--rounds 5] [--buckets 1 64 512] [--dtypes float32 bfloat16] [--publish-cast]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import socket
import statistics
import time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def per_parameter(model, dtype):
    """One blocking all-gather per parameter, cast after it (the gather Actor.named_weights used to run)."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        t = param.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t.to(device="cpu", dtype=dtype)


def worker(rank: int, port: int, args, memory: bool) -> None:
    """Time every path (`memory` False), or measure each path's peak memory once (True, a fresh process group)."""
    if memory:
        ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, fixed: every free unmaps at once
    import torch
    import torch.distributed as dist

    from dgrpo.learner.update.actor import load_causal_lm
    from dgrpo.learner.update.distributed import shard_model
    from dgrpo.weights.gather import full_tensors
    from dgrpo.weights.rounding import publish_cast

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = shard_model(load_causal_lm(args.model, torch.device("cpu")))
    params = sum(p.numel() for p in model.parameters())
    paths = {"per-parameter": per_parameter}
    for mb in args.buckets:
        paths[f"bucketed {mb} MB"] = lambda m, d, mb=mb: full_tensors(m, bucket_bytes=mb << 20, dtype=d)

    cast = (lambda t: t) if not args.publish_cast else publish_cast(torch.bfloat16, "stochastic", seed=0)[1]

    def gather(path, dtype, peak=None) -> float:
        """Seconds from both ranks ready to both ranks done."""
        dist.barrier()
        base = rss_bytes()
        t0 = time.perf_counter()
        count = 0
        for _, tensor in path(model, dtype):
            count += tensor.numel()
            if peak is not None:
                peak[0] = max(peak[0], rss_bytes() - base)
            if rank == 0:
                cast(tensor)
            del tensor
        dist.barrier()
        assert count == params, (count, params)
        return time.perf_counter() - t0

    if memory:
        for dtype_name in args.dtypes:
            for name, path in paths.items():
                peak = [0]
                gather(path, getattr(torch, dtype_name), peak)
                if rank == 0:
                    print(f"  peak extra RSS, {dtype_name} {name}: {peak[0] / 2**20:.0f} MB", flush=True)
        dist.destroy_process_group()
        return
    times = {(d, name): [] for d in args.dtypes for name in paths}
    for round_ in range(args.rounds + 1):  # round 0 warms up (allocator, gloo buffers)
        for dtype_name in args.dtypes:
            for name, path in paths.items():
                seconds = gather(path, getattr(torch, dtype_name))
                if round_:
                    times[dtype_name, name].append(seconds)
    if rank == 0:
        for dtype_name in args.dtypes:
            ref = statistics.median(times[dtype_name, "per-parameter"])
            print(f"gather dtype {dtype_name}{' + stochastic bf16 cast' if args.publish_cast else ''}: "
                  f"{params / 1e6:.1f}M parameters, median of {args.rounds} rounds")
            for name in paths:
                ts = times[dtype_name, name]
                med = statistics.median(ts)
                print(f"  {name:16s} {med:6.3f} s/gather  {ref / med:5.2f}x per-parameter's speed  "
                      f"(rounds {' '.join(f'{t:.2f}' for t in ts)})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=5, help="timed gathers per path (after one warm-up)")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 64, 512], help="bucket sizes, MB")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--publish-cast", action="store_true", help="stochastic bf16 rounding on rank 0 too")
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    from dgrpo.common.models import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    print(f"model {os.path.basename(args.model)}, torch {torch.__version__}, 2 gloo ranks x 1 thread, "
          f"{os.cpu_count()} cores", flush=True)
    mp.spawn(worker, args=(free_port(), args, False), nprocs=2)
    print("memory (fresh processes, glibc mmap threshold fixed at 128 KB):", flush=True)
    mp.spawn(worker, args=(free_port(), args, True), nprocs=2)


if __name__ == "__main__":
    main()
