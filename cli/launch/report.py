"""End-of-run report from the learner's metrics.jsonl: a summary table and a PNG of the curves that matter.

`python -m dgrpo.cli.launch.report RUN_DIR` redraws it for any run. The plot has reward (with its rolling mean), KL to
the reference, response length, and the per-phase time of each step (the bottleneck at a glance).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PHASES = ("generate", "reward", "logprob", "train", "weight_sync", "other")


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
    if "step_s_median" in summary:
        rows += [("seconds per step (median)", f"{summary['step_s_median']:.1f}")]
        phases = [(p, summary[f"time_{p}_s"]) for p in PHASES if f"time_{p}_s" in summary]
        if phases:
            total = sum(v for _, v in phases) or 1.0
            rows += [("time per step by phase", ", ".join(f"{p} {v / total:.0%}" for p, v in phases))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot(train: list[dict], val: list[dict], out: Path) -> Path:
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
    kl = [r.get("actor/kl", 0.0) for r in train]
    axes[0][1].plot(steps, kl, ".-")
    # beta = 0 skips the reference model entirely: say so rather than draw a flat line that reads as "no drift".
    axes[0][1].set_title("KL to reference (k3, mean per token)" if any(kl) else
                         "KL to reference: not computed (beta = 0)")
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
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(run_dir: Path, export_dir: str | None = None) -> dict[str, float]:
    """Print the summary table and write `<run_dir>/report.png` (and where the exported model is, when the run
    exported one: `learner.checkpoint.export_dir`); returns the summary."""
    train, val = read_metrics(run_dir)
    summary = summarize(train, val)
    png = plot(train, val, run_dir / "report.png")
    print("\n" + format_table(summary), flush=True)
    print(f"\n  metrics : {run_dir / 'metrics.jsonl'}\n  plot    : {png}", flush=True)
    if export_dir:
        print(f"  model   : {export_dir}  (serve: vllm serve {export_dir})", flush=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
