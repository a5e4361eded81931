"""Observability of the loop: a per-step time breakdown naming the bottleneck, and the metric sinks.

"Measure first: which side is the bottleneck" — every step is split into phases (generate, reward, logprob, train,
weight_sync, ...) and the slowest one is named on the console and in the logs. Reward scoring overlaps generation,
so its phase is only the tail the loop waits for after the last group arrived; `reward/busy_s` (summed call time)
tells how much scoring ran hidden under generation.

Sinks: console (one progress line per step), JSONL (every metric, one object per line), TensorBoard event files, Weights
& Biases and MLflow; the last two also take the completions table (`log_table`). The last three are optional installs: a
logger whose package is missing is refused before the run starts (`check_loggers`), naming the key and the install line,
instead of failing inside setup. A run resumed at step s continues the file and the event files as one clean run: the
crashed run's records after step s are dropped first, since those steps run again (TensorBoard hides them through its
purge_step); a run starting at step 0 starts both afresh.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dgrpo.common.config import ConfigError
from dgrpo.v1 import sampler_pb2

log = logging.getLogger("dgrpo.learner")


class StepTimer:
    """Wall time per named phase of one step; `metrics()` adds the total and the bottleneck."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def metrics(self) -> tuple[dict[str, float], str]:
        total = time.perf_counter() - self.start
        out = {f"time/{k}_s": v for k, v in self.phases.items()}
        out["time/other_s"] = max(total - sum(self.phases.values()), 0.0)
        out["time/step_s"] = total
        bottleneck = max(self.phases, key=self.phases.get) if self.phases else "other"
        return out, bottleneck


ENDED_BY = ("answer", "max_assistant_turns", "max_tool_calls", "max_response_length", "abort")


def memory_metrics() -> dict[str, float]:
    """The learner process's peak resident memory so far (host RAM: the whole footprint on CPU; on accelerators the
    host side only), what `dgrpo plan`'s learner total predicts on CPU (Linux reports ru_maxrss in KiB)."""
    import resource

    return {"memory/host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def multi_turn_metrics(completions: list) -> dict[str, float]:
    """Per-step figures of multi-turn trajectories (sampler_pb2.Completion with turn_stats; {} when none has them):
    turns and tool calls per sample, the share of samples that called a tool, tool errors and timeouts, time in tools
    (summed over samples: calls of different samples run concurrently), tokens masked out of the loss, and why the
    conversations ended (fractions)."""
    multi = [c for c in completions if c.HasField("turn_stats")]
    if not multi:
        return {}
    n = len(multi)
    stats = [c.turn_stats for c in multi]
    tokens = sum(len(c.token_ids) for c in multi)
    masked = sum(len(c.mask) - sum(c.mask) for c in multi)
    out = {
        "multi_turn/turns_mean": sum(s.turns for s in stats) / n,
        "multi_turn/tool_calls_mean": sum(s.tool_calls for s in stats) / n,
        "multi_turn/tool_call_rate": sum(s.tool_calls > 0 for s in stats) / n,
        "multi_turn/tool_errors": float(sum(s.tool_errors for s in stats)),
        "multi_turn/tool_timeouts": float(sum(s.tool_timeouts for s in stats)),
        "multi_turn/tool_s": sum(s.tool_seconds for s in stats),
        "multi_turn/tool_s_per_call": sum(s.tool_seconds for s in stats) / max(sum(s.tool_calls for s in stats), 1),
        "multi_turn/masked_tokens": float(masked),
        "multi_turn/masked_frac": masked / max(tokens, 1),
    }
    for reason in ENDED_BY:
        out[f"multi_turn/ended_by/{reason}"] = sum(s.ended_by == reason for s in stats) / n
    return out


LENGTH = sampler_pb2.FINISH_REASON_LENGTH
# Breakdown names that are 0/1 correctness checks: their mean is reported as the accuracy.
ACCURACY_FUNCTIONS = ("math_verify", "exact_match", "accuracy", "correct")


def rollout_metrics(scored: list, rewards: Any, *, group_size: int, version: int,
                    reward_busy_s: float) -> dict[str, float]:
    """A step's rollout figures (reward/, response/, prompt/, multi_turn/) from its scored groups (groups.ScoredGroup),
    their rewards as a float32 tensor [B*G], the group size, the weight version being trained and the rewarder's busy
    seconds for the batch."""
    import torch  # (this module is imported before torch to check the loggers; a step's figures come later)

    from dgrpo.learner.update.grpo import zero_std_fraction

    finished = [c for sg in scored for c in sg.group.completions]
    lengths = torch.tensor([len(c.token_ids) for c in finished], dtype=torch.float32)  # [B*G]
    m = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "reward/max": rewards.max().item(),
        "reward/min": rewards.min().item(),
        "reward/frac_zero_std": zero_std_fraction(rewards, group_size),
        "reward/errors": float(sum(len(sg.reward.errors) for sg in scored)),
        "reward/no_reward": float(sum(sum(sg.reward.no_reward) for sg in scored)),
        "reward/retries": float(sum(sg.reward.retries for sg in scored)),
        "reward/busy_s": reward_busy_s,
        # Which reward scored this step (a hot swap shows as a step up); min and max differ mid-swap.
        "reward/spec_version_min": float(min(sg.reward.spec_version for sg in scored)),
        "reward/spec_version_max": float(max(sg.reward.spec_version for sg in scored)),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
        "response/clip_frac": sum(c.finish_reason == LENGTH for c in finished) / len(finished),
        "response/tokens": lengths.sum().item(),
        "prompt/length_mean": sum(len(sg.record.token_ids) for sg in scored) / len(scored),
        "rollout/stale_completions": float(sum(c.weight_version < version for c in finished)),
    }
    m.update(breakdown_means(scored, "reward"))
    m.update(logged_metrics(scored))
    m.update(multi_turn_metrics(finished))
    return m


