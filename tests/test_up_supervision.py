"""`dgrpo up` for real (rewarder, two sampler replicas and the learner as processes, the tiny model for speed: the
topology users run with `docker compose --scale sampler=2`), and kept running through lost services as a fault
injector would try it: kill -9 of a sampler replica and of the rewarder mid-run in asynchronous mode (restarted,
training goes on, nothing lost or repeated, the dead process group and its shared memory reaped), the reward swapped
in place with the run's token, Ctrl-C (a checkpoint and the report). Then the loss of the only sampler with no
restart left (the learner drops the step it cannot finish, keeps the last completed one in a checkpoint, `up` exits
1 and leaves nothing running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml
from up_support import SWAPPED_SPEC, listener_pid, stop_up, up_command, wait_for

from dgrpo.cli import procs
from dgrpo.common import devices
from dgrpo.v1 import rewarder_pb2, rewarder_pb2_grpc

pytestmark = pytest.mark.slow


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log_path = tmp_path / "up.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    return proc, log_path


def _steps_logged(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    complete = metrics.read_text().rpartition("\n")[0]  # the learner may be writing the last line
    return [json.loads(line)["step"] for line in complete.splitlines() if line.strip() and "reward/mean" in line]


def _kill_hard(port: int) -> tuple[int, list[int], set[str]]:
    """kill -9 of the service listening on `port` (only its leader, as the OOM killer would). Returns its process
    group, the group's processes, and the /dev/shm files they used that nobody else uses."""
    pid = listener_pid(port)
    assert pid is not None, f"nothing listens on {port}"
    members = procs.group_pids(pid)
    used = procs.shm_files(members)
    others = procs.shm_files([p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if p not in members])
    os.kill(pid, signal.SIGKILL)
    return pid, members, {p for p in used - others if not Path(p).name.startswith("dgrpo-")}


def test_killed_sampler_and_rewarder_are_restarted_and_training_goes_on(launcher, tiny_model, tmp_path):
    run_dir = tmp_path / "runs" / "sup"
    # Asynchronous (one batch sampled ahead, in-flight weight updates): a replica leaving and coming back is the
    # pipeline's scale-down and scale-up.
    proc, log = _start(up_command(tiny_model, tmp_path, "sup", 1000, "learner.rollout.max_staleness=1",
                                  "weights.pause_mode=keep", "--samplers", "2"), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (run_dir / "stack.yaml").read_text()), 60, "no stack.yaml", proc, log)
        sampler_port = int(stack["sampler"]["addresses"][0].rsplit(":", 1)[1])
        wait_for(lambda: _steps_logged(metrics), 400, "no training step finished", proc, log)

        pgid, members, shm_only_its = _kill_hard(sampler_port)
        assert len(members) > 1, "a sampler is a process tree (vLLM's engine core runs in its own process)"
        # The restart shares 2 cores with a learner that keeps training at full speed on the other replica (it no
        # longer waits on the dead one): the new engine's start-up takes minutes here.
        wait_for(lambda: "sampler-0 is back" in log.read_text(), 900, "sampler-0 was not restarted", proc, log)
        assert procs.group_pids(pgid) == [], "the dead sampler's engine and workers were not reaped"
        assert not [p for p in shm_only_its if os.path.exists(p)], "its shared memory was left behind"
        back_at = _steps_logged(metrics)[-1]
        wait_for(lambda: _steps_logged(metrics)[-1] >= back_at + 2, 300, "no steps after the restart", proc, log)

        _kill_hard(stack["rewarder"]["port"])
        wait_for(lambda: "rewarder is back" in log.read_text(), 120, "the rewarder was not restarted", proc, log)
        back_at = _steps_logged(metrics)[-1]
        wait_for(lambda: _steps_logged(metrics)[-1] >= back_at + 2, 300, "no steps after the restart", proc, log)

        # The reward swapped in place while batches are sampled ahead: later steps are scored by the new spec.
        # `up` made a token for the run (none was configured): Reload without it is refused, with it served.
        token = (run_dir / "token").read_text().strip()
        assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
        with grpc.insecure_channel(f"127.0.0.1:{stack['rewarder']['port']}") as channel:
            stub = rewarder_pb2_grpc.RewarderStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60,
                                metadata=[("authorization", f"Bearer {token}")])
        assert reply.spec.name == "swapped" and reply.previous.name != "swapped"
        swapped_at = _steps_logged(metrics)[-1]
        wait_for(lambda: _steps_logged(metrics)[-1] >= swapped_at + 3, 300, "no steps after the swap", proc, log)
        proc.send_signal(signal.SIGINT)  # stop after the step in progress
        assert proc.wait(300) == 130, log.read_text()[-5000:]
    finally:
        stop_up(proc, run_dir)
    # Every step exactly once; the restarted replica caught up to the current weights and served groups.
    steps = _steps_logged(metrics)
    assert steps == list(range(1, len(steps) + 1))
    records = [json.loads(line) for line in metrics.read_text().splitlines() if "reward/mean" in line]
    assert all(r["staleness/max"] <= 1 and r["reward/errors"] == 0 for r in records)
    after_restart = (run_dir / "logs" / "sampler-0.log").read_text().split("---- dgrpo up: restart 1 of sampler-0")
    assert len(after_restart) == 2 and "loaded weight version" in after_restart[1]
    assert any(r.get("rollout/groups_by_replica/sampler-0", 0) > 0 for r in records[back_at - 1:])
    assert "restart 1 of rewarder" in (run_dir / "logs" / "rewarder.log").read_text()
    spec_versions = [r["reward/spec_version_max"] for r in records]
    assert spec_versions == sorted(spec_versions) and spec_versions[-1] > spec_versions[swapped_at - 1]
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").glob("step_*"))  # the Ctrl-C checkpoint
    # Both replicas loaded the last published version before the learner let its weight slots go.
    for i, replica in enumerate(("sampler-0", "sampler-1")):
        replica_log = (run_dir / "logs" / f"{replica}.log").read_text()
        assert f"loaded weight version {steps[-1]}" in replica_log, replica
        # Cores of its own (vLLM's `auto` binds every replica to the same core), in its first start and its restart.
        own = devices.replica_cpu_cores(i, 2)
        assert replica_log.count(f"VLLM_CPU_OMP_THREADS_BIND='{own}'") == (2 if replica == "sampler-0" else 1)
    assert "swapped" in (run_dir / "logs" / "rewarder.log").read_text()
    # The report of the steps that ran; everything stopped; no weight segment left in /dev/shm.
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert "mean reward, first" in log.read_text()
    assert not list(Path("/dev/shm").glob("dgrpo-w-sup*"))


