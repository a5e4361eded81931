"""dgrpo vs TRL's GRPOTrainer on one machine, same model, data and GRPO settings, with TRL in each of its generation
modes: seconds per step, completions per second, the reward curve (per step and against wall-clock time), steps to
a rolling-5 reward of 0.8 and the sampler-learner logprob gap of every side.

    python benchmarks/bench_vs_trl.py --steps 10                                  # every side
    python benchmarks/bench_vs_trl.py --sides trl-server dgrpo-pinned --steps 5   # some

Sides (run one after the other; --sides picks them and their order):
- trl-generate: TRL GRPOTrainer generating with transformers `generate` in the trainer (fp32), both cores;
- trl-colocate: TRL with `use_vllm=True, vllm_mode="colocate"`: vLLM-CPU inside the trainer, both cores;
- trl-server: `trl vllm-serve` on core 0 (taskset) and the trainer (`vllm_mode="server"`) on core 1;
- dgrpo: `dgrpo up` as a user runs it (sampler and learner take turns on both cores);
- dgrpo-pinned: dgrpo in trl-server's layout: sampler (and rewarder) on core 0, learner on core 1 (one thread);
- dgrpo-pinned-async: the same with learner.rollout.max_staleness=1 (the next batch is sampled while one trains).

Same on every side: the bundled SmolLM2-135M-Instruct, the bundled demo task (dgrpo.cli.tasks, seed 0), prompts
per step, group size, max new tokens, learning rate, temperature 1, KL beta 0, group-normalised advantages,
token-mean loss, one optimizer update per step, the math-verify reward on the `answer` column, and (the vLLM
sides) per-token truncated importance weights min(r, 2) for the sampler-learner mismatch.
Precision: TRL trains in fp32 (its CPU default) and its vLLM sides sample in bf16 (the model's dtype); dgrpo runs
configs/cpu-demo.yaml's `auto` (bf16 sampling and compute on CPUs with bf16 instructions, fp32 on others; each
dgrpo side's notes say which ran).
TRL runs in its own virtual environment (benchmarks/trl_side.py), which says which vLLM and which patches ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "cpu-demo.yaml"
sys.path.insert(0, str(HERE))
import trl_side  # a sibling file: the standard library only at import

SIDES = ("trl-generate", "trl-colocate", "trl-server", "dgrpo", "dgrpo-pinned", "dgrpo-pinned-async")
GOAL_X = 6.0  # issue 30: dgrpo's default >= 6x TRL + vLLM colocate in steps per hour


@dataclass
class Settings:
    """What every side shares."""

    steps: int = 10
    prompts_per_step: int = 8
    group_size: int = 4
    max_new_tokens: int = 64
    lr: float = 1e-5
    temperature: float = 1.0
    seed: int = 0
    task: str = "arith"
    lora_rank: int = 0
    """> 0: every side trains a LoRA adapter of this rank on all linear layers (TRL: a PEFT `peft_config`; dgrpo:
    learner.lora), instead of the full model. Give LoRA its own --lr (docs/lora.md: about 10x full fine-tuning's)."""
    lora_alpha: int = 16


@dataclass
class SideResult:
    """One side's run: per-step wall time, mean reward, completion length and logprob gap."""

    name: str
    step_s: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    length_mean: list[float] = field(default_factory=list)
    """Mean completion length (tokens) per step: longer answers cost every side more time."""
    completions_per_step: int = 0
    notes: str = ""
    cpu_s: list[float] = field(default_factory=list)
    """TRL: CPU seconds of the trainer process per step (its vLLM engine too when colocated)."""
    logp_gap: list[float] = field(default_factory=list)
    """Mean |learner logprob - sampler logprob| per completion token, per step (TRL:
    sampling/sampling_logp_difference/mean; dgrpo: actor/sampler_logp_diff): how far the sampler's weights are
    from the learner's."""
    side: str = ""
    peak_rss_gb: float = float("nan")
    """TRL: the trainer process's peak resident memory (its colocated vLLM engine included)."""
    bytes_per_sync: float = float("nan")
    """TRL: bytes handed to vLLM per weight sync (with PEFT: the merged full model, as TRL sends it)."""

    def wall(self) -> list[float]:
        """Seconds of training at each step's end (start-up excluded)."""
        out, t = [], 0.0
        for s in self.step_s:
            t += s
            out.append(t)
        return out

    def rolling(self, k: int = 5) -> list[float]:
        r = self.reward_mean
        return [statistics.fmean(r[max(0, i - k + 1): i + 1]) for i in range(len(r))]

    def summary(self) -> dict[str, float]:
        # The first steps carry one-off warm-up (allocations, vLLM's compile); the median discounts them.
        med = statistics.median(self.step_s)
        reach = next((i + 1 for i, x in enumerate(self.rolling()) if i >= 4 and x >= 0.8), None)
        return {"s_per_step_median": med, "s_per_step_1_10": statistics.median(self.step_s[:10]),
                "completions_per_s": self.completions_per_step / med, "steps_per_hour": 3600 / med,
                "reward_first5": statistics.fmean(self.reward_mean[:5]),
                "reward_last5": statistics.fmean(self.reward_mean[-5:]),
                "reward_mean": statistics.fmean(self.reward_mean),
                "steps_to_0.8": float(reach) if reach else float("nan"),
                "gap_first": self.logp_gap[0] if self.logp_gap else float("nan"),
                "gap_last": self.logp_gap[-1] if self.logp_gap else float("nan"),
                "length_mean": statistics.fmean(self.length_mean) if self.length_mean else float("nan")}


def run_trl(mode: str, settings: Settings, model: Path, train_file: Path, out_dir: Path) -> SideResult:
    """One TRL mode in TRL's venv (benchmarks/trl_side.py)."""
    return SideResult(**trl_side.run_trl(mode, asdict(settings), model, train_file, out_dir), side=f"trl-{mode}")


# ----------------------------------------------------------------------------------------------------------------
# The dgrpo sides
# ----------------------------------------------------------------------------------------------------------------

def dgrpo_overrides(settings: Settings, train_file: Path, run_dir: Path) -> list[str]:
    """The stack settings that mirror the TRL sides (the keys of `dgrpo show-config`)."""
    p, g = settings.prompts_per_step, settings.group_size
    return [
        "sampler.enforce_eager=true", "sampler.max_model_len=512", "sampler.kv_cache_space_gib=1",
        # Precision as the demo's (model.dtype and learner.actor.dtype auto): on CPUs with bf16 instructions the
        # sampler runs bf16 weights, stochastically rounded (weights.rounding), and the learner computes on them;
        # elsewhere both run fp32. What mismatch remains is importance-corrected (tis_cap).
        "sampler.cpu_cores=all", "weights.rounding=stochastic", "learner.algorithm.tis_cap=2.0",
        f"learner.data.train_files=[{train_file}]", f"learner.data.train_batch_size={p}",
        f"learner.data.seed={settings.seed}", "learner.data.max_prompt_length=128",
        f"learner.rollout.n={g}", f"learner.rollout.max_response_length={settings.max_new_tokens}",
        f"learner.rollout.temperature={settings.temperature}",
        # One optimizer update per step, like TRL's; the forwards run dgrpo's packed layout (each group's prompt
        # once) with a token budget near what TRL's padded micro-batches of 8 sequences compute.
        f"learner.actor.ppo_mini_batch_size={p}", "learner.actor.use_dynamic_bsz=true",
        "learner.actor.share_prompts=true", "learner.actor.max_tokens_per_micro_batch=1024",
        f"learner.optim.lr={settings.lr}", "learner.optim.schedule=constant", "learner.optim.warmup_steps=0",
        "learner.algorithm.beta=0.0", "learner.algorithm.adv_scale=group", "learner.algorithm.loss_agg=token-mean",
        f"learner.trainer.total_training_steps={settings.steps}", f"learner.trainer.log_dir={run_dir}",
        "learner.trainer.run_name=bench_vs_trl", "learner.trainer.loggers=[console,jsonl]",
        f"learner.trainer.seed={settings.seed}", "learner.checkpoint.save_freq=0",
        f"learner.checkpoint.dir={run_dir / 'checkpoints'}", "learner.checkpoint.resume=never",
    ]


def _common(settings: Settings, train_file: Path, run_dir: Path, extra: list[str]) -> list[str]:
    lora = [f"learner.lora.rank={settings.lora_rank}", f"learner.lora.alpha={settings.lora_alpha}",
            "learner.lora.target_modules=all-linear"] if settings.lora_rank else []
    return [*dgrpo_overrides(settings, train_file, run_dir), "learner.data.val_files=[]",
            "learner.trainer.test_freq=0", "learner.trainer.val_before_train=false",
            "learner.checkpoint.export_dir=null", *lora, *extra]


def run_dgrpo(settings: Settings, train_file: Path, out_dir: Path, extra: list[str], samplers: int = 1) -> SideResult:
    """`dgrpo up` (rewarder, vLLM-CPU sampler(s), learner as separate processes) with the TRL sides' settings, on
    configs/cpu-demo.yaml with every setting that matters for the comparison overridden. With `samplers` > 1 each
    replica gets cores of its own (`dgrpo up --samplers N`) and the learner splits every batch between them."""
    run_dir = out_dir / "dgrpo-runs" / "up"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", "--samplers", str(samplers), "--no-demo-data",
                    *_common(settings, train_file, run_dir, extra)], check=True, env=env)
    layout = ("sampler and learner take turns on both cores" if samplers == 1 else
              f"{samplers} sampler replicas on cores of their own, taking turns with the learner on both cores")
    return _read_metrics(settings, run_dir, "dgrpo", f"dgrpo up ({layout})", extra)


