"""Shared by the tests that run `dgrpo up` for real: the tiny-model command line and a poll that fails fast."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

SWAPPED_SPEC = """
name: swapped
functions:
  - type: math_verify
    field: answer
  - type: length
    weight: 0.1
    max_length: 40
    mode: penalty
"""
"""The reward spec the `dgrpo up` tests hot-swap in."""


def up_command(model: Path, tmp_path: Path, run_name: str, steps: int, *extra: str) -> list[str]:
    """`dgrpo up` on the tiny model: a few seconds per step on 2 cores."""
    return [
        sys.executable, "-m", "dgrpo.cli", "up",
        f"model.path={model}", "model.dtype=float32", "sampler.max_model_len=256",
        f"learner.trainer.log_dir={tmp_path / 'runs'}", f"learner.trainer.run_name={run_name}",
        f"learner.trainer.total_training_steps={steps}", "learner.trainer.val_before_train=false",
        "learner.trainer.test_freq=0", "learner.data.train_batch_size=4", "learner.actor.ppo_mini_batch_size=4",
        "learner.actor.micro_batch_size_per_device=4", "learner.rollout.n=4", "learner.rollout.max_response_length=24",
        f"learner.checkpoint.dir={tmp_path / 'ckpt'}", f"learner.checkpoint.export_dir={tmp_path / 'model'}",
        "learner.data.max_prompt_length=96", "learner.optim.lr=1e-4", *extra,
    ]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    """Poll `predicate`; fail at once, with the log's tail, if `dgrpo up` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"{what}: dgrpo up exited with {proc.returncode}\n{log.read_text()[-5000:]}")
        time.sleep(0.5)
    raise TimeoutError(what)


def listener_pid(port: int) -> int | None:
    """The process listening on a local TCP port (a service `up` started)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def stop_up(proc: subprocess.Popen, run_dir: Path) -> None:
    """End a `dgrpo up` a test is done with, whatever state it is in: SIGTERM (it stops the learner, then its
    services), then SIGKILL of `up` and of every process still running from this run's folder. Its services run in
    sessions of their own, so killing `up` alone would leave them (and vLLM's busy engine workers) running and
    taking the CPU from every later test."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    marker = str(run_dir)
    leaders = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for leader in leaders:
        try:
            members = [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in members:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
    psutil.wait_procs(leaders, timeout=10)
