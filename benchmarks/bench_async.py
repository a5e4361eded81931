"""Asynchronous GRPO against lockstep on the CPU demo, in the layout dgrpo is for: the sampler on its own core, the
learner on the other (each its own "device"), for learner.rollout.max_staleness k = 0, 1, 2, and the same task
with today's default (lockstep, sampler and learner sharing both cores) for reference.

    python benchmarks/bench_async.py                        # 30 steps; k = 0, 1, 2 x seeds 0, 1; the reference
    python benchmarks/bench_async.py --steps 8 --ks 0 1 --seeds 0 --no-reference     # a quick look

Each run starts its own rewarder, sampler and learner (`dgrpo` commands on configs/cpu-demo.yaml and the demo task; the
learner in bf16 autocast unless --learner-dtype float32), so nothing else may run meanwhile: the figures are ratios
within one invocation. Printed per run: steps per hour (from the learner's own step times, validation and start-up
excluded), the sampler's busy fraction (its seconds with a group in flight, from SamplerInfo.busy_seconds, over the
training wall time), the learner's busy fraction (train + logprob + weight sync over its step time), mean reward of the
first and last five steps. Then the k >= 1 speed-ups over k = 0 next to the goal (k = 1: >= 1.6x), the pipeline model's
prediction (benchmarks/pipeline_model.py) from the k = 0 runs' phase times, and one plot of reward per step and reward
over wall-clock time for every run (--plot). Results also go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIG = ROOT / "configs" / "cpu-demo.yaml"
GOAL_K1 = 1.6  # issue 13: k = 1 reaches >= 1.6x the steps per hour of k = 0 in the same layout

sys.path.insert(0, str(HERE))
from pipeline_model import PhaseTimes, predict


@dataclass
class Run:
    name: str
    k: int
    seed: int
    pinned: bool
    step_s: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    """Seconds since the first step began, at each step's end."""
    generate_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    staleness: list[float] = field(default_factory=list)
    sampler_busy: float = 0.0
    learner_busy: float = 0.0
    pause_mode: str = "keep"
    """weights.pause_mode for k >= 1 (k = 0 always waits: nothing is in flight at an update)."""
    learner_dtype: str = "bfloat16"
    """learner.actor.dtype (the CPU demo's is float32; bfloat16 is autocast over fp32 master weights)."""

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / statistics.median(self.step_s)

    def reward_ends(self) -> tuple[float, float]:
        return statistics.mean(self.rewards[:5]), statistics.mean(self.rewards[-5:])


def _free_ports(n: int) -> list[int]:
    """Below the ephemeral range, distinct (dgrpo up's picker: vLLM binds ephemeral ports meanwhile)."""
    from dgrpo.common.preflight import pick_free_ports

    return pick_free_ports(n)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM to each process still running, then wait for each (SIGKILL after `timeout`)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_serving(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service on {port} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"service on {port} not SERVING after {timeout}s")


def _busy_seconds(port: int) -> float:
    import grpc

    from dgrpo.v1 import sampler_pb2, sampler_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return sampler_pb2_grpc.SamplerStub(ch).Info(sampler_pb2.InfoRequest(), timeout=10).busy_seconds


