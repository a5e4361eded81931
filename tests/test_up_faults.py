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

The run is a chain of module-scoped phase fixtures (one per fault above), each keeping what it saw; every test
checks one property of one phase. Then the loss of the only sampler with no restart left (the learner drops the
step it cannot finish, keeps the last completed one in a checkpoint, `up` exits 1 and leaves nothing running).
Every freeze is undone in `finally`. Last, a short run of one replica whose learner is killed with kill -9 (as the
OOM killer would): `up` says so in one line and restarts it, and it resumes from its newest checkpoint; then `up`
itself is SIGKILLed mid-step, and within 10 s no process of the run and none of its shared memory is left
(cli/launch/lifeline.py).
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

from dgrpo.cli.launch import procs
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


class UpRun:
    """The faulted run: `dgrpo up`, its files, and the process groups frozen right now (resumed whatever happens)."""

    def __init__(self, tiny_model: Path, tmp: Path):
        self.tmp, self.run_dir = tmp, tmp / "runs" / "faults"
        self.metrics = self.run_dir / "metrics.jsonl"
        self.proc, self.log = _start(up_command(tiny_model, tmp, "faults", 1000, "learner.rollout.max_staleness=1",
                                                "weights.pause_mode=keep", "--samplers", "2"), tmp)
        self.frozen: list[int] = []

    def wait_started(self) -> None:
        """Until `up` wrote the stack's addresses and the learner trained a step."""
        self.stack = self.wait_for(lambda: (self.run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (self.run_dir / "stack.yaml").read_text()), 60, "no stack.yaml")
        self.sampler_ports = [int(a.rsplit(":", 1)[1]) for a in self.stack["sampler"]["addresses"]]
        self.rewarder_port = self.stack["rewarder"]["port"]
        self.wait_for(lambda: _steps_logged(self.metrics), 400, "no training step finished")

    def wait_for(self, predicate, timeout: float, what: str):
        return wait_for(predicate, timeout, what, self.proc, self.log)

    def records(self) -> list[dict]:
        return _records(self.metrics)

    def last_step(self) -> int:
        return _steps_logged(self.metrics)[-1]

    def steps_after(self, step: int, n: int, what: str, timeout: float = 300) -> None:
        self.wait_for(lambda: self.last_step() >= step + n, timeout, what)

    def freeze(self, port: int) -> list[int]:
        self.frozen = _group(port)
        _signal(self.frozen, signal.SIGSTOP)
        return self.frozen

    def resume(self) -> None:
        _signal(self.frozen, signal.SIGCONT)
        self.frozen = []


@pytest.fixture(scope="module")
def up_run(launcher, tiny_model, tmp_path_factory):
    run = UpRun(tiny_model, tmp_path_factory.mktemp("faults"))
    try:
        run.wait_started()
        yield run
    finally:
        run.resume()
        stop_up(run.proc, run.run_dir)


@pytest.fixture(scope="module")
def sampler_frozen_briefly(up_run):
    """sampler-1's process group frozen, then resumed before --hung-restart-s."""
    frozen = up_run.freeze(up_run.sampler_ports[1])
    frozen_at, started = up_run.last_step(), time.monotonic()
    up_run.steps_after(frozen_at, 2, "training stalled behind the frozen sampler", HUNG_RESTART_S - 10)
    seen = {"seconds_for_2_steps": time.monotonic() - started,
            "states": {pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in frozen}}
    up_run.resume()
    resumed_at = up_run.last_step()
    up_run.wait_for(lambda: any(r.get("rollout/groups_by_replica/sampler-1", 0) > 0
                                for r in up_run.records()[resumed_at:]), 120, "the resumed sampler is not used")
    return seen


