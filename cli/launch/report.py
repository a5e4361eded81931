"""End-of-run report from the learner's metrics.jsonl: a summary table and a PNG of the curves that matter.

`python -m dgrpo.cli.launch.report RUN_DIR` redraws it for any run. The plot has reward (with its rolling mean), how
far the trained tokens are from the policy (`drift_panel`), response length, and the per-phase time of each step
(the bottleneck at a glance). How far: with `learner.algorithm.beta` > 0 the KL to the reference model; with beta 0
(the demo's, and DAPO's and Dr. GRPO's default: no reference model, no KL) the sampler-learner logprob gap per token
(`actor/sampler_logp_diff`: noise while the sampler runs the published weights, growing when it does not or when the
samples lag behind) and, with asynchronous rollouts, the version lag of the trained tokens (`staleness/mean`).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

PHASES = ("generate", "reward", "logprob", "train", "weight_sync", "other")
KL, GAP, LAG, SKIPPED = "actor/kl", "actor/sampler_logp_diff", "staleness/mean", "actor/skipped_frac"
"""The learner's metric names (learner/update/step_sums.py, learner/rollout/pipeline.py staleness_metrics)."""


def _gaps(train: list[dict]) -> list[float]:
    """The logprob gap of each step; NaN where the step computed no sequence (every group scored alike: its
    per-token metrics read 0, docs/actor.md) or logged none."""
    return [r[GAP] if GAP in r and r.get(SKIPPED, 0.0) < 1.0 else float("nan") for r in train]


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train steps, validation records) from `<run_dir>/metrics.jsonl`."""
    train, val = [], []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        (val if "val/reward_mean" in record else train).append(record)
    return train, val


def read_beta(run_dir: Path) -> float | None:
    """`learner.algorithm.beta` from the run's config.yaml (the learner writes the resolved stack there); None
    without one."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    beta = (yaml.safe_load(path.read_text()) or {}).get("learner", {}).get("algorithm", {}).get("beta")
    return None if beta is None else float(beta)


def drift_panel(train: list[dict], beta: float | None) -> tuple[str, list[tuple[str, str, list[float]]]]:
    """The top-right panel: (title, [(axis "left" or "right", label, one value per step)]). KL to the reference when
    it is computed (beta > 0; without a config, when any step logged a KL); else the sampler-learner logprob gap, and
    the version lag where rollouts ran ahead."""
    nan = float("nan")
    kl = [r.get(KL, nan) for r in train]
    computed = beta > 0 if beta is not None else any(r.get(KL) for r in train)
    if computed:
        return "KL to reference (k3, mean per token)", [("left", "KL", kl)]
    lines = []
    if any(GAP in r for r in train):
        lines.append(("left", "|learner - sampler| logprob per token", _gaps(train)))
    if any(r.get(LAG) for r in train):
        lines.append(("right", "version lag of the trained tokens", [r.get(LAG, nan) for r in train]))
    if not lines:  # say so rather than draw a flat line that reads as "no drift"
        return "KL to reference: not computed (beta = 0)", []
    return "sampler vs learner (beta = 0: no KL to a reference)", lines


def summarize(train: list[dict], val: list[dict], window: int = 5) -> dict[str, float]:
    rewards = [r["reward/mean"] for r in train if "reward/mean" in r]
    out: dict[str, float] = {"steps": float(len(train))}
    if rewards:
        k = min(window, len(rewards))
        out["reward_first"] = statistics.mean(rewards[:k])
        out["reward_last"] = statistics.mean(rewards[-k:])
        out["reward_gain"] = out["reward_last"] - out["reward_first"]
        # Noise yardstick: spread of per-step means within the first window.
        out["reward_first_std"] = statistics.stdev(rewards[:k]) if k > 1 else 0.0
    if val:
        out["val_first"] = val[0]["val/reward_mean"]
        out["val_last"] = val[-1]["val/reward_mean"]
    gaps = [g for g in _gaps(train) if not math.isnan(g)]
    if gaps:
        k = min(window, len(gaps))
        out["logp_gap_first"], out["logp_gap_last"] = statistics.mean(gaps[:k]), statistics.mean(gaps[-k:])
    step_times = [r["time/step_s"] for r in train if "time/step_s" in r]
    if step_times:
        out["step_s_median"] = statistics.median(step_times)
        out["total_train_s"] = sum(step_times)
    for phase in PHASES:
        values = [r.get(f"time/{phase}_s", 0.0) for r in train]
        if any(values):
            out[f"time_{phase}_s"] = statistics.mean(values)
    return out


