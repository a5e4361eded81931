"""The hung-replica scenario as a user meets it: `dgrpo up --samplers 2` on the CPU demo, then one sampler's whole
process group frozen with SIGSTOP for --freeze-s seconds (what a stuck host, a GC-paused node or a half-dead
container looks like from outside), then resumed.

    python benchmarks/bench_hung_replica.py                    # 90 s freeze, as in the issue that asked for it
    python benchmarks/bench_hung_replica.py --freeze-s 45 --steps 40

Printed: steps trained before, during and after the freeze with their rate (steps per minute, from the learner's
metrics.jsonl timestamps), the longest step and the step in flight when the freeze began, and what the rollout
reported (failed and stuck calls, retried and hedged prompts, seconds lost waiting). The anchor is the behaviour
before keepalive and progress checks: zero steps during a 90 s freeze, the step in flight taking 108 s. Nothing
else may run meanwhile (2 cores shared by every process of the stack); the freeze is bounded and always undone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = "before: 0 steps during a 90 s freeze; the step in flight took 108 s"


def records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip() and "reward/mean" in line]


def group_of(port: int) -> list[int]:
    """The process group of the service listening on `port` (what `dgrpo up` reaps as one)."""
    import psutil

    from dgrpo.cli.launch.procs import group_pids

    pid = next(c.pid for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)
    return group_pids(os.getpgid(pid))


def wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise SystemExit(f"dgrpo up exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def rate(recs: list[dict], start: float, end: float) -> tuple[int, float]:
    """Steps that ended within [start, end) and their rate per minute."""
    n = sum(start <= r["time"] < end for r in recs)
    return n, n / max(end - start, 1e-9) * 60


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze-s", type=float, default=90.0)
    parser.add_argument("--warmup-steps", type=int, default=4, help="steps before the freeze")
    parser.add_argument("--after-s", type=float, default=60.0, help="seconds measured after the resume")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-hung-"))
    cmd = [sys.executable, "-m", "dgrpo.cli", "up", "--samplers", "2", "--hung-restart-s", str(args.freeze_s + 120),
           f"learner.trainer.log_dir={out / 'runs'}", "learner.trainer.total_training_steps=1000",
           "learner.trainer.test_freq=0", "learner.trainer.val_before_train=false",
           f"learner.checkpoint.dir={out / 'ckpt'}", "learner.checkpoint.export_dir=null"]
    log = open(out / "up.log", "w")  # noqa: SIM115 (closed with the run)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    metrics = out / "runs" / "cpu_demo" / "metrics.jsonl"
    frozen: list[int] = []
    try:
        stack = wait(lambda: (out / "runs" / "cpu_demo" / "stack.yaml").is_file() and __import__("yaml").safe_load(
            (out / "runs" / "cpu_demo" / "stack.yaml").read_text()), 120, "the stack config", proc)
        port = int(stack["sampler"]["addresses"][1].rsplit(":", 1)[1])
        wait(lambda: len(records(metrics)) >= args.warmup_steps, 1200, "the warm-up steps", proc)
        before_start = records(metrics)[0]["time"]
        frozen = group_of(port)
        t_freeze = time.time()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(args.freeze_s)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        t_resume, frozen = time.time(), []
        time.sleep(args.after_s)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    recs = records(metrics)
    n_before, r_before = rate(recs, before_start, t_freeze)
    n_during, r_during = rate(recs, t_freeze, t_resume)
    n_after, r_after = rate(recs, t_resume, t_resume + args.after_s)
    during = [r for r in recs if t_freeze <= r["time"] < t_resume + args.after_s]
    print(f"dgrpo up --samplers 2 on the CPU demo; one sampler's process group SIGSTOPped for {args.freeze_s:.0f} s")
    print(f"  steps before the freeze: {n_before} ({r_before:.1f}/min, median step "
          f"{statistics.median(r['time/step_s'] for r in recs if r['time'] < t_freeze):.1f} s)")
    print(f"  steps during the freeze: {n_during} ({r_during:.1f}/min)   [{ANCHOR}]")
    print(f"  steps after the resume:  {n_after} ({r_after:.1f}/min)")
    if during:
        first = during[0]
        print(f"  the step in flight at the freeze: step {first['step']}, {first['time/step_s']:.1f} s; longest step "
              f"during/after: {max(r['time/step_s'] for r in during):.1f} s")
        print("  rollout: " + ", ".join(f"{k.split('/')[-1]} {sum(r[k] for r in during):g}" for k in (
            "rollout/failed_calls", "rollout/stuck_calls", "rollout/retried_prompts", "rollout/hedged_prompts",
            "rollout/lost_wait_s")))
        used_again = [r["step"] for r in during if r["time"] >= t_resume
                      and r.get("rollout/groups_by_replica/sampler-1", 0) > 0]
        print(f"  the resumed replica served again from step {used_again[0] if used_again else 'never'}")
    print(f"  run folder: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