def validation_metrics(scored: list, seconds: float) -> dict[str, float]:
    """Mean reward of the greedy validation completions, per function too."""
    rewards = [r for sg in scored for r in sg.reward.rewards]
    metrics = {"val/reward_mean": sum(rewards) / len(rewards), "val/prompts": float(len(scored)),
               "val/time_s": seconds}
    metrics.update(breakdown_means(scored, "val"))
    return metrics


def throughput_metrics(times: dict[str, float], generated_tokens: float, trained_tokens: int) -> dict[str, float]:
    """Tokens per second of the whole step, and of generation alone."""
    return {
        "perf/tokens_per_s": trained_tokens / times["time/step_s"],
        "perf/generated_tokens_per_s": generated_tokens / max(times.get("time/generate_s", 0), 1e-9),
    }


def logged_metrics(scored: list) -> dict[str, float]:
    """What reward functions logged with TRL's `log_metric`, averaged over the step's groups: reward/metric/<name>."""
    values: dict[str, list[float]] = {}
    for sg in scored:
        for name, value in sg.reward.metrics.items():
            values.setdefault(name, []).append(value)
    return {f"reward/metric/{k}": sum(v) / len(v) for k, v in values.items()}


def breakdown_means(scored: list, prefix: str) -> dict[str, float]:
    """Mean of each reward function over the completions it scored; `accuracy` from a 0/1 correctness check."""
    sums: dict[str, list[float]] = {}
    for sg in scored:
        for b in sg.reward.breakdown:
            for name, value in b.items():
                if math.isfinite(value):
                    sums.setdefault(name, []).append(value)
    out = {f"{prefix}/fn/{k}": sum(v) / len(v) for k, v in sums.items()}
    for name in ACCURACY_FUNCTIONS:
        if name in sums:
            out[f"{prefix}/accuracy"] = sum(v > 0.5 for v in sums[name]) / len(sums[name])
            break
    return out


def _fmt(metrics: dict[str, Any], key: str, spec: str = ".3f", label: str | None = None) -> str | None:
    value = metrics.get(key)
    return None if value is None else f"{label or key.split('/')[-1]} {value:{spec}}"


def console_line(step: int, total: int, metrics: dict[str, float], bottleneck: str) -> str:
    """`step 3/10 | reward 0.250±0.433 | ... | 12.3s (generate 61%)`: the numbers one watches."""
    parts = [f"step {step}/{total}"]
    if "reward/mean" in metrics:
        parts.append(f"reward {metrics['reward/mean']:.3f}±{metrics.get('reward/std', 0.0):.3f}")
    for key, spec, label in [
        ("reward/accuracy", ".3f", "acc"), ("actor/kl", ".4f", "kl"), ("actor/entropy", ".3f", "entropy"),
        ("response/length_mean", ".1f", "len"), ("actor/grad_norm", ".3f", "gnorm"), ("val/reward_mean", ".3f", "val"),
        ("multi_turn/tool_call_rate", ".2f", "tool calls"),
    ]:
        text = _fmt(metrics, key, spec, label)
        if text:
            parts.append(text)
    if "actor/clip_frac_low" in metrics or "actor/clip_frac_high" in metrics:
        parts.append(f"clip {metrics.get('actor/clip_frac_low', 0):.3f}/{metrics.get('actor/clip_frac_high', 0):.3f}")
    if "perf/tokens_per_s" in metrics:
        parts.append(f"{metrics['perf/tokens_per_s']:.0f} tok/s")
    step_s = metrics.get("time/step_s", 0.0)
    share = metrics.get(f"time/{bottleneck}_s", 0.0) / step_s if step_s else 0.0
    parts.append(f"{step_s:.1f}s (bottleneck {bottleneck} {share:.0%})")
    return " | ".join(parts)