def run_dgrpo_pinned(settings: Settings, train_file: Path, out_dir: Path, extra: list[str],
                     staleness: int = 0) -> SideResult:
    """trl-server's layout for dgrpo (benchmarks/bench_async.py's): rewarder and sampler on core 0 (vLLM's OpenMP
    threads bound there: sampler.cpu_cores=0), the learner on core 1 with one torch thread, each started as its own
    `dgrpo` service; max_staleness 1 samples the next batch while one trains (weights.pause_mode=keep)."""
    from bench_async import _free_ports, _wait_serving, stop_processes

    side = "dgrpo-pinned" + ("-async" if staleness else "")
    run_dir = out_dir / "dgrpo-runs" / side
    run_dir.mkdir(parents=True, exist_ok=True)
    sampler_port, rewarder_port, announce_port, control_port = _free_ports(4)
    common = [*_common(settings, train_file, run_dir, []), f"sampler.addresses=[127.0.0.1:{sampler_port}]",
              f"rewarder.port={rewarder_port}", f"learner.rollout.rewarder_address=127.0.0.1:{rewarder_port}",
              f"weights.announce_port={announce_port}", f"weights.control_port={control_port}",
              "weights.pause_mode=" + ("keep" if staleness else "wait"), "sampler.cpu_cores='0'",
              f"learner.rollout.max_staleness={staleness}", "learner.trainer.control_port=null", *extra]
    dgrpo = [sys.executable, "-m", "dgrpo.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    logs = {n: open(run_dir / f"{n}.log", "w") for n in ("rewarder", "sampler", "learner")}  # noqa: SIM115
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen(["taskset", "-c", "0", *dgrpo, "rewarder", "--config", str(CONFIG), *common],
                                      env=env, stdout=logs["rewarder"], stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(["taskset", "-c", "0", *dgrpo, "sampler", "--config", str(CONFIG), *common,
                                       f"sampler.port={sampler_port}", "sampler.host=127.0.0.1"], env=env,
                                      stdout=logs["sampler"], stderr=subprocess.STDOUT, start_new_session=True))
        _wait_serving(rewarder_port, procs[0])
        _wait_serving(sampler_port, procs[1])
        print(f"[bench] {side}: sampler and rewarder serving on core 0; learner on core 1 (log {run_dir})", flush=True)
        learner = subprocess.Popen(["taskset", "-c", "1", *dgrpo, "learner", "--config", str(CONFIG), *common],
                                   env={**env, "OMP_NUM_THREADS": "1"}, stdout=logs["learner"],
                                   stderr=subprocess.STDOUT)
        procs.append(learner)
        if learner.wait() != 0:
            raise RuntimeError(f"{side}: the learner exited with {learner.returncode} (log {run_dir})")
    finally:
        stop_processes(procs)
        for f in logs.values():
            f.close()
    how = "sampler on core 0, learner on core 1" + (", max_staleness 1" if staleness else "")
    return _read_metrics(settings, run_dir, side, f"dgrpo ({how})", extra)


def _read_metrics(settings: Settings, run_dir: Path, side: str, name: str, extra: list[str]) -> SideResult:
    """The learner's metrics.jsonl (one object per step)."""
    steps = [json.loads(line) for line in (run_dir / "bench_vs_trl" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m]
    chosen = [m.group(1) for log in run_dir.rglob("*.log")
              for m in re.finditer(r"learner.actor.dtype auto: (\w+) compute", log.read_text(errors="replace"))]
    config = yaml.safe_load((run_dir / "bench_vs_trl" / "config.yaml").read_text()) \
        if (run_dir / "bench_vs_trl" / "config.yaml").exists() else {}
    return SideResult(
        name=name + (f" {' '.join(extra)}" if extra else ""), side=side,
        step_s=[m["time/step_s"] for m in steps], reward_mean=[m["reward/mean"] for m in steps],
        length_mean=[m["response/length_mean"] for m in steps],
        logp_gap=[m["actor/sampler_logp_diff"] for m in steps if "actor/sampler_logp_diff" in m],
        completions_per_step=settings.prompts_per_step * settings.group_size,
        notes="median per phase: " + ", ".join(
            f"{k.split('/')[1]} {statistics.median(m[k] for m in steps):.1f} s"
            for k in ("time/generate_s", "time/reward_s", "time/logprob_s", "time/train_s", "time/weight_sync_s")
            if k in steps[0]) + (f"; learner compute {chosen[0]} (dtype auto)" if chosen else "")
        + (f"; sampler weights {config['model']['dtype']}" if config.get("model") else ""),
    )


# ----------------------------------------------------------------------------------------------------------------

def prepare(settings: Settings, out_dir: Path) -> tuple[Path, Path]:
    """The bundled model folder and the task's train split (what every side reads)."""
    from dgrpo.cli.tasks import write_task
    from dgrpo.common.models import resolve_model_path

    model = resolve_model_path(None)
    train, _ = write_task(out_dir / "data", settings.task, seed=settings.seed)
    return model, train


def _fmt(x: float, spec: str = ".2f", missing: str = "-") -> str:
    return missing if math.isnan(x) else format(x, spec)


def report(settings: Settings, results: list[SideResult]) -> None:
    load = os.getloadavg()
    print(f"\nload average at the end (1/5/15 min): {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on {os.cpu_count()} "
          "cores (other work inflates wall times)")
    print(f"SmolLM2-135M-Instruct, task {settings.task}, {settings.prompts_per_step} prompts x "
          f"{settings.group_size} completions, {settings.max_new_tokens} max new tokens, lr {settings.lr}, "
          f"{settings.steps} steps" + (f", LoRA rank {settings.lora_rank} alpha {settings.lora_alpha} on every "
                                       "linear layer" if settings.lora_rank else ", full fine-tuning"))
    print("| side | s/step (median) | steps 1-10 (median) | completions/s | reward first 5 -> last 5 | mean | "
          "rolling-5 >= 0.8 at step | logp gap first -> last | mean length |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r.summary()
        print(f"| {r.name} | {s['s_per_step_median']:.1f} | {s['s_per_step_1_10']:.1f} | "
              f"{s['completions_per_s']:.2f} | {s['reward_first5']:.2f} -> {s['reward_last5']:.2f} | "
              f"{s['reward_mean']:.2f} | {_fmt(s['steps_to_0.8'], '.0f', 'not reached')} | "
              f"{_fmt(s['gap_first'], '.3f')} -> {_fmt(s['gap_last'], '.3f')} | {s['length_mean']:.1f} |")
    for r in results:
        print(f"{r.side}: {r.name}\n  notes: {r.notes}")
        print(f"  per-step s: {' '.join(f'{x:.1f}' for x in r.step_s)}")
        print(f"  reward:     {' '.join(f'{x:.3f}' for x in r.reward_mean)}")
        if not math.isnan(r.peak_rss_gb):
            print(f"  peak RSS {r.peak_rss_gb:.2f} GB, {r.bytes_per_sync / 1e6:.1f} MB per weight sync")
        print(f"  at wall s:  {' '.join(f'{x:.0f}' for x in r.wall())}")
        if r.logp_gap:
            print(f"  logp gap:   {' '.join(f'{x:.3f}' for x in r.logp_gap)}")
    trl = [r for r in results if r.side.startswith("trl")]
    if not trl:
        return
    best = min(trl, key=lambda r: r.summary()["s_per_step_median"])
    colocate = next((r for r in trl if r.side == "trl-colocate"), None)
    print(f"strongest TRL mode (median s/step): {best.side} {best.summary()['s_per_step_median']:.1f} s")
    for r in results:
        if r.side.startswith("dgrpo"):
            x = best.summary()["s_per_step_median"] / r.summary()["s_per_step_median"]
            line = f"{r.side}: {x:.2f}x the steps per hour of {best.side}"
            if colocate is not None:
                xc = colocate.summary()["s_per_step_median"] / r.summary()["s_per_step_median"]
                line += f", {xc:.2f}x trl-colocate (goal for dgrpo's default: >= {GOAL_X:.0f}x)"
            print(line)


def plot(settings: Settings, results: list[SideResult], out: Path) -> Path:
    """Rolling-5 reward per step and against training wall-clock time, seconds per step, logprob gap: every side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax_r, ax_w), (ax_t, ax_g)) = plt.subplots(2, 2, figsize=(13, 8.5))
    colors = dict(zip(SIDES, ("tab:gray", "tab:orange", "tab:red", "tab:blue", "tab:cyan", "tab:green"),
                      strict=True))
    for r in results:
        c, label = colors.get(r.side, "black"), r.side
        steps = range(1, len(r.reward_mean) + 1)
        ax_r.plot(steps, r.reward_mean, ".", color=c, alpha=0.35)
        ax_r.plot(steps, r.rolling(), "-", color=c, lw=2, label=label)
        ax_w.plot(r.wall(), r.rolling(), ".-", color=c, lw=2, label=label)
        ax_t.plot(range(1, len(r.step_s) + 1), r.step_s, ".-", color=c,
                  label=f"{label}: median {statistics.median(r.step_s):.1f} s")
        if r.logp_gap:
            ax_g.plot(range(1, len(r.logp_gap) + 1), r.logp_gap, ".-", color=c, label=label)
    ax_r.set(xlabel="step", ylabel="mean reward (rolling 5; dots: per step)", title="reward per step")
    ax_w.set(xlabel="training seconds (start-up excluded)", ylabel="mean reward (rolling 5)",
             title="reward against wall-clock time")
    ax_t.set(xlabel="step", ylabel="seconds", title="seconds per step", ylim=(0, None))
    ax_g.set(xlabel="step", ylabel="mean |logp learner - logp sampler| per token", ylim=(0, None),
             title="sampler-learner logprob gap (vLLM sides)")
    for ax in (ax_r, ax_w, ax_t, ax_g):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, {settings.task}: {settings.prompts_per_step} prompts x "
                 f"{settings.group_size}, {settings.max_new_tokens} tokens, lr {settings.lr}, "
                 f"{os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", type=Path, default=HERE.parent / "outputs" / "bench_vs_trl")
    p.add_argument("--dgrpo-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for the dgrpo sides (repeatable), e.g. learner.actor.dtype=bfloat16")
    p.add_argument("--dgrpo-samplers", type=int, default=1,
                   help="sampler replicas of the `dgrpo` side (dgrpo up --samplers N; default 1)")
    p.add_argument("--report-only", action="store_true",
                   help="print the table and draw the plot from OUT/results.json (sides finished earlier)")
    a = p.parse_args(argv)
    settings = Settings(**{k: getattr(a, k) for k in asdict(defaults)})
    a.out = a.out.resolve()  # the TRL workers run with the output folder as their working directory
    a.out.mkdir(parents=True, exist_ok=True)
    if a.report_only:
        results = [SideResult(**r) for r in json.loads((a.out / "results.json").read_text())]
        report(settings, results)
        print(f"plot: {plot(settings, results, a.out / 'reward_curves.png')}")
        return 0
    model, train = prepare(settings, a.out)

    results: list[SideResult] = []
    for side in dict.fromkeys(a.sides):  # in the order given
        print(f"[bench] {side}", flush=True)
        try:
            if side.startswith("trl-"):
                results.append(run_trl(side.removeprefix("trl-"), settings, model, train, a.out))
            elif side == "dgrpo":
                results.append(run_dgrpo(settings, train, a.out, a.dgrpo_override, a.dgrpo_samplers))
            else:
                results.append(run_dgrpo_pinned(settings, train, a.out, a.dgrpo_override,
                                                staleness=1 if side.endswith("async") else 0))
        except (RuntimeError, TimeoutError, OSError, subprocess.CalledProcessError) as e:
            print(f"[bench] {side}: failed ({e})", file=sys.stderr)
        (a.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    if results:
        report(settings, results)
        print(f"plot: {plot(settings, results, a.out / 'reward_curves.png')}")
    return 0 if len(results) == len(a.sides) else 1


if __name__ == "__main__":
    sys.exit(main())
