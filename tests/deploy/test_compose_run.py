"""`docker compose up` for real: the CPU images, two then three then one sampler replicas, a killed sampler, both
reward hot swaps, the learner stopped from the host, and `down -v` leaving nothing behind.

One run of deploy/docker-compose.yml as a user starts it (only variables and a config file of our own: the tiny
model instead of SmolLM2 so that three vLLM replicas and the learner fit on 2 cores, long completions so a step
spends seconds sampling, no step limit: the test stops the learner). Every claim is read from what the stack
reports: Docker's health status (the gRPC health probe), the learner's metrics.jsonl (groups per replica, retried
prompts, reward spec version and functions per step), the learner's Status RPC, a sampler's Info RPC.

Needs a Docker daemon (.ci/run starts one when it can). Without one the test is skipped with the reason printed;
the images are built by deploy/build.sh (cached: a warm build takes seconds).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BATCH = 8  # prompts per step: every step must get exactly this many groups, whatever happens to the samplers
RUN_NAME = "compose_test"


def _docker_problem() -> str | None:
    """Why no compose run is possible here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (CI: .ci/run installs docker.io and starts dockerd when it runs as root)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          check=False)
    if info.returncode != 0:
        return f"no Docker daemon reachable ({info.stderr.strip().splitlines()[-1] if info.stderr.strip() else ''})"
    if _compose() is None:
        return "no compose implementation (apt-get install docker-compose)"
    return None


def _compose() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    return None


