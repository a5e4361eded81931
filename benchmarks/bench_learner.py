"""Learner throughput: forward+backward tokens/s of the actor update, padded vs packed micro-batches.

GRPO completions have very uneven lengths (a few tokens to max_tokens), so padding each micro-batch to its
longest sequence wastes compute; and the n completions of a group share their prompt, which packing can compute
once. This runs the real `Actor.update` on the bundled SmolLM2-135M-Instruct over a batch of groups of 4 with a
GRPO-like length spread: padded micro-batches of a fixed sequence count, packed by a token budget holding the same
number of sequence tokens on average, and packed with shared prompts; it prints the medians.

    python benchmarks/bench_learner.py [--sequences 16] [--micro 4] [--repeats 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def make_batch(n: int, max_completion: int, seed: int):
    from dgrpo.learner.update.batch import Sequence

    rng = random.Random(seed)
    seqs = []
    for i in range(n):
        if i % 4 == 0:  # groups of 4 completions of one prompt
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(30, 70))]
        # long-tailed completion lengths, as GRPO rollouts have: many short answers, some hitting the cap
        c = min(max_completion, int(rng.expovariate(1 / (max_completion / 3))) + 8)
        seqs.append(Sequence(prompt, [rng.randrange(100, 40000) for _ in range(c)], (-1.0) ** i))
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per step (groups of 4)")
    parser.add_argument("--micro", type=int, default=4, help="padded micro-batch size (sequences)")
    parser.add_argument("--max-completion", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()

    import torch

    from dgrpo.common.models import resolve_model_path
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig

    path = resolve_model_path(args.model)
    seqs = make_batch(args.sequences, args.max_completion, seed=0)
    real = sum(len(s) for s in seqs)
    budget = args.micro * real // len(seqs)  # same tokens per micro-batch as the padded layout on average
    print(f"model {path.name}, torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}")
    print(f"batch: {len(seqs)} sequences, {real} tokens (lengths {min(map(len, seqs))}..{max(map(len, seqs))})")

    modes = {
        f"padded (micro-batch {args.micro} seqs)": {"micro_batch_size_per_device": args.micro},
        f"packed (budget {budget} tokens)": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": budget,
                                              "share_prompts": False},
        "packed, shared prompts": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": budget,
                                   "share_prompts": True},
    }
    actors = {
        name: Actor(
            path,
            ActorConfig(ppo_mini_batch_size=len(seqs) // 4, dtype=args.dtype, compute_entropy=False, **kw),
            OptimConfig(lr=1e-7),
            AlgorithmConfig(),
            total_steps=100,
            max_response_length=args.max_completion,
        )
        for name, kw in modes.items()
    }
    for actor in actors.values():
        actor.update(seqs, group_size=4)  # warm-up (allocator, kernels)
    # Modes alternate step by step, so a shared machine's changing load hits both alike.
    times: dict[str, list[float]] = {name: [] for name in modes}
    last: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for name, actor in actors.items():
            t0 = time.perf_counter()
            last[name] = actor.update(seqs, group_size=4)
            times[name].append(time.perf_counter() - t0)
            print(f"  {name}: step {times[name][-1]:.2f} s", flush=True)
    results = {}
    for name in modes:
        med, m = statistics.median(times[name]), last[name]
        results[name] = (med, m)
        print(
            f"{name:34s} median {med:6.2f} s/step  {real / med:8.1f} real tokens/s  "
            f"computed {m['actor/computed_tokens_ratio']:4.2f} per sequence token  loss {m['actor/loss']:+.6f}"
        )
    (t_pad, _), (t_pack, _), (t_shared, _) = results.values()
    print(f"speed-up over padded: packed {t_pad / t_pack:.2f}x, packed with shared prompts {t_pad / t_shared:.2f}x")


if __name__ == "__main__":
    main()
