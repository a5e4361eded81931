"""Prometheus metrics of the learner (rank 0), served on `learner.trainer.metrics_host`:`metrics_port` when set.

Set from each step's metrics as it is logged (`observe_step`) and from its trained batch (`observe_staleness`):
what an operator watches next to the samplers' and the rewarder's series. Gauges hold the last step's values;
`dgrpo_learner_phase_seconds_total` accumulates, so `rate()` of it is the share of wall time each phase takes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dgrpo.common.prometheus import serve_metrics

PHASES = ("generate", "reward", "logprob", "train", "weight_sync", "other")
"""Phases of StepTimer (learner/records/metrics.py) reported; time/<phase>_s in the step's metrics."""


class LearnerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.step = Gauge("dgrpo_learner_step", "Training steps completed", registry=r)
        self.total_steps = Gauge("dgrpo_learner_total_steps", "Training steps the run will take", registry=r)
        self.weight_version = Gauge("dgrpo_learner_weight_version", "Weight version last published", registry=r)
        self.step_seconds = Gauge("dgrpo_learner_step_seconds", "Wall time of the last step", registry=r)
        self.phase_seconds = Gauge(
            "dgrpo_learner_last_step_phase_seconds", "Seconds of the last step spent in each phase", ["phase"],
            registry=r,
        )
        self.phase_total = Counter(
            "dgrpo_learner_phase_seconds", "Seconds spent in each phase, all steps", ["phase"], registry=r
        )
        self.reward_mean = Gauge("dgrpo_learner_reward_mean", "Mean reward of the last step's completions", registry=r)
        self.sample_wait = Gauge(
            "dgrpo_learner_sample_wait_ratio",
            "Share of the last step spent waiting for samples (time/generate_s / time/step_s)",
            registry=r,
        )
        self.staleness_mean = Gauge(
            "dgrpo_learner_staleness_mean_versions", "Mean version lag of the last step's trained tokens", registry=r
        )
        self.staleness_max = Gauge(
            "dgrpo_learner_staleness_max_versions", "Largest version lag of the last step's trained tokens", registry=r
        )
        self.publish_seconds = Histogram(
            "dgrpo_learner_weight_publish_seconds",
            "Seconds to gather, write and announce one weight version",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.tokens = Counter("dgrpo_learner_trained_tokens", "Completion tokens trained on", registry=r)

    def observe_step(self, step: int, total: int, metrics: dict[str, float]) -> None:
        """A step's logged metrics (loop.Trainer.log_step) into the gauges."""
        self.step.set(step)
        self.total_steps.set(total)
        self.weight_version.set(metrics.get("weights/version", 0.0))
        step_s = metrics.get("time/step_s", 0.0)
        self.step_seconds.set(step_s)
        for phase in PHASES:
            seconds = metrics.get(f"time/{phase}_s", 0.0)
            self.phase_seconds.labels(phase).set(seconds)
            self.phase_total.labels(phase).inc(seconds)
        self.sample_wait.set(metrics.get("time/generate_s", 0.0) / step_s if step_s else 0.0)
        if "reward/mean" in metrics:
            self.reward_mean.set(metrics["reward/mean"])
        if "weights/publish_s" in metrics:
            self.publish_seconds.observe(metrics["weights/publish_s"])
        self.tokens.inc(metrics.get("response/tokens", 0.0))

    def observe_staleness(self, staleness: dict[str, float]) -> None:
        """pipeline.staleness_metrics of the step's trained batch."""
        self.staleness_mean.set(staleness["staleness/mean"])
        self.staleness_max.set(staleness["staleness/max"])

    def serve(self, host: str, port: int):
        return serve_metrics(self.registry, host, port, "learner.trainer.metrics_port")
