"""Rewarder throughput: completions scored per second, math verifier and a tiny reward model, 1 and 2 workers.

Scores 1,000 completions (125 groups of 8) through the real Scorer (the gRPC servicer's domain object) with
real worker processes, so the figure includes the process boundary (pickling, one call per group for
functions, one batch per worker for models) but not gRPC framing. Each configuration gets one warm-up
request (math-verify's lazy sympy imports, the model's first forward) and then `--repeats` timed ones;
the median is printed with the 2-worker / 1-worker ratio. A trivial `length` function shows the floor the
process boundary sets.

    python benchmarks/bench_rewarder.py [--completions 1000] [--repeats 3] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

GROUP = 8


def make_groups(n: int, seed: int = 0):
    from dgrpo.rewarder.scorer import GroupInput

    rng = random.Random(seed)
    groups = []
    for g in range(n // GROUP):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        completions = []
        for _ in range(GROUP):
            guess = a * b + rng.choice([0, 0, 1, -1, 10])
            style = rng.randrange(3)
            if style == 0:
                text = f"We multiply {a} by {b}. {a} x {b} = {guess}. So the answer is \\boxed{{{guess}}}."
            elif style == 1:
                text = f"<think>{a} times {b}, carry the tens...</think><answer>{guess}</answer>"
            else:
                text = f"Let me think step by step about {a} * {b}. " * rng.randint(1, 6) + f"I get {guess}."
            completions.append(text)
        groups.append(GroupInput(f"q{g}", f"What is {a} * {b}?", completions, {"answer": a * b}))
    return groups


def make_tiny_reward_model(folder: Path) -> Path:
    """A 2-layer random LlamaForSequenceClassification with the bundled tokenizer (same as the tests')."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from dgrpo.common.models import prepare_bundled_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled_model())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


async def measure(function: dict, workers: int, groups, repeats: int) -> tuple[list[float], float]:
    from dgrpo.rewarder.config import RewarderConfig
    from dgrpo.rewarder.scorer import Scorer

    cfg = RewarderConfig.model_validate({"workers": workers, "spec": {"functions": [function]}})
    scorer = Scorer(cfg)
    started = time.perf_counter()
    await scorer.start()
    load_s = time.perf_counter() - started
    try:
        await scorer.score(groups[: max(workers, 2)])  # warm-up
        rates = []
        n = sum(len(g.completions) for g in groups)
        for _ in range(repeats):
            t = time.perf_counter()
            result = await scorer.score(groups)
            rates.append(n / (time.perf_counter() - t))
            assert all(s.ok for g in result.groups for s in g), "a benchmark completion failed to score"
    finally:
        await scorer.close()
    return rates, load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    groups = make_groups(args.completions)
    with tempfile.TemporaryDirectory() as tmp:
        rm = make_tiny_reward_model(Path(tmp) / "tiny-rm")
        functions = {
            "math_verify": {"type": "math_verify"},
            "tiny reward model": {"type": "model", "path": str(rm)},
            # A trivial function: the floor set by the process boundary and one call per group.
            "length (floor)": {"type": "length"},
        }
        print(f"{sum(len(g.completions) for g in groups)} completions in groups of {GROUP}; "
              f"median of {args.repeats} runs after one warm-up")
        for label, function in functions.items():
            medians = {}
            for w in args.workers:
                rates, load_s = asyncio.run(measure(function, w, groups, args.repeats))
                medians[w] = statistics.median(rates)
                print(f"  {label:18s} workers={w}: {medians[w]:8.1f} completions/s "
                      f"(runs: {', '.join(f'{r:.1f}' for r in rates)}; spec load {load_s:.1f}s)")
            if 1 in medians and 2 in medians:
                print(f"  {label:18s} 2 workers / 1 worker: {medians[2] / medians[1]:.2f}x")


if __name__ == "__main__":
    main()