def keep_records_through(path: Path, step: int) -> int:
    """Rewrite the JSONL file at `path` to its records of steps <= `step` (none for step 0), atomically; a partial
    last line (a crash mid-write) goes too. Returns how many lines were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = line.endswith(b"\n") and step > 0 and record["step"] <= step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line)
            elif line.strip():
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # a crash now leaves the old file or the new one, never half of one
    return dropped


LOGGER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "pip install 'dgrpo[tensorboard]'"),
    "wandb": ("wandb", "pip install 'dgrpo[wandb]'"),
    "mlflow": ("mlflow", "pip install 'dgrpo[mlflow]'"),
}
"""Logger -> (module it imports, how to install it). console and jsonl need nothing beyond the default install."""


def missing_logger_packages(loggers: list[str]) -> dict[str, tuple[str, str]]:
    """The chosen loggers whose module is not importable here, found without importing anything."""
    return {name: LOGGER_PACKAGES[name] for name in loggers
            if name in LOGGER_PACKAGES and importlib.util.find_spec(LOGGER_PACKAGES[name][0]) is None}


def check_loggers(loggers: list[str], key: str = "learner.trainer.loggers") -> None:
    """Refuse loggers this environment cannot run, before anything heavy starts (in a container the error is
    one line per restart, not a traceback from inside setup)."""
    missing = missing_logger_packages(loggers)
    if missing:
        details = "; ".join(f"'{name}' needs the package {module} ({install})"
                            for name, (module, install) in missing.items())
        raise ConfigError(f"{key}={list(loggers)}: {details}, which is not installed here. Install it, or drop "
                          f"{'it' if len(missing) == 1 else 'them'} from {key} (console and jsonl need nothing more)")
    if "mlflow" in loggers and not os.environ.get("MLFLOW_TRACKING_URI") and importlib.util.find_spec(
            "sqlalchemy") is None:
        raise ConfigError(f"{key}={list(loggers)}: 'mlflow' has no tracking store: MLFLOW_TRACKING_URI is unset and "
                          "MLflow's default (a sqlite file) needs the full `mlflow` package. Set MLFLOW_TRACKING_URI "
                          "to your tracking server (http://host:5000), or `pip install mlflow`")


class MetricsLogger:
    """Writes each step's metrics to the chosen sinks.

    `start_step`: the step the run starts from (the loop passes its resumed step, 0 when fresh); the earlier run's
    records after it are dropped, since those steps run again. None appends to whatever is there."""

    def __init__(self, loggers: list[str], out_dir: Path, run_name: str, config: dict, wandb_project: str = "dgrpo",
                 start_step: int | None = None, mlflow_experiment: str = "dgrpo"):
        check_loggers(loggers)
        self.loggers, self.out_dir = set(loggers), out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = None
        if "jsonl" in self.loggers:
            path = self.out_dir / "metrics.jsonl"
            dropped = 0 if start_step is None else keep_records_through(path, start_step)
            if dropped:
                log.info("%s: dropped %d records after step %d (those steps run again)", path, dropped, start_step)
            self._jsonl = open(path, "a")  # noqa: SIM115
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            # Events of steps >= purge_step in earlier event files are hidden: the re-run steps show once.
            purge = None if start_step is None else start_step + 1 if start_step else 0
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=purge)
        self._wandb = None
        if "wandb" in self.loggers:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, resume="allow")
        self._mlflow = None
        if "mlflow" in self.loggers:
            import mlflow

            mlflow.set_experiment(mlflow_experiment)  # where: MLFLOW_TRACKING_URI (a server, or a file: folder)
            self._mlflow = mlflow.start_run(run_name=run_name)
            mlflow.log_dict(config, "config.yaml")  # the whole stack: more keys than MLflow's params allow

    def log(self, step: int, total: int, metrics: dict[str, float], bottleneck: str | None = None) -> None:
        if "console" in self.loggers and bottleneck is not None:
            log.info(console_line(step, total, metrics, bottleneck))
        if self._jsonl is not None:
            record = {"step": step, "time": time.time(), **metrics}
            if bottleneck is not None:
                record["bottleneck"] = bottleneck
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({mlflow_key(k): v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def log_table(self, step: int, columns: list[str], rows: list[list], key: str = "completions") -> None:
        """A table (learner/records/completions_table.py) to the loggers that keep tables: W&B (under `key`:
        `completions`
        as TRL logs it, `val/generations` as verl does) and MLflow (artifact <key>/step_<N>.json)."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_table({c: [row[i] for row in rows] for i, c in enumerate(columns)},
                             artifact_file=f"{key}/step_{step}.json")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, `_ - . / ` and space): `rollout/groups_by_replica/host:50051`
    becomes `rollout/groups_by_replica/host_50051`."""
    return re.sub(r"[^\w\-./ ]", "_", key)