@pytest.fixture(scope="module")
def sampler_killed_rewarder_hung(up_run, sampler_frozen_briefly):
    """sampler-0 killed; while its engine starts again (on 2 cores shared with a learner that keeps training on the
    other replica; the faults overlap as they would on a bad day), the rewarder frozen for good."""
    pgid, members, shm_only_its = _kill_hard(up_run.sampler_ports[0])
    hung_rewarder = up_run.freeze(up_run.rewarder_port)
    up_run.wait_for(lambda: "rewarder is back" in up_run.log.read_text(), HUNG_RESTART_S + 120,
                    "the frozen rewarder was not restarted")
    up_run.frozen = []  # `up` killed it
    up_run.wait_for(lambda: "sampler-0 is back" in up_run.log.read_text(), 900, "sampler-0 was not restarted")
    seen = {"members": members, "sampler_group_left": procs.group_pids(pgid),
            "shm_left": [p for p in shm_only_its if os.path.exists(p)],
            "rewarder_left": [p for p in hung_rewarder if Path(f"/proc/{p}").exists()], "back_at": up_run.last_step()}
    up_run.steps_after(seen["back_at"], 2, "no steps after the restarts")
    return seen


@pytest.fixture(scope="module")
def rewarder_killed(up_run, sampler_killed_rewarder_hung):
    _kill_hard(up_run.rewarder_port)
    up_run.wait_for(lambda: up_run.log.read_text().count("rewarder is back") == 2, 120,
                    "the rewarder was not restarted")
    up_run.steps_after(up_run.last_step(), 2, "no steps after the rewarder's second restart")


@pytest.fixture(scope="module")
def reward_swapped(up_run, rewarder_killed):
    """Reload without the token `up` made for the run (none was configured), then with it, while batches are
    sampled ahead."""
    token = (up_run.run_dir / "token").read_text().strip()
    with grpc.insecure_channel(f"127.0.0.1:{up_run.rewarder_port}") as channel:
        stub = rewarder_pb2_grpc.RewarderStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60)
        reply = stub.Reload(rewarder_pb2.ReloadRequest(spec_text=SWAPPED_SPEC), timeout=60,
                            metadata=[("authorization", f"Bearer {token}")])
    swapped_at = up_run.last_step()
    up_run.steps_after(swapped_at, 3, "no steps after the swap")
    return {"refused": refused.value.code(), "reply": reply, "swapped_at": swapped_at}


@pytest.fixture(scope="module")
def learner_frozen(up_run, reward_swapped):
    """The learner frozen for less than --hung-restart-s; every service's health asked every 2 s meanwhile."""
    up_run.freeze(up_run.stack["weights"]["announce_port"])
    frozen_at, started, answers = up_run.last_step(), time.monotonic(), []
    while time.monotonic() - started < LEARNER_FREEZE_S:
        for port in [*up_run.sampler_ports, up_run.rewarder_port]:
            try:
                wait_serving(f"127.0.0.1:{port}", 10)
                answers.append((port, "SERVING"))
            except TimeoutError as e:
                answers.append((port, str(e)))
        time.sleep(2)
    up_run.resume()
    up_run.steps_after(frozen_at, 2, "no steps after the learner resumed")
    return answers


@pytest.fixture(scope="module")
def interrupted(up_run, learner_frozen):
    """Ctrl-C: `up` stops after the step in progress."""
    up_run.proc.send_signal(signal.SIGINT)
    code = up_run.proc.wait(300)
    return {"code": code, "records": up_run.records(), "text": up_run.log.read_text()}


def test_a_briefly_frozen_sampler_never_stalls_training_and_is_used_again(sampler_frozen_briefly):
    assert sampler_frozen_briefly["seconds_for_2_steps"] < HUNG_RESTART_S
    assert set(sampler_frozen_briefly["states"].values()) == {"T"}, "the sampler was not frozen the whole time"


def test_a_killed_sampler_is_reaped_and_restarted(sampler_killed_rewarder_hung):
    seen = sampler_killed_rewarder_hung
    assert len(seen["members"]) > 1, "a sampler is a process tree (vLLM's engine core runs in its own process)"
    assert seen["sampler_group_left"] == [], "the dead sampler's engine and workers were not reaped"
    assert not seen["shm_left"], "its shared memory was left behind"


def test_a_hung_rewarder_is_killed_and_restarted(up_run, sampler_killed_rewarder_hung):
    assert "rewarder has not answered its health check" in up_run.log.read_text()
    assert not sampler_killed_rewarder_hung["rewarder_left"], "the frozen rewarder was not reaped"


def test_a_killed_rewarder_is_restarted(up_run, rewarder_killed):
    assert "restart 2 of rewarder" in (up_run.run_dir / "logs" / "rewarder.log").read_text()


