"""The /metrics endpoint helper and the learner's series: served on loopback, parsed with prometheus_client's own
text parser; a taken port names its key."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from dgrpo.common.config import ConfigError
from dgrpo.common.prometheus import Forward, RateWindow, serve_metrics
from dgrpo.learner.records.prometheus import LearnerMetrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_learner_series_after_a_step():
    m = LearnerMetrics()
    server = m.serve("127.0.0.1", 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        m.observe_step(3, 10, {"weights/version": 3.0, "time/step_s": 8.0, "time/generate_s": 2.0,
                               "time/train_s": 5.0, "reward/mean": 0.25, "weights/publish_s": 0.4,
                               "response/tokens": 100.0})
        m.observe_step(4, 10, {"weights/version": 4.0, "time/step_s": 4.0, "time/generate_s": 3.0,
                               "reward/mean": 0.5, "weights/publish_s": 0.3, "response/tokens": 50.0})
        m.observe_staleness({"staleness/mean": 0.5, "staleness/max": 1.0})
        s = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert s[("dgrpo_learner_step", ())] == 4 and s[("dgrpo_learner_total_steps", ())] == 10
    assert s[("dgrpo_learner_weight_version", ())] == 4
    assert s[("dgrpo_learner_sample_wait_ratio", ())] == 0.75
    assert s[("dgrpo_learner_last_step_phase_seconds", (("phase", "generate"),))] == 3.0  # the last step's
    assert s[("dgrpo_learner_phase_seconds_total", (("phase", "generate"),))] == 5.0  # all steps
    assert s[("dgrpo_learner_phase_seconds_total", (("phase", "train"),))] == 5.0
    assert s[("dgrpo_learner_reward_mean", ())] == 0.5
    assert s[("dgrpo_learner_weight_publish_seconds_count", ())] == 2
    assert s[("dgrpo_learner_weight_publish_seconds_sum", ())] == pytest.approx(0.7)
    assert s[("dgrpo_learner_staleness_mean_versions", ())] == 0.5
    assert s[("dgrpo_learner_trained_tokens_total", ())] == 150


def test_taken_port_names_the_key():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"learner.trainer.metrics_port=\d+: cannot serve Prometheus metrics"):
            LearnerMetrics().serve("127.0.0.1", taken.getsockname()[1])


def test_forward_serves_two_registries():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    Counter("dgrpo_a", "a", registry=ours).inc()
    Counter("vllm:b", "b", registry=theirs).inc(2)
    served = CollectorRegistry()
    served.register(Forward(ours))
    served.register(Forward(theirs))
    server = serve_metrics(served, "127.0.0.1", 0, "x.metrics_port")
    try:
        s = scrape(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert s[("dgrpo_a_total", ())] == 1 and s[("vllm:b_total", ())] == 2


def test_rate_window():
    r = RateWindow(window_s=10)
    r.add(30, now=100.0)
    r.add(20, now=105.0)
    assert r.per_second(now=106.0) == 5.0
    assert r.per_second(now=112.0) == 2.0  # the first event left the window
    assert r.per_second(now=200.0) == 0.0
    # Nothing scraping: events older than the window are dropped as new ones come, so memory stays bounded.
    unread = RateWindow(window_s=10)
    for t in range(10_000):
        unread.add(1, now=float(t))
    assert len(unread._events) == 11 and unread.per_second(now=9_999.0) == 1.1
