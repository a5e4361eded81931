"""Where one learner update of the CPU demo's batch spends its time, per compute precision.

The demo's batch: 8 prompts of 45 tokens x 4 completions of 8-40 tokens, packed 1024-token micro-batches with
shared prompts, one optimizer update (configs/cpu-demo.yaml's learner.actor). Each mode builds the real `Actor`
on the bundled SmolLM2-135M-Instruct, runs one warm-up update, times three, then profiles one with
torch.profiler and prints the operators with the most CPU time.

    python benchmarks/profile_update.py                          # fp32, bf16 autocast, bf16 on the published copy
    python benchmarks/profile_update.py --modes published --rows 30
    python benchmarks/profile_update.py --modes fp32 --zero-groups 2   # 2 of 8 groups without signal, skipped or not

Run it as `dgrpo learner` runs (the learner re-executes itself on tcmalloc where installed; here the allocator is
whatever the shell gives: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 to match).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

MODES = {
    "fp32": {"dtype": "float32"},
    "autocast": {"dtype": "bfloat16", "bf16_weights": "autocast"},
    "published": {"dtype": "bfloat16", "bf16_weights": "published"},
}


def demo_batch(seed: int = 0, zero_groups: int = 0):
    """The first `zero_groups` groups scored alike (advantage 0: no gradient without a KL)."""
    from dgrpo.learner.update.batch import Sequence

    rng = random.Random(seed)
    seqs = []
    for g in range(8):
        prompt = [rng.randrange(100, 40000) for _ in range(45)]
        for i in range(4):
            completion = [rng.randrange(100, 40000) for _ in range(rng.randint(8, 40))]
            seqs.append(Sequence(prompt, completion, 0.0 if g < zero_groups else (-1.0) ** i))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rows", type=int, default=15, help="operators listed per mode")
    ap.add_argument("--zero-groups", type=int, default=0, choices=range(9),
                    help="groups of the 8 whose completions scored alike; each mode then also runs with "
                         "learner.actor.skip_zero_advantage off, to compare")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from dgrpo.common.models import resolve_model_path
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig

    path, seqs = resolve_model_path(None), demo_batch(zero_groups=args.zero_groups)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(seqs)} sequences, "
          f"{args.zero_groups} groups with advantage 0")
    medians = {}
    runs = [(m, True) for m in args.modes] + ([(m, False) for m in args.modes] if args.zero_groups else [])
    for mode, skip in runs:
        name = mode if skip else f"{mode} (no skip)"
        actor = Actor(path, ActorConfig(ppo_mini_batch_size=8, use_dynamic_bsz=True, max_tokens_per_micro_batch=1024,
                                        skip_zero_advantage=skip, **MODES[mode]),
                      OptimConfig(lr=1e-5), AlgorithmConfig(), total_steps=100, max_response_length=64)
        actor.update(seqs, group_size=4)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            actor.update(seqs, group_size=4)
            times.append(time.perf_counter() - t0)
        medians[name] = statistics.median(times)
        print(f"{name}: update {' '.join(f'{t:.2f}' for t in times)} s, median {medians[name]:.2f} s", flush=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            actor.update(seqs, group_size=4)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
        del actor
    for mode in args.modes if args.zero_groups else []:
        print(f"{mode}: skipping {args.zero_groups} of 8 groups {medians[f'{mode} (no skip)'] / medians[mode]:.2f}x")
    if "fp32" in medians:
        print("vs fp32: " + ", ".join(f"{m} {medians['fp32'] / t:.2f}x" for m, t in medians.items()
                                      if m != "fp32" and "skip" not in m))


if __name__ == "__main__":
    main()