def test_every_service_keeps_serving_while_the_learner_is_frozen(learner_frozen):
    assert learner_frozen and {answer for _, answer in learner_frozen} == {"SERVING"}, learner_frozen


def test_the_restarted_sampler_catches_up_on_the_weights_and_serves(up_run, sampler_killed_rewarder_hung, interrupted):
    after_restart = (up_run.run_dir / "logs" / "sampler-0.log").read_text().split(
        "---- dgrpo up: restart 1 of sampler-0")
    assert len(after_restart) == 2 and "loaded weight version" in after_restart[1]
    later = interrupted["records"][sampler_killed_rewarder_hung["back_at"] - 1:]
    assert any(r.get("rollout/groups_by_replica/sampler-0", 0) > 0 for r in later)


def test_the_reward_swaps_in_place_only_with_the_runs_token(up_run, reward_swapped, interrupted):
    assert (up_run.run_dir / "token").stat().st_mode & 0o777 == 0o600
    assert reward_swapped["refused"] == grpc.StatusCode.UNAUTHENTICATED
    reply = reward_swapped["reply"]
    assert reply.spec.name == "swapped" and reply.previous.name != "swapped"
    spec_versions = [r["reward/spec_version_max"] for r in interrupted["records"]]
    assert spec_versions == sorted(spec_versions)
    assert spec_versions[-1] > spec_versions[reward_swapped["swapped_at"] - 1]
    assert "swapped" in (up_run.run_dir / "logs" / "rewarder.log").read_text()


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_the_report(up_run, interrupted):
    assert interrupted["code"] == 130, interrupted["text"][-5000:]
    assert (up_run.tmp / "ckpt").is_dir() and list((up_run.tmp / "ckpt").glob("step_*"))
    assert (up_run.run_dir / "report.png").stat().st_size > 10_000
    assert "mean reward, first" in interrupted["text"]
    assert not list(Path("/dev/shm").glob("dgrpo-w-faults*")), "a weight segment was left in /dev/shm"


def test_every_step_trained_once_on_a_whole_batch(interrupted):
    """Whatever the services went through: every step exactly once, on all 4 groups, scored without errors, at most
    one version behind."""
    records = interrupted["records"]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "a step was lost or repeated"
    assert all(sum(v for k, v in r.items() if k.startswith("rollout/groups_by_replica/")) == 4 for r in records)
    assert all(r["staleness/max"] <= 1 and r["reward/errors"] == 0 for r in records)


def test_frozen_services_were_waited_for_and_the_briefly_frozen_one_not_restarted(up_run, interrupted):
    records = interrupted["records"]
    assert any(r["rollout/unhealthy_replicas"] >= 1 for r in records)
    assert sum(r["rollout/lost_wait_s"] for r in records) > 0
    sampler_1 = (up_run.run_dir / "logs" / "sampler-1.log").read_text()
    assert "restart 1 of sampler-1" not in sampler_1, "resumed, not restarted"


def test_both_replicas_load_the_last_version_on_cores_of_their_own(up_run, interrupted):
    """Before the learner let its weight slots go; vLLM's `auto` binds every replica to the same core, so each
    gets its own, in its first start and its restart."""
    last = interrupted["records"][-1]["step"]
    for i, replica in enumerate(("sampler-0", "sampler-1")):
        replica_log = (up_run.run_dir / "logs" / f"{replica}.log").read_text()
        assert f"loaded weight version {last}" in replica_log, replica
        own = devices.replica_cpu_cores(i, 2)
        assert replica_log.count(f"VLLM_CPU_OMP_THREADS_BIND='{own}'") == (2 if replica == "sampler-0" else 1)


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


