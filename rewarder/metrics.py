"""Prometheus metrics of the reward service (served on rewarder.metrics_host:rewarder.metrics_port when set).

Names follow Prometheus conventions (`_total` counters, `_seconds` histograms); one set per process, in
prometheus_client's global registry.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from dgrpo.common.prometheus import RateWindow, serve_metrics
from dgrpo.rewarder.spec import SpecRef

COMPLETIONS = Counter("dgrpo_rewarder_completions_total", "Completions scored, by status (ok / error)", ["status"])
FUNCTION_ERRORS = Counter(
    "dgrpo_rewarder_function_errors_total", "Completions a reward function failed on (raise, timeout, crash, "
    "bad value)", ["function"]
)
FUNCTION_TIMEOUTS = Counter(
    "dgrpo_rewarder_function_timeouts_total", "Reward function calls that ran past their timeout (the worker was "
    "killed and replaced)", ["function"]
)
FUNCTION_SECONDS = Histogram(
    "dgrpo_rewarder_function_seconds", "Wall time of one reward function call (one group, or one model batch)",
    ["function"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
)
REQUEST_SECONDS = Histogram(
    "dgrpo_rewarder_request_seconds", "Wall time of one Score request",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
)
SPEC_VERSION = Gauge("dgrpo_rewarder_spec_version", "Version of the active reward specification")
SPEC_INFO = Gauge("dgrpo_rewarder_spec_info", "1 for the active reward specification", ["name", "content_hash"])
WORKERS_ALIVE = Gauge("dgrpo_rewarder_workers_alive", "Worker processes alive in the active pool")


SCORE_RATE = RateWindow()
Gauge("dgrpo_rewarder_completions_per_second", "Completions scored per second over the last 30 s").set_function(
    SCORE_RATE.per_second)


def scored(status: str) -> None:
    """One completion scored (status: ok / error / no_reward)."""
    COMPLETIONS.labels(status).inc()
    SCORE_RATE.add(1)


def set_active_spec(ref: SpecRef) -> None:
    SPEC_VERSION.set(ref.version)
    SPEC_INFO.clear()
    SPEC_INFO.labels(ref.name, ref.content_hash).set(1)


def serve(host: str, port: int) -> int:
    """Serve the process's series; returns the bound port."""
    return serve_metrics(REGISTRY, host, port, "rewarder.metrics_port").server_port