def format_table(summary: dict[str, float], window: int = 5) -> str:
    rows = [("steps", f"{summary['steps']:.0f}")]
    if "reward_first" in summary:
        rows += [
            (f"mean reward, first {window} steps",
             f"{summary['reward_first']:.3f} (±{summary['reward_first_std']:.3f})"),
            (f"mean reward, last {window} steps", f"{summary['reward_last']:.3f}"),
            ("change", f"{summary['reward_gain']:+.3f}"),
        ]
    if "val_first" in summary:
        rows += [("greedy validation reward, first -> last",
                  f"{summary['val_first']:.3f} -> {summary['val_last']:.3f}")]
    if "logp_gap_first" in summary:
        rows += [(f"sampler-learner logprob gap per token, first -> last {window} steps",
                  f"{summary['logp_gap_first']:.2g} -> {summary['logp_gap_last']:.2g}")]
    if "step_s_median" in summary:
        rows += [("seconds per step (median)", f"{summary['step_s_median']:.1f}")]
        phases = [(p, summary[f"time_{p}_s"]) for p in PHASES if f"time_{p}_s" in summary]
        if phases:
            total = sum(v for _, v in phases) or 1.0
            rows += [("time per step by phase", ", ".join(f"{p} {v / total:.0%}" for p, v in phases))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def figure(train: list[dict], val: list[dict], beta: float | None = None):
    """The report's matplotlib figure (2 x 2 panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    rewards = [r.get("reward/mean", float("nan")) for r in train]
    ax.plot(steps, rewards, ".-", alpha=0.5, label="train reward (per step)")
    if len(rewards) >= 3:
        k = 5
        rolling = [statistics.mean(rewards[max(0, i - k + 1): i + 1]) for i in range(len(rewards))]
        ax.plot(steps, rolling, "-", lw=2, label=f"rolling mean ({k})")
    if val:
        ax.plot([r["step"] for r in val], [r["val/reward_mean"] for r in val], "s--", label="greedy validation")
    ax.set_title("reward")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    title, lines = drift_panel(train, beta)
    ax.set_title(title)
    sides = {"left": ax}
    for i, (side, label, values) in enumerate(lines):
        if side not in sides:
            sides[side] = ax.twinx()
        sides[side].plot(steps, values, ".-", color=f"C{i}", label=label)
        sides[side].set_ylabel(label, color=f"C{i}", fontsize=8)
    axes[1][0].plot(steps, [r.get("response/length_mean", float("nan")) for r in train], ".-")
    axes[1][0].set_title("response length (tokens, mean)")
    bottom = [0.0] * len(train)
    ax = axes[1][1]
    for phase in PHASES:
        values = [r.get(f"time/{phase}_s", 0.0) for r in train]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("seconds per step, by phase")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(train: list[dict], val: list[dict], out: Path, beta: float | None = None) -> Path:
    """Draw `figure` into the PNG `out`; its panels' titles are in the PNG's Description text."""
    import matplotlib.pyplot as plt

    fig = figure(train, val, beta)
    titles = " | ".join(a.get_title() for a in fig.axes if a.get_title())
    fig.savefig(out, dpi=100, metadata={"Title": "dgrpo run report", "Description": titles})
    plt.close(fig)
    return out


def write_report(run_dir: Path, export_dir: str | None = None) -> dict[str, float]:
    """Print the summary table and write `<run_dir>/report.png` (and where the exported model is, when the run
    exported one: `learner.checkpoint.export_dir`); returns the summary."""
    train, val = read_metrics(run_dir)
    summary = summarize(train, val)
    png = plot(train, val, run_dir / "report.png", read_beta(run_dir))
    print("\n" + format_table(summary), flush=True)
    print(f"\n  metrics : {run_dir / 'metrics.jsonl'}\n  plot    : {png}", flush=True)
    if export_dir:
        print(f"  model   : {export_dir}  (serve: vllm serve {export_dir})", flush=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