def _run(args: list[str], *, env: dict | None = None, timeout: float = 300, check: bool = True,
         input_text: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=ROOT,
                          input=input_text)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """One compose project: its command line, its files on the host, and what it reports."""

    def __init__(self, tmp: Path, tiny_model: Path):
        self.project = f"dgrpo-test-{secrets.token_hex(3)}"
        self.token = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.configs, self.rewards, self.runs = tmp / "configs", tmp / "rewards", tmp / "runs"
        self.configs.mkdir()
        self.runs.mkdir()
        shutil.copytree(DEPLOY / "rewards", self.rewards)
        shutil.copytree(tiny_model, self.configs / "tiny-model")
        config = yaml.safe_load((ROOT / "configs" / "cpu-demo.yaml").read_text())
        config["model"] = {"path": "/opt/dgrpo/configs/tiny-model", "dtype": "bfloat16"}
        config["sampler"].update(max_model_len=512, max_num_seqs=32, cpu_cores="all")
        learner = config["learner"]
        learner["data"]["train_batch_size"] = BATCH
        learner["rollout"].update(n=4, max_response_length=256)
        learner["actor"].update(max_tokens_per_micro_batch=4096)
        learner["checkpoint"].update(save_freq=0, export_dir=None)
        learner["trainer"].update(total_training_steps=100_000, test_freq=0, val_before_train=False,
                                  run_name=RUN_NAME, loggers=["console", "jsonl"])
        (self.configs / "test.yaml").write_text(yaml.safe_dump(config))
        from dgrpo.cli.stack import StackConfig
        from dgrpo.common.config import load_config

        load_config(StackConfig, self.configs / "test.yaml", [])  # a bad key fails here, not in a crash-looping container
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DGRPO_", "COMPOSE_"))},
                    "DGRPO_CONFIG": "test.yaml", "DGRPO_CONFIG_DIR": str(self.configs),
                    "DGRPO_REWARDS_DIR": str(self.rewards), "DGRPO_RUNS_DIR": str(self.runs),
                    "DGRPO_TOKEN": self.token, "DGRPO_LEARNER_PORT": str(self.port), "DGRPO_SHM_SIZE": "512mb"}
        self.compose = [*_compose(), "-p", self.project, "-f", str(DEPLOY / "docker-compose.yml")]
        self.metrics_file = self.runs / RUN_NAME / "metrics.jsonl"
        self.learner_pidns = self.learner_shm = "unset"  # set once the learner runs

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.compose, *args], env=self.env, timeout=timeout, check=check)

    def containers(self, service: str, *, all_states: bool = False) -> list[str]:
        """Ids of the project's containers of `service` (running ones unless all_states)."""
        args = ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}"]
        return _run([*args, *(["-a"] if all_states else [])]).stdout.split()

    def health(self, cid: str) -> str:
        out = _run(["docker", "inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                    cid], check=False).stdout.split()
        return " ".join(out) or "gone"

    def wait_healthy(self, cids: list[str], timeout: float = 900) -> float:
        """Seconds until every container reports healthy; fails naming the ones that did not."""
        start = time.monotonic()
        while True:
            states = {c[:12]: self.health(c) for c in cids}
            if all(s == "running healthy" for s in states.values()):
                return time.monotonic() - start
            assert not any(s.startswith(("exited", "dead", "gone")) for s in states.values()), states
            assert time.monotonic() - start < timeout, f"not healthy after {timeout:.0f} s: {states}"
            time.sleep(2)

    def steps(self) -> list[dict]:
        if not self.metrics_file.exists():
            return []
        return [json.loads(line) for line in self.metrics_file.read_text().splitlines() if line.strip()]

    def wait_step(self, predicate, what: str, timeout: float = 600, after: int = 0) -> dict:
        """The first logged step after step `after` that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.steps():
                if rec["step"] > after and predicate(rec):
                    return rec
            time.sleep(1)
        raise AssertionError(f"no step after {after} {what} within {timeout:.0f} s; last: {self.steps()[-1:]}")

    def learner_rpc(self, method: str, **fields):
        import grpc

        from dgrpo.v1 import learner_pb2, learner_pb2_grpc

        request = {"Status": learner_pb2.StatusRequest, "Stop": learner_pb2.StopRequest}[method](**fields)
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            call = getattr(learner_pb2_grpc.LearnerStub(channel), method)
            return call(request, timeout=10, metadata=[("authorization", f"Bearer {self.token}")])

    def sampler_info(self, cid: str) -> dict:
        """The replica's own Info (weight version, replica id), asked from inside its container with its token."""
        code = ("import os, grpc\nfrom dgrpo.v1 import sampler_pb2 as p, sampler_pb2_grpc as g\n"
                "c = grpc.insecure_channel('localhost:50051')\n"
                "i = g.SamplerStub(c).Info(p.InfoRequest(), timeout=10, "
                "metadata=[('authorization', 'Bearer ' + os.environ['DGRPO_TOKEN'])])\n"
                "print(i.weight_version, i.replica_id)")
        version, replica = _run(["docker", "exec", cid, "python3", "-c", code]).stdout.split()
        return {"weight_version": int(version), "replica_id": replica}


def replicas(rec: dict) -> dict[str, float]:
    prefix = "rollout/groups_by_replica/"
    return {k.removeprefix(prefix): v for k, v in rec.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def docker_ready():
    problem = _docker_problem()
    if problem:
        print(f"\n[test_compose_run] SKIPPED, no compose run: {problem}", file=sys.stderr)
        pytest.skip(problem)
    build = _run(["bash", str(DEPLOY / "build.sh"), "cpu"], timeout=5400)
    print("\n".join(line for line in build.stdout.splitlines() if line.startswith("[build]")))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_up_scaled_with_faults(docker_ready, tiny_model, tmp_path):
    stack = Stack(tmp_path, tiny_model)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        _phases(stack, timings)
    except BaseException:
        logs = stack("logs", "--no-color", "--tail", "150", timeout=120, check=False)
        print(logs.stdout[-30000:], file=sys.stderr)
        raise
    finally:
        down = stack("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
        timings["total"] = time.monotonic() - t0
        print(f"\n[test_compose_run] timings (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    assert down.returncode == 0, down.stderr
    label = f"label=com.docker.compose.project={stack.project}"
    for kind in ("ps -a", "network ls", "volume ls"):
        left = _run(["docker", *kind.split(), "-q", "--filter", label]).stdout.split()
        assert not left, f"`down -v` left {kind.split()[0]} objects: {left}"
    # The weight slots lived in the learner's IPC namespace (its own /dev/shm tmpfs, shared by the samplers): that
    # mount is gone, and no segment named after the stack's PID namespace reached the host's /dev/shm.
    assert stack.learner_shm not in Path("/proc/self/mounts").read_text(), f"{stack.learner_shm} is still mounted"
    assert not Path(stack.learner_shm).exists(), f"{stack.learner_shm} is still there"
    leaked = [n for n in os.listdir("/dev/shm") if stack.learner_pidns in n]
    assert not leaked, f"the host's /dev/shm holds the stack's segments {leaked}"


def _phases(stack: Stack, timings: dict[str, float]) -> None:
    t = time.monotonic()
    # 1. Two replicas; every container healthy through the gRPC probe; both replicas serve groups.
    stack("up", "-d", "--scale", "sampler=2", timeout=900)
    cids = {s: stack.containers(s) for s in ("rewarder", "learner", "sampler")}
    assert len(cids["sampler"]) == 2 and len(cids["learner"]) == 1 and len(cids["rewarder"]) == 1, cids
    stack.wait_healthy([c for ids in cids.values() for c in ids])
    timings["healthy_2_replicas"] = time.monotonic() - t
    two = stack.wait_step(lambda r: len(replicas(r)) == 2, "with groups from both replicas")
    timings["first_step_on_2"] = time.monotonic() - t
    # The learner's /dev/shm (what every sampler maps) holds the weight slots, named with its PID namespace.
    learner = cids["learner"][0]
    stack.learner_pidns = _run(["docker", "exec", learner, "readlink", "/proc/1/ns/pid"]).stdout.strip()[5:-1]
    root = _run(["docker", "info", "--format", "{{.DockerRootDir}}"]).stdout.strip()
    stack.learner_shm = f"{root}/containers/{learner}/mounts/shm"
    def slots(cid: str) -> set[str]:
        return {s for s in _run(["docker", "exec", cid, "ls", "/dev/shm"]).stdout.split() if s.startswith("dgrpo-w-")}

    assert slots(learner) and all(stack.learner_pidns in s for s in slots(learner)), slots(learner)
    for sampler in cids["sampler"]:
        assert slots(sampler) == slots(learner), f"sampler {sampler[:12]} does not see the learner's /dev/shm"

    # 2. Scale to 3 while training: the new replica holds the latest weights when it turns healthy, then serves.
    version_before = stack.learner_rpc("Status").weight_version
    assert version_before >= 1, "the learner has published no weights yet"
    stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=3", "sampler", timeout=600)
    new = [c for c in stack.containers("sampler") if c not in cids["sampler"]]
    assert len(new) == 1, new
    t = time.monotonic()
    stack.wait_healthy(new)
    info = stack.sampler_info(new[0])
    timings["third_replica_healthy"] = time.monotonic() - t
    assert info["weight_version"] >= version_before, (info, version_before)
    three = stack.wait_step(lambda r: info["replica_id"] in replicas(r), "with groups from the new replica",
                            after=two["step"])
    assert len(replicas(three)) >= 2
    timings["third_replica_serving"] = time.monotonic() - t
    t = time.monotonic()

    # 3. Kill a sampler while the learner samples: its prompts are retried elsewhere, training goes on. The victim
    # is the newest replica, the one `--scale sampler=1` removes (a stopped survivor would be started again).
    victim = new[0]
    deadline = time.monotonic() + 300
    while stack.learner_rpc("Status").phase != "sampling":
        assert time.monotonic() < deadline, "the learner never entered its sampling phase"
        time.sleep(0.05)
    killed_during = stack.learner_rpc("Status").step + 1
    _run(["docker", "kill", victim])
    hit = stack.wait_step(lambda r: r["rollout/failed_calls"] > 0 or r["rollout/retried_prompts"] > 0,
                          "that saw the killed replica's stream fail", after=killed_during - 1, timeout=300)
    assert hit["step"] == killed_during, f"the kill during step {killed_during} showed up in step {hit['step']}"
    stack.wait_step(lambda r: True, "after the kill", after=hit["step"] + 1)

    timings["kill_and_recovery"] = time.monotonic() - t
    t = time.monotonic()

    # 4. Scale down to one replica.
    stack("up", "-d", "--no-deps", "--no-recreate", "--scale", "sampler=1", "sampler", timeout=600)
    left = stack.containers("sampler")
    assert len(left) == 1, left
    one = stack.wait_step(lambda r: len(replicas(r)) == 1, "on one replica", after=stack.steps()[-1]["step"])

    timings["scale_to_1"] = time.monotonic() - t
    t = time.monotonic()

    # 5a. Reward hot swap in place: edit the spec file, SIGHUP the rewarder; the spec version steps up.
    first_version = one["reward/spec_version_max"]
    spec = yaml.safe_load((stack.rewards / "spec.yaml").read_text())
    spec["name"] = "math-v2"
    (stack.rewards / "spec.yaml").write_text(yaml.safe_dump(spec))
    stack("kill", "-s", "SIGHUP", "rewarder")
    reloaded = stack.wait_step(lambda r: r["reward/spec_version_min"] > first_version, "scored by the reloaded spec",
                               after=one["step"])

    timings["reload_in_place"] = time.monotonic() - t
    t = time.monotonic()

    # 5b. A second rewarder, then retire the first: steps are scored by spec-next (its `brevity` function).
    stack("--profile", "swap", "up", "-d", "--no-deps", "rewarder-next", timeout=600)
    stack.wait_healthy(stack.containers("rewarder-next"), timeout=300)
    stack("stop", "rewarder", timeout=120)
    swapped = stack.wait_step(lambda r: "reward/fn/brevity" in r, "scored by rewarder-next", after=reloaded["step"])
    stack.wait_step(lambda r: True, "after the swap", after=swapped["step"])

    timings["second_rewarder"] = time.monotonic() - t
    t = time.monotonic()

    # Every step so far: consecutive, exactly BATCH groups, none duplicated into training.
    steps = stack.steps()
    print(f"\n[test_compose_run] kill in step {hit['step']}: {hit['rollout/failed_calls']:.0f} failed calls, "
          f"{hit['rollout/retried_prompts']:.0f} prompts retried, groups {replicas(hit)}; spec version "
          f"{first_version:.0f} -> {reloaded['reward/spec_version_min']:.0f} at step {reloaded['step']} (SIGHUP), "
          f"rewarder-next from step {swapped['step']} (version {swapped['reward/spec_version_max']:.0f}); "
          f"{len(steps)} steps, {sum(r['rollout/duplicates_dropped'] for r in steps):.0f} duplicates dropped")
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "a step failed or was skipped"
    for r in steps:
        assert sum(replicas(r).values()) == BATCH, f"step {r['step']} trained on {replicas(r)} groups"

    # 6. Stop through the control RPC from the host; the learner exits 0 and stays down.
    t = time.monotonic()
    last = stack.learner_rpc("Stop", reason="compose test").stopping_after_step
    learner = stack.containers("learner")[0]
    deadline = time.monotonic() + 300
    while stack.health(learner).startswith("running"):
        assert time.monotonic() < deadline, "the learner did not stop"
        time.sleep(1)
    code = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", learner]).stdout.strip()
    assert code == "0", f"the learner exited {code}"
    assert stack.steps()[-1]["step"] == last
    timings["stop_rpc_to_exit"] = time.monotonic() - t
