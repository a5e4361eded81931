"""`dgrpo up` for real (rewarder, two sampler replicas and the learner as processes, the tiny model for speed: the
topology users run with `docker compose --scale sampler=2`), kept training through what a fault injector tries, in
one run in asynchronous mode (one batch sampled ahead, in-flight weight updates: a replica leaving and coming back
is the pipeline's scale-down and scale-up), with the shipped keepalive, progress and --hung-restart-s defaults:

1. a sampler frozen (its whole process group SIGSTOPped: a stuck host, a GC-paused node, a half-dead container: no
   error, no closed connection) for less than --hung-restart-s: steps train on the other replica meanwhile;
   resumed, it is used again and never restarted;
2. a sampler killed with kill -9 (its leader only, as the OOM killer would): `up` reaps its engine and shared
   memory and restarts it; the new engine catches up to the current weights and serves groups;
3. meanwhile the rewarder frozen for good: its calls wait, `up` kills it after --hung-restart-s and restarts it;
4. the rewarder killed with kill -9: restarted again, training goes on;
5. the reward swapped in place with the run's token (refused without it);
6. the learner frozen for less than --hung-restart-s: the samplers and the rewarder keep answering SERVING, and
   training goes on once it resumes;
7. Ctrl-C: a checkpoint, the report, nothing left running or in /dev/shm; every step exactly once.

Then the loss of the only sampler with no restart left (the learner drops the step it cannot finish, keeps the last
completed one in a checkpoint, `up` exits 1 and leaves nothing running). Every freeze is undone in `finally`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import yaml
from support import wait_serving
from up_support import SWAPPED_SPEC, listener_pid, stop_up, up_command, wait_for

from dgrpo.cli import procs
from dgrpo.common import devices
from dgrpo.v1 import rewarder_pb2, rewarder_pb2_grpc

pytestmark = pytest.mark.slow

HUNG_RESTART_S = 60  # `dgrpo up --hung-restart-s`'s default, which this run keeps
LEARNER_FREEZE_S = 30  # the learner's freeze: half of HUNG_RESTART_S, so `up` leaves it alone


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log_path = tmp_path / "up.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    return proc, log_path


def _records(metrics: Path) -> list[dict]:
    if not metrics.is_file():
        return []
    # Only whole lines: the learner may be writing the last one while this reads (CI once caught one half-written).
    complete = metrics.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines() if line.strip() and "reward/mean" in line]


def _steps_logged(metrics: Path) -> list[int]:
    return [r["step"] for r in _records(metrics)]


def _group(port: int) -> list[int]:
    pid = listener_pid(port)
    assert pid is not None, f"nothing listens on {port}"
    return procs.group_pids(os.getpgid(pid))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


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


def test_frozen_and_killed_services_never_stop_training(launcher, tiny_model, tmp_path):
    run_dir = tmp_path / "runs" / "faults"
    proc, log = _start(up_command(tiny_model, tmp_path, "faults", 1000, "learner.rollout.max_staleness=1",
                                  "weights.pause_mode=keep", "--samplers", "2"), tmp_path)
    metrics = run_dir / "metrics.jsonl"
    frozen: list[int] = []

    def last_step() -> int:
        return _steps_logged(metrics)[-1]

    def steps_after(step: int, n: int, what: str, timeout: float = 300) -> None:
        wait_for(lambda: last_step() >= step + n, timeout, what, proc, log)

    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (run_dir / "stack.yaml").read_text()), 60, "no stack.yaml", proc, log)
        ports = [int(a.rsplit(":", 1)[1]) for a in stack["sampler"]["addresses"]]
        rewarder_port = stack["rewarder"]["port"]
        wait_for(lambda: _steps_logged(metrics), 400, "no training step finished", proc, log)

        # 1. sampler-1 frozen, then resumed before --hung-restart-s.
        frozen = _group(ports[1])
        _signal(frozen, signal.SIGSTOP)
        frozen_at, started = last_step(), time.monotonic()
        steps_after(frozen_at, 2, "training stalled behind the frozen sampler", HUNG_RESTART_S - 10)
        assert time.monotonic() - started < HUNG_RESTART_S
        assert all(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for pid in frozen)
        _signal(frozen, signal.SIGCONT)
        frozen, resumed_at = [], last_step()
        wait_for(lambda: any(r.get("rollout/groups_by_replica/sampler-1", 0) > 0
                             for r in _records(metrics)[resumed_at:]), 120, "the resumed sampler is not used",
                 proc, log)

        # 2. sampler-0 killed; 3. while its engine starts again (minutes on 2 cores shared with a learner that keeps
        # training on the other replica; the faults overlap as they would on a bad day), the rewarder frozen for good.
        pgid, members, shm_only_its = _kill_hard(ports[0])
        assert len(members) > 1, "a sampler is a process tree (vLLM's engine core runs in its own process)"
        frozen = _group(rewarder_port)
        _signal(frozen, signal.SIGSTOP)
        wait_for(lambda: "rewarder is back" in log.read_text(), HUNG_RESTART_S + 120,
                 "the frozen rewarder was not restarted", proc, log)
        hung_rewarder, frozen = frozen, []
        wait_for(lambda: "sampler-0 is back" in log.read_text(), 900, "sampler-0 was not restarted", proc, log)
        assert procs.group_pids(pgid) == [], "the dead sampler's engine and workers were not reaped"
        assert not [p for p in shm_only_its if os.path.exists(p)], "its shared memory was left behind"
        assert not [p for p in hung_rewarder if Path(f"/proc/{p}").exists()], "the frozen rewarder was not reaped"
        back_at = last_step()
        steps_after(back_at, 2, "no steps after the restarts")

        # 4. The rewarder killed: restarted again.
        _kill_hard(rewarder_port)
        wait_for(lambda: log.read_text().count("rewarder is back") == 2, 120, "the rewarder was not restarted",
                 proc, log)
        steps_after(last_step(), 2, "no steps after the rewarder's second restart")

        # 5. The reward swapped in place while batches are sampled ahead: later steps are scored by the new spec.
        # `up` made a token for the run (none was configured): Reload without it is refused, with it served.
        token = (run_dir / "token").read_text().strip()
        assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
        with grpc.insecure_channel(f"127.0.0.1:{rewarder_port}") as channel:
            stub = rewarder_pb2_grpc.RewarderStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60,
                                metadata=[("authorization", f"Bearer {token}")])
        assert reply.spec.name == "swapped" and reply.previous.name != "swapped"
        swapped_at = last_step()
        steps_after(swapped_at, 3, "no steps after the swap")

        # 6. The learner frozen (shorter than --hung-restart-s): the samplers and the rewarder stay SERVING
        # throughout, and serve it again once it resumes.
        frozen = _group(stack["weights"]["announce_port"])
        _signal(frozen, signal.SIGSTOP)
        frozen_at, started = last_step(), time.monotonic()
        while time.monotonic() - started < LEARNER_FREEZE_S:
            for port in [*ports, rewarder_port]:
                wait_serving(f"127.0.0.1:{port}", 10)  # TimeoutError: a service stopped serving meanwhile
            time.sleep(2)
        _signal(frozen, signal.SIGCONT)
        frozen = []
        steps_after(frozen_at, 2, "no steps after the learner resumed")

        # 7. Ctrl-C: stop after the step in progress.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 130, log.read_text()[-5000:]
    finally:
        _signal(frozen, signal.SIGCONT)
        stop_up(proc, run_dir)
    text = log.read_text()
    records = _records(metrics)
    steps = [r["step"] for r in records]
    # Every step exactly once and on a whole batch, whatever the services went through.
    assert steps == list(range(1, len(steps) + 1)), "a step was lost or repeated"
    assert all(sum(v for k, v in r.items() if k.startswith("rollout/groups_by_replica/")) == 4 for r in records)
    assert all(r["staleness/max"] <= 1 and r["reward/errors"] == 0 for r in records)
    # The frozen ones were found, waited for, and (the rewarder) restarted; the briefly frozen replica was not.
    assert any(r["rollout/unhealthy_replicas"] >= 1 for r in records)
    assert sum(r["rollout/lost_wait_s"] for r in records) > 0
    assert "rewarder has not answered its health check" in text
    assert "restart 1 of sampler-1" not in (run_dir / "logs" / "sampler-1.log").read_text(), "resumed, not restarted"
    assert "restart 2 of rewarder" in (run_dir / "logs" / "rewarder.log").read_text()
    # The restarted replica caught up to the current weights and served groups.
    after_restart = (run_dir / "logs" / "sampler-0.log").read_text().split("---- dgrpo up: restart 1 of sampler-0")
    assert len(after_restart) == 2 and "loaded weight version" in after_restart[1]
    assert any(r.get("rollout/groups_by_replica/sampler-0", 0) > 0 for r in records[back_at - 1:])
    spec_versions = [r["reward/spec_version_max"] for r in records]
    assert spec_versions == sorted(spec_versions) and spec_versions[-1] > spec_versions[swapped_at - 1]
    assert "swapped" in (run_dir / "logs" / "rewarder.log").read_text()
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").glob("step_*"))  # the Ctrl-C checkpoint
    # Both replicas loaded the last published version before the learner let its weight slots go.
    for i, replica in enumerate(("sampler-0", "sampler-1")):
        replica_log = (run_dir / "logs" / f"{replica}.log").read_text()
        assert f"loaded weight version {steps[-1]}" in replica_log, replica
        # Cores of its own (vLLM's `auto` binds every replica to the same core), in its first start and its restart.
        own = devices.replica_cpu_cores(i, 2)
        assert replica_log.count(f"VLLM_CPU_OMP_THREADS_BIND='{own}'") == (2 if replica == "sampler-0" else 1)
    # The report of the steps that ran; everything stopped; no weight segment left in /dev/shm.
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert "mean reward, first" in text
    assert not list(Path("/dev/shm").glob("dgrpo-w-faults*"))


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