def run_one(run: Run, steps: int, work: Path) -> Run:
    """Rewarder, sampler (core 0 when pinned), learner (core 1 when pinned); train `steps` steps; read metrics."""
    from dgrpo.cli.tasks import DEMO_TASK, write_task

    run_dir = work / run.name
    train, val = write_task(run_dir / "data", DEMO_TASK)
    sampler_port, rewarder_port, announce_port, control_port = _free_ports(4)
    common = [f"learner.data.train_files=[{train}]", f"learner.data.val_files=[{val}]",
              f"sampler.addresses=[127.0.0.1:{sampler_port}]", f"rewarder.port={rewarder_port}",
              f"learner.rollout.rewarder_address=127.0.0.1:{rewarder_port}",
              f"weights.announce_port={announce_port}", f"weights.control_port={control_port}",
              "weights.pause_mode=" + (run.pause_mode if run.k else "wait")]
    dgrpo = [sys.executable, "-m", "dgrpo.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pin = (lambda core: ["taskset", "-c", str(core)]) if run.pinned else (lambda core: [])
    logs = {name: open(run_dir / f"{name}.log", "w") for name in ("rewarder", "sampler", "learner")}  # noqa: SIM115
    procs: list[subprocess.Popen] = []
    try:
        # The rewarder scores as groups arrive, i.e. while the sampler decodes: it shares the sampler's core, so the
        # learner's core holds the learner alone.
        rewarder = subprocess.Popen([*pin(0), *dgrpo, "rewarder", "--config", str(CONFIG), *common], env=env,
                                    stdout=logs["rewarder"], stderr=subprocess.STDOUT)
        procs.append(rewarder)
        sampler = subprocess.Popen([*pin(0), *dgrpo, "sampler", "--config", str(CONFIG), *common,
                                    f"sampler.port={sampler_port}", "sampler.host=127.0.0.1",
                                    "sampler.cpu_cores=" + ("'0'" if run.pinned else "all")],
                                   env=env, stdout=logs["sampler"], stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(sampler)
        _wait_serving(rewarder_port, rewarder)
        _wait_serving(sampler_port, sampler)
        busy0 = _busy_seconds(sampler_port)
        learner_env = {**env, "OMP_NUM_THREADS": "1"} if run.pinned else env
        learner = subprocess.Popen(
            [*pin(1), *dgrpo, "learner", "--config", str(CONFIG), *common,
             f"learner.trainer.total_training_steps={steps}", "learner.trainer.test_freq=0",
             "learner.trainer.val_before_train=false", f"learner.trainer.seed={run.seed}",
             f"learner.data.seed={run.seed}",  # (no rollout.seed: vLLM-CPU's seeded sampling dies across pauses)
             f"learner.rollout.max_staleness={run.k}", f"learner.trainer.log_dir={run_dir}",
             f"learner.trainer.run_name={run.name}", f"learner.checkpoint.dir={run_dir / 'ckpt'}",
             "learner.checkpoint.export_dir=null", "learner.trainer.control_port=null",
             "learner.trainer.loggers=[console,jsonl]", f"learner.actor.dtype={run.learner_dtype}"],
            env=learner_env, stdout=logs["learner"], stderr=subprocess.STDOUT)
        procs.append(learner)
        if learner.wait() != 0:
            raise RuntimeError(f"{run.name}: the learner exited with {learner.returncode} (log {run_dir})")
        busy = _busy_seconds(sampler_port) - busy0
    finally:
        stop_processes(procs)
        for f in logs.values():
            f.close()
    records = [json.loads(line) for line in (run_dir / run.name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward/mean" in r]
    run.step_s = [r["time/step_s"] for r in records]
    run.rewards = [r["reward/mean"] for r in records]
    elapsed = 0.0
    for s in run.step_s:
        elapsed += s
        run.wall.append(elapsed)
    run.generate_s = [r.get("time/generate_s", 0.0) + r.get("time/reward_s", 0.0) for r in records]
    run.train_s = [r.get("time/train_s", 0.0) + r.get("time/logprob_s", 0.0) for r in records]
    run.sync_s = [r.get("time/weight_sync_s", 0.0) for r in records]
    run.staleness = [r.get("staleness/mean", 0.0) for r in records]
    run.sampler_busy = busy / max(elapsed, 1e-9)
    run.learner_busy = (sum(run.train_s) + sum(run.sync_s)) / max(elapsed, 1e-9)
    return run


def report(runs: list[Run]) -> None:
    print(f"\n{'run':<22}{'steps/h':>9}{'s/step':>8}{'sampler busy':>14}{'learner busy':>14}"
          f"{'staleness':>11}{'reward first5 -> last5':>26}{'mean':>7}")
    for r in runs:
        first, last = r.reward_ends()
        print(f"{r.name:<22}{r.steps_per_hour:>9.0f}{statistics.median(r.step_s):>8.2f}{r.sampler_busy:>14.0%}"
              f"{r.learner_busy:>14.0%}{statistics.mean(r.staleness):>11.2f}{first:>13.3f} -> {last:.3f}"
              f"{statistics.mean(r.rewards):>9.3f}")
    pinned = [r for r in runs if r.pinned]
    base = [r for r in pinned if r.k == 0]
    if not base:
        return
    base_rate = statistics.median(r.steps_per_hour for r in base)
    print(f"\nspeed-up over k = 0 (same layout, median over seeds; goal for k = 1: >= {GOAL_K1}x):")
    for k in sorted({r.k for r in pinned if r.k}):
        rate = statistics.median(r.steps_per_hour for r in pinned if r.k == k)
        print(f"  k = {k}: {rate / base_rate:.2f}x ({rate:.0f} vs {base_rate:.0f} steps/h)")
    for r in runs:
        if not r.pinned:
            print(f"  reference (lockstep, both cores shared): {r.steps_per_hour / base_rate:.2f}x of pinned k = 0")
    phases = PhaseTimes(generate_s=statistics.median(s for r in base for s in r.generate_s),
                        train_s=statistics.median(s for r in base for s in r.train_s),
                        sync_s=statistics.median(s for r in base for s in r.sync_s), replicas=1)
    ahead = [s for r in pinned if r.k for s in r.train_s]
    co_run = statistics.median(ahead) / phases.train_s if ahead else 1.0  # the update next to a decoding sampler
    print(f"\npipeline model from k = 0's phases (generate {phases.generate_s:.2f}s, train {phases.train_s:.2f}s, "
          f"sync {phases.sync_s:.2f}s per step); C = 1 (own devices) and C = {co_run:.2f} (the k >= 1 runs' median "
          "train time over k = 0's: both cores decode and train at once here):")
    for k in sorted({r.k for r in pinned}):
        measured = statistics.median(statistics.median(r.step_s) for r in pinned if r.k == k)
        with_c = predict(replace(phases, co_run_slowdown=co_run), k)
        print(f"  k = {k}: predicted {predict(phases, k):.2f} s/step (C = {co_run:.2f}: {with_c:.2f}), "
              f"measured {measured:.2f} s/step")


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {0: "tab:blue", 1: "tab:orange", 2: "tab:green", 3: "tab:red"}
    seeds = sorted({r.seed for r in runs})
    for r in runs:  # colour: k; line style: seed; the shared-core reference in grey
        style = {"color": colors.get(r.k, "tab:purple") if r.pinned else "grey",
                 "linestyle": ["-", "--", ":", "-."][seeds.index(r.seed) % 4], "label": r.name, "linewidth": 1.2}
        by_step.plot(range(1, len(r.rewards) + 1), r.rewards, **style)
        by_time.plot([w / 60 for w in r.wall], r.rewards, **style)
    by_step.set(xlabel="step", ylabel="mean reward", title="reward per step")
    by_time.set(xlabel="minutes of training", ylabel="mean reward", title="reward over wall-clock time")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--no-reference", action="store_true", help="skip the unpinned lockstep reference run")
    parser.add_argument("--pause-mode", choices=["keep", "wait"], default="keep",
                        help="weights.pause_mode of the k >= 1 runs (default keep: in-flight updates)")
    parser.add_argument("--learner-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="learner.actor.dtype of every run (default bfloat16, autocast over fp32 master weights, "
                             "as the learner runs on NPUs and GPUs; float32 is the CPU demo's own)")
    parser.add_argument("--work", type=Path, default=HERE / ".bench_async")
    parser.add_argument("--out", type=Path, default=HERE / ".bench_async" / "results.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "figures" / "bench_async.png")
    parser.add_argument("--from-results", type=Path, default=None,
                        help="report and plot the runs of an earlier --out file instead of running")
    args = parser.parse_args()
    if args.from_results:
        runs = [Run(**r) for r in json.loads(args.from_results.read_text())]
        report(runs)
        plot(runs, args.plot)
        return

    plan = [Run(f"k{k}_seed{s}_pinned", k, s, True, pause_mode=args.pause_mode, learner_dtype=args.learner_dtype)
            for s in args.seeds for k in args.ks]
    if not args.no_reference:
        plan.append(Run(f"k0_seed{args.seeds[0]}_shared", 0, args.seeds[0], False, learner_dtype=args.learner_dtype))
    runs = []
    for run in plan:
        t0 = time.monotonic()
        runs.append(run_one(run, args.steps, args.work))
        print(f"{run.name}: {statistics.median(run.step_s):.2f} s/step median, {time.monotonic() - t0:.0f}s with "
              "start-up", flush=True)
    report(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    plot(runs, args.plot)


if __name__ == "__main__":
    main()
