"""A small pipeline model of one GRPO step: lockstep against asynchronous (rollout.max_staleness k).

Inputs, measured per step in lockstep (time/* in the learner's metrics): generate G (sampling and the scoring
tail, on one replica), train T (logprob forwards and the update), sync S (publish; the samplers' load shows in
the next G). With R replicas sharing a batch, sampling takes G / R.

    lockstep (k = 0):  step = G/R + T + S             every device idles while the others work
    async (k >= 1):    step = max(G/R + L, C*T + S)   sampling of batch t+1 overlaps training of batch t

L is what the samplers lose to each weight load while they generate (a pause between engine steps; about the
load time with weights.pause_mode=keep). k > 1 does not raise the steady-state rate; it absorbs variance
(a long batch, a slow replica) so the faster side seldom waits. C (--co-run-slowdown) is how much slower the
update runs while the samplers decode at the same time: 1.0 on separate devices. On this 2-core machine, with the
sampler and the learner on a core each, the median train time rose from 10.9 s (lockstep) to 12.1 s
(asynchronous): C = 1.11, the two cores share memory bandwidth and cache. Asynchronous steps then take
max(G/R + L, C*T + S). On shared, unpinned cores the phases take each other's cores and the model does not apply.

    python benchmarks/pipeline_model.py --generate 7.29 --train 11.01 --sync 0.44 --co-run-slowdown 1.11
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseTimes:
    generate_s: float
    """Sampling and the scoring tail of one step's batch on one replica."""
    train_s: float
    sync_s: float
    replicas: int = 1
    load_pause_s: float = 0.0
    """Generation a sampler loses per weight update in async mode."""
    co_run_slowdown: float = 1.0
    """Train time while the samplers decode at the same time / train time alone (1.0: separate devices)."""


def predict(p: PhaseTimes, k: int) -> float:
    """Seconds per step at max_staleness k."""
    sample = p.generate_s / p.replicas
    if k == 0:
        return sample + p.train_s + p.sync_s
    return max(sample + p.load_pause_s, p.train_s * p.co_run_slowdown + p.sync_s)


def speedup(p: PhaseTimes, k: int = 1) -> float:
    return predict(p, 0) / predict(p, k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", type=float, required=True, help="lockstep generate seconds per step, 1 replica")
    parser.add_argument("--train", type=float, required=True)
    parser.add_argument("--sync", type=float, default=0.0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--load-pause", type=float, default=0.0)
    parser.add_argument("--co-run-slowdown", type=float, default=1.0,
                        help="train time with the samplers decoding at the same time / alone (1.0: own devices)")
    args = parser.parse_args()
    p = PhaseTimes(args.generate, args.train, args.sync, args.replicas, args.load_pause, args.co_run_slowdown)
    for k in (0, 1, 2):
        print(f"k = {k}: {predict(p, k):.2f} s/step ({3600 / predict(p, k):.0f} steps/h, {speedup(p, k):.2f}x)")


if __name__ == "__main__":
    main()
