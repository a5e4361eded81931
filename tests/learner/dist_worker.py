"""One rank of the data-parallel equality test, launched by torchrun from tests/learner/test_distributed.py.

The test imports this file too: `SCENARIOS`, `make_seqs` and `make_actor` build the very same batch and actor
in the single process it compares against.

usage: torchrun --nproc-per-node 2 tests/learner/dist_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, CheckpointConfig, OptimConfig

GROUP = 4
SCENARIOS = {
    # (The checkpoint and export are written from the last scenario's actor.)
    # padded micro-batches, contiguous split, 2 mini-batches (old logprobs recomputed), sharded reference.
    "padded": {
        "actor": {"micro_batch_size_per_device": 2, "balance_batch": False, "ppo_mini_batch_size": 2},
        "algorithm": {"beta": 0.1, "loss_agg": "seq-mean-token-mean"},
    },
    # zero-advantage sequences left out (actor.skip_zero_advantage): the first mini-batch keeps one sequence
    # (topped up to one per rank with a skipped one), the second an odd five (topped up to six).
    "skipped": {
        "actor": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 24, "ppo_mini_batch_size": 2},
        "algorithm": {},
        "zero_advantage": [0, 1, 2, 4, 5, 6, 7, 8, 9, 10],
    },
    # packed by tokens with balance_batch: ranks get different sequences and micro-batch counts.
    "packed": {
        "actor": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 24, "ppo_mini_batch_size": 4},
        "algorithm": {"mask_truncated": True, "tis_cap": 2.0},
    },
}


def make_seqs(scenario: str) -> list[Sequence]:
    zero = set(SCENARIOS[scenario].get("zero_advantage", ()))
    g = torch.Generator().manual_seed(3)
    seqs = []
    for i in range(16):
        p, c = 2 + (i * 7) % 5, 1 + (i * 5) % 9
        ids = torch.randint(5, 2000, (p + c,), generator=g).tolist()
        lp = (-torch.rand(c, generator=g) * 12).tolist()
        advantage = 0.0 if i in zero else float((i * 3) % 4) - 1.5
        seqs.append(Sequence(ids[:p], ids[p:], advantage, lp, truncated=i % 7 == 0))
    return seqs


def make_actor(model_dir, scenario: str, ctx=None) -> Actor:
    spec = SCENARIOS[scenario]
    return Actor(
        model_dir,
        ActorConfig(dtype="float32", **spec["actor"]),
        OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-5),  # see test_actor's packing test: noise stays linear in g
        AlgorithmConfig(**spec["algorithm"]),
        total_steps=4,
        max_response_length=10,
        ctx=ctx,
    )


def main(model_dir: str, out_dir: str) -> None:
    from dgrpo.learner.records.checkpoint import export_hf, save_checkpoint
    from dgrpo.learner.update.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    out = Path(out_dir)
    ctx = init_distributed("cpu")
    try:
        for scenario in SCENARIOS:
            actor = make_actor(model_dir, scenario, ctx)
            metrics = actor.update(make_seqs(scenario), GROUP)
            # Every rank iterates: the gathers are collective. The default bucket holds the whole tiny model; 64 KB
            # buckets cut it into many, of one to several tensors each.
            weights = dict(actor.named_weights(torch.float32))
            small_buckets = dict(actor.named_weights(torch.bfloat16, bucket_bytes=64 << 10))
            if ctx.is_main:
                torch.save({"weights": weights, "small_buckets": small_buckets, "metrics": metrics},
                           out / f"{scenario}.pt")
            else:
                assert weights == {} and small_buckets == {}
        save_checkpoint(actor, CheckpointConfig(dir=str(out / "ckpt")), step=1, extra={"position": 7})
        export_hf(actor, out / "export")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:3])
