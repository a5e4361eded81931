"""The end-of-run report (cli/launch/report.py) from a run folder as the learner leaves it: config.yaml (the resolved
stack, LearnerRunConfig.stack_yaml) and metrics.jsonl (MetricsLogger), the actor's metrics named by StepSums.

Its top-right panel shows how far the trained tokens are from the policy: the KL to the reference when beta > 0;
with beta 0 (the demo's: no reference, no KL) the sampler-learner logprob gap, and the version lag when rollouts ran
ahead, never an empty KL panel."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from PIL import Image

from dgrpo.cli.launch import report
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config
from dgrpo.learner.records.metrics import MetricsLogger
from dgrpo.learner.rollout.pipeline import staleness_metrics
from dgrpo.learner.update.config import TruncatedIS
from dgrpo.learner.update.step_sums import StepSums

DEMO = Path(__file__).resolve().parents[1] / "configs" / "cpu-demo.yaml"
GAPS = [0.04, 0.05, 0.03, 0.06, 0.0, 0.05, 0.07, 0.08]  # the demo's bf16 CPU noise; step 5 computed no sequence
KLS = [0.0, 0.002, 0.004, 0.005, 0.0, 0.007, 0.009, 0.01]


def actor_metrics(step: int, beta: float) -> dict[str, float]:
    """The actor's metrics of one step as the learner computes them (StepSums.metrics): 100 loss tokens."""
    sums = StepSums(sampler_logp_diff=GAPS[step - 1] * 100, kl=KLS[step - 1] * 100 if beta else 0.0,
                    is_weight_mean=100.0, is_weight_max=1.2, loss_tokens=100.0, real_tokens=140.0,
                    padded_tokens=150.0, sequence_tokens=160.0)
    metrics = sums.metrics([], [0.5], 1e-5, entropy=True, dual_clip=False, correction=TruncatedIS(cap=2.0))
    metrics["actor/skipped_frac"] = 1.0 if step == 5 else 0.25  # step 5: every group scored alike
    return metrics


def make_run(run_dir: Path, *overrides: str, lags: list[float] | None = None) -> Path:
    """A finished 8-step run of the demo config with `overrides`, as the learner writes its folder."""
    cfg = load_config(StackConfig, DEMO, list(overrides)).learner_run()
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.stack_yaml())
    beta = cfg.learner.algorithm.beta
    metrics = MetricsLogger(["jsonl"], run_dir, "r", {})
    metrics.log(0, 8, {"val/reward_mean": 0.3, "val/accuracy": 0.3})
    for step in range(1, 9):
        record = {"reward/mean": 0.3 + 0.05 * step, "response/length_mean": 40.0 - step, "time/step_s": 20.0,
                  "time/generate_s": 8.0, "time/train_s": 12.0, **actor_metrics(step, beta)}
        if lags is not None:
            record["staleness/mean"] = lags[step - 1]
        metrics.log(step, 8, record, "train")
    return run_dir


def panel(fig, title_start: str):
    """(title, {line label: y values}) of the panel whose title starts so, twin axes included."""
    axes = [a for a in fig.axes if a.get_title().startswith(title_start)]
    assert len(axes) == 1, [a.get_title() for a in fig.axes]
    box = axes[0].get_position().bounds
    lines = {line.get_label(): list(line.get_ydata()) for a in fig.axes if a.get_position().bounds == box
             for line in a.get_lines()}
    return axes[0].get_title(), lines


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y) for x, y in zip(a, b,
                                                                                                              strict=True))


def test_the_learner_logs_the_metrics_the_report_reads():
    assert report.GAP in actor_metrics(1, 0.0) and report.KL in actor_metrics(1, 0.04)
    assert report.LAG in staleness_metrics([], 3)


def test_with_beta_0_the_panel_shows_the_sampler_learner_logprob_gap(tmp_path, capsys):
    run = make_run(tmp_path / "run")  # the demo's own config: beta 0
    assert report.read_beta(run) == 0.0
    summary = report.write_report(run)
    train, val = report.read_metrics(run)
    title, lines = panel(report.figure(train, val, report.read_beta(run)), "sampler vs learner")
    assert "beta = 0" in title
    gap = [math.nan if i == 4 else g for i, g in enumerate(GAPS)]  # no sequence computed: no point, not a 0
    assert list(lines) == ["|learner - sampler| logprob per token"] and same(lines[next(iter(lines))], gap)
    # The PNG written is that figure: its panels' titles, no KL panel.
    described = Image.open(run / "report.png").text["Description"]
    assert title in described and "KL" not in described.replace("no KL", "")
    out = capsys.readouterr().out
    assert "sampler-learner logprob gap per token, first -> last 5 steps  0.046 -> 0.058" in out, out
    assert summary["logp_gap_first"] == pytest.approx((0.04 + 0.05 + 0.03 + 0.06 + 0.05) / 5)  # step 5 left out


def test_with_asynchronous_rollouts_the_version_lag_is_drawn_too(tmp_path):
    lags = [0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.8, 1.0]
    run = make_run(tmp_path / "run", "learner.rollout.max_staleness=1", lags=lags)
    train, val = report.read_metrics(run)
    _, lines = panel(report.figure(train, val, report.read_beta(run)), "sampler vs learner")
    assert same(lines["version lag of the trained tokens"], lags)
    assert "|learner - sampler| logprob per token" in lines


def test_with_beta_above_0_the_panel_is_the_kl(tmp_path):
    run = make_run(tmp_path / "run", "learner.algorithm.beta=0.04")
    report.write_report(run)
    train, val = report.read_metrics(run)
    title, lines = panel(report.figure(train, val, report.read_beta(run)), "KL to reference")
    assert same(lines["KL"], KLS)
    assert title in Image.open(run / "report.png").text["Description"]


def test_without_a_config_the_metrics_decide(tmp_path):
    """A run folder without config.yaml (copied metrics only): a logged KL means beta > 0, all zeros beta = 0."""
    for overrides, expected in ((["learner.algorithm.beta=0.04"], "KL to reference ("), ([], "sampler vs learner")):
        run = make_run(tmp_path / expected[:3], *overrides)
        (run / "config.yaml").unlink()
        assert report.read_beta(run) is None
        train, val = report.read_metrics(run)
        panel(report.figure(train, val, None), expected)