# ---- a crashed learner, then `up` itself killed --------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(scope="module")
def learner_killed(launcher, tiny_model, tmp_path_factory):
    """One replica, a checkpoint every 2 steps; the learner's leader killed with kill -9 once one is saved."""
    tmp = tmp_path_factory.mktemp("orphans")
    run_dir, ckpt = tmp / "runs" / "orphans", tmp / "ckpt"
    proc, log = _start(up_command(tiny_model, tmp, "orphans", 1000, "learner.checkpoint.save_freq=2"), tmp)
    run = {"proc": proc, "log": log, "run_dir": run_dir, "metrics": run_dir / "metrics.jsonl", "ckpt": ckpt}
    try:
        stack = wait_for(lambda: (run_dir / "stack.yaml").is_file() and yaml.safe_load(
            (run_dir / "stack.yaml").read_text()), 60, "no stack.yaml", proc, log)
        wait_for(lambda: (ckpt / "step_2" / "meta.json").is_file(), 400, "no checkpoint at step 2", proc, log)
        learner = os.getpgid(listener_pid(stack["weights"]["announce_port"]))  # its leader: the group's id
        newest = max(int(p.parent.name.split("_")[1]) for p in ckpt.glob("step_*/meta.json"))
        os.kill(learner, signal.SIGKILL)
        killed_at = max(_steps_logged(run["metrics"]), default=0)
        learner_log = run_dir / "logs" / "learner.log"
        wait_for(lambda: "resumed from" in learner_log.read_text().partition("restart 1 of learner")[2], 120,
                 "the restarted learner did not resume", proc, log)
        wait_for(lambda: max(_steps_logged(run["metrics"]), default=0) > killed_at, 120,
                 "no step after the learner's restart", proc, log)
        run.update(newest=newest, killed_at=killed_at, stack=stack, text=log.read_text(),
                   learner_log=learner_log.read_text())
        yield run
    finally:
        stop_up(proc, run_dir)


@pytest.fixture(scope="module")
def up_killed(learner_killed):
    """`up` SIGKILLed while a step is in flight; what of the run was running and mapped just before."""
    run = learner_killed
    marker = str(run["run_dir"] / "stack.yaml")
    leaders = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if marker in _cmdline(p)]
    pids = sorted({pid for leader in leaders for pid in procs.group_pids(leader)})
    shm = {p for p in procs.shm_files(pids) if Path(p).exists()}
    shm |= {str(p) for p in Path("/dev/shm").glob("dgrpo-w-orphans*")}
    at = max(_steps_logged(run["metrics"]))
    run["proc"].kill()
    run["proc"].wait()
    killed, deadline = time.monotonic(), time.monotonic() + 10
    while time.monotonic() < deadline and (any(map(_alive, pids)) or any(os.path.exists(p) for p in shm)):
        time.sleep(0.2)
    return {"leaders": leaders, "pids": pids, "shm": shm, "at": at, "seconds": time.monotonic() - killed,
            "left": [p for p in pids if _alive(p)], "shm_left": [p for p in shm if os.path.exists(p)],
            "steps_after": max(_steps_logged(run["metrics"])) - at}


def test_a_killed_learner_is_restarted_with_one_line_and_resumes_from_its_newest_checkpoint(learner_killed):
    run = learner_killed
    newest = run["ckpt"] / f"step_{run['newest']}"
    # No OOM here: the line says SIGKILL without claiming it (the wording for an OOM kill: tests/test_exits.py).
    line = next(x for x in run["text"].splitlines() if "learner was killed by SIGKILL" in x)
    assert "out of memory" not in line and ("something sent it" in line or "no OOM record readable" in line), line
    assert line.endswith(f"restarting it in 2s (restart 1 of 3): it resumes from its newest checkpoint {newest}"), \
        line
    assert f"resumed from {newest} at step {run['newest']}" in run["learner_log"].partition("restart 1 of learner")[2]


def test_the_restarted_learner_trains_every_step_once(learner_killed, up_killed):
    steps = _steps_logged(learner_killed["metrics"])
    assert steps == list(range(1, len(steps) + 1)), "a step was lost or repeated"


def test_killing_up_mid_step_leaves_no_process_and_no_shared_memory_of_the_run(up_killed):
    assert len(up_killed["leaders"]) == 3 and len(up_killed["pids"]) > 3, up_killed  # the engine's processes too
    assert up_killed["shm"], "the run mapped no /dev/shm segment: nothing was checked"
    assert not up_killed["left"], f"still running {up_killed['seconds']:.0f}s after up was killed: {up_killed}"
    assert not up_killed["shm_left"], f"left in /dev/shm: {up_killed['shm_left']}"
    assert up_killed["steps_after"] <= 1, "the learner trained on without up"  # 1: a step ending as `up` died