def test_losing_the_only_sampler_keeps_the_last_completed_step(launcher, tiny_model, tmp_path):
    run_dir, steps = tmp_path / "runs" / "lost", 20
    proc, log = _start(up_command(tiny_model, tmp_path, "lost", steps, "learner.checkpoint.save_freq=0",
                                  "--max-restarts", "0", "--stop-timeout", "120"), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (run_dir / "stack.yaml").read_text()), 60, "no stack.yaml", proc, log)
        port = int(stack["sampler"]["addresses"][0].rsplit(":", 1)[1])
        wait_for(lambda: len(_steps_logged(metrics)) >= 2, 400, "two steps did not finish", proc, log)
        learner_pgid = listener_pid(stack["learner"]["trainer"]["control_port"])
        pgid, _, shm_only_its = _kill_hard(port)
        code = proc.wait(180)
    finally:
        stop_up(proc, tmp_path / "runs")
    output = log.read_text()
    assert code == 1, output[-5000:]
    assert "every sampler is gone" in output
    done = _steps_logged(metrics)[-1]
    # The learner dropped the step it could not finish and checkpointed the one before (save_freq=0: no other
    # checkpoint was due), so a resume redoes only the dropped step. When the kill lands while a step trains (its
    # samples all in: steps take ~2 s here), that step is finished instead and is the one kept.
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    dropped = f"dropped step {done + 1} in flight, kept step {done}" in learner_log
    finished = f"finishing step {done} first" in learner_log and f"training stopped at step {done} " in learner_log
    assert dropped or finished, learner_log[-3000:]
    assert (tmp_path / "ckpt" / f"step_{done}").is_dir()
    # Nothing left running, nothing left in /dev/shm.
    assert procs.group_pids(pgid) == [] and (learner_pgid is None or procs.group_pids(learner_pgid) == [])
    assert not [p for p in shm_only_its if os.path.exists(p)]
    assert not list(Path("/dev/shm").glob("dgrpo-w-lost*"))
