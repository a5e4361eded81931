"""Observability: the step time breakdown names the bottleneck; JSONL and TensorBoard sinks write every metric."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from dgrpo.common.config import ConfigError
from dgrpo.learner.records.metrics import MetricsLogger, StepTimer, check_loggers, console_line, mlflow_key


def test_timer_names_the_slowest_phase():
    timer = StepTimer()
    with timer.phase("generate"):
        time.sleep(0.05)
    timer.add("train", 0.01)
    timer.add("train", 0.01)
    metrics, bottleneck = timer.metrics()
    assert bottleneck == "generate"
    assert metrics["time/train_s"] == 0.02 and metrics["time/generate_s"] >= 0.05
    assert metrics["time/step_s"] >= metrics["time/generate_s"] and metrics["time/other_s"] >= 0
    line = console_line(3, 10, {"reward/mean": 0.25, "reward/std": 0.5, "actor/kl": 0.001, **metrics}, bottleneck)
    assert line.startswith("step 3/10 | reward 0.250±0.500 | kl 0.0010") and "bottleneck generate" in line


def test_jsonl_appends_across_restarts_and_tensorboard_writes(tmp_path):
    for step in (1, 2):  # a resumed run reopens the same file
        logger = MetricsLogger(["jsonl", "tensorboard"], tmp_path, "run", {})
        logger.log(step, 2, {"reward/mean": float(step)}, "train")
        logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"], r["bottleneck"]) for r in lines] == [(1, 1.0, "train"), (2, 2.0, "train")]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == [1.0, 2.0]


def test_mlflow_without_a_tracking_store_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if importlib.util.find_spec("sqlalchemy") is None:  # mlflow-skinny (the extra): no default store
        with pytest.raises(ConfigError, match=r"learner.trainer.loggers=\['console', 'mlflow'\]: 'mlflow' has no "
                                              r"tracking store: MLFLOW_TRACKING_URI is unset"):
            check_loggers(["console", "mlflow"])
    else:  # the full mlflow package: its default sqlite store works
        check_loggers(["console", "mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    check_loggers(["console", "mlflow"])


def test_mlflow_keys():
    assert mlflow_key("rollout/groups_by_replica/host:50051") == "rollout/groups_by_replica/host_50051"
    assert mlflow_key("reward/fn/math_verify") == "reward/fn/math_verify"
