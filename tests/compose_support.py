"""What the compose runs (tests/deploy/test_compose_*.py) share: the Docker checks, one compose project as a user
drives it (its command line, containers, health, metrics, the learner's control RPCs, a replica's Info), and the
check that `down -v` left nothing behind.

Each run is deploy/docker-compose.yml started with variables only (docs/deploy.md lists them); nothing here edits
the compose file.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from dgrpo.weights.shm import pid_alive

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
TOKEN_FILE = "/run/dgrpo-secrets/token"  # where the compose file's `token` service writes the stack's token


def docker_problem() -> str | None:
    """Why no compose run is possible here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (CI: .ci/run installs docker.io and starts dockerd when it runs as root)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          check=False)
    if info.returncode != 0:
        return f"no Docker daemon reachable ({info.stderr.strip().splitlines()[-1] if info.stderr.strip() else ''})"
    if compose_command() is None:
        return "no compose implementation (apt-get install docker-compose)"
    return None


OWNER_LABEL = "dgrpo-test-pid"
"""Label on the Docker objects a test run creates (the K8s runner's containers and networks): the creating pid.
Compose projects carry it in their name instead (dgrpo-test-<pid>-<hex>)."""


def _project_owner(project: str) -> str:
    parts = project.split("-")  # dgrpo-test-<pid>-<hex>
    return parts[2] if len(parts) == 4 and project.startswith("dgrpo-test-") else ""


def sweep_stale_test_objects() -> list[str]:
    """Remove the containers, networks and volumes a killed earlier test run left on this daemon: their restart
    policies (unless-stopped, a StatefulSet's Always) restart them with the daemon, and their restart loops take the
    cores this run needs. Only objects whose creating process is gone; returns what was removed."""
    labels = f'{{{{.Label "com.docker.compose.project"}}}}|{{{{.Label "{OWNER_LABEL}"}}}}'
    removed = []
    for kind, listing, ident, rm in (
            ("container", ["docker", "ps", "-a"], "{{.ID}}", ["docker", "rm", "-f"]),
            ("network", ["docker", "network", "ls"], "{{.ID}}", ["docker", "network", "rm"]),
            ("volume", ["docker", "volume", "ls"], "{{.Name}}", ["docker", "volume", "rm"])):
        out = run([*listing, "--format", f"{ident}|{labels}"], check=False).stdout
        stale = []
        for line in out.splitlines():
            name, project, pid = (line.split("|") + ["", ""])[:3]
            owner = pid.strip() or _project_owner(project.strip())
            if owner.isdigit() and not pid_alive(int(owner)):
                stale.append(name)
        if stale:
            run([*rm, *stale], timeout=300, check=False)
            removed += [f"{kind} {name}" for name in stale]
    return removed


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    return None


def run(args: list[str], *, env: dict | None = None, timeout: float = 300, check: bool = True,
        input_text: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, check=False, cwd=ROOT,
                          input=input_text)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def inspect(cid: str, template: str) -> str:
    return run(["docker", "inspect", "-f", template, cid]).stdout.strip()


def replicas(rec: dict) -> dict[str, float]:
    """A step's groups per replica id (its rollout/groups_by_replica/* metrics)."""
    prefix = "rollout/groups_by_replica/"
    return {k.removeprefix(prefix): v for k, v in rec.items() if k.startswith(prefix)}


class Stack:
    """One compose project of deploy/docker-compose.yml: its command line, its files on the host, and what it
    reports. `variables` are the documented DGRPO_* variables this run sets (the caller's own DGRPO_* and COMPOSE_*
    environment is dropped, so the run sees the file's defaults for everything else)."""

    def __init__(self, variables: dict[str, str], metrics_file: Path, token: str | None = None):
        """`token`: DGRPO_TOKEN for the run; None lets the stack make its own (read from a container when needed)."""
        from support import free_port

        self.project = f"dgrpo-test-{os.getpid()}-{secrets.token_hex(3)}"  # the pid: sweep_stale_test_objects
        self._token = token
        self.port = free_port()
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DGRPO_", "COMPOSE_"))},
                    **variables, "DGRPO_LEARNER_PORT": str(self.port), **({"DGRPO_TOKEN": token} if token else {})}
        self.compose = [*compose_command(), "-p", self.project, "-f", str(DEPLOY / "docker-compose.yml")]
        self.metrics_file = metrics_file
        self.shm_pidns = self.shm_mount = "unset"  # set by note_namespaces() once the stack runs
        self.timings: dict[str, float] = {}
        self.started, self.is_down = time.monotonic(), False

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.compose, *args], env=self.env, timeout=timeout, check=check)

    def containers(self, service: str, *, all_states: bool = False) -> list[str]:
        """Ids of the project's containers of `service` (running ones unless all_states)."""
        args = ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}",
                "--filter", f"label=com.docker.compose.service={service}"]
        return run([*args, *(["-a"] if all_states else [])]).stdout.split()

    def health(self, cid: str) -> str:
        out = run(["docker", "inspect", "-f", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
                   cid], check=False).stdout.split()
        return " ".join(out) or "gone"

    def wait_healthy(self, cids: list[str], timeout: float = 900) -> float:
        """Seconds until every container reports healthy (or, without a health check, running); fails naming the
        ones that did not."""
        start = time.monotonic()
        while True:
            states = {c[:12]: self.health(c) for c in cids}
            if all(s in ("running healthy", "running") for s in states.values()):
                return time.monotonic() - start
            assert not any(s.startswith(("exited", "dead", "gone")) for s in states.values()), states
            assert time.monotonic() - start < timeout, f"not healthy after {timeout:.0f} s: {states}"
            time.sleep(2)

    def up_healthy(self, services: tuple[str, ...]) -> dict[str, list[str]]:
        """`up -d` (the README's command, detached): one container per service in `services`, each healthy through
        its probe. Their ids by service."""
        self("up", "-d", timeout=900)
        cids = {s: self.containers(s) for s in services}
        assert all(len(c) == 1 for c in cids.values()), cids
        self.wait_healthy([c for ids in cids.values() for c in ids])
        return cids

    def wait_exit(self, cid: str, timeout: float = 600) -> int:
        """The container's exit code once it has stopped."""
        deadline = time.monotonic() + timeout
        while self.health(cid).startswith(("running", "restarting")):
            assert time.monotonic() < deadline, f"{cid[:12]} still running after {timeout:.0f} s"
            time.sleep(1)
        return int(inspect(cid, "{{.State.ExitCode}}"))

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

    @property
    def token(self) -> str:
        """The stack's token: the one given, else the one its `token` service wrote (as docs/deploy.md reads it)."""
        if self._token is None:
            self._token = run([*self.compose, "exec", "-T", "learner", "cat", TOKEN_FILE], env=self.env).stdout.strip()
        return self._token

    def learner_rpc(self, method: str, *, authenticated: bool = True, **fields):
        import grpc

        from dgrpo.v1 import learner_pb2, learner_pb2_grpc

        request = {"Status": learner_pb2.StatusRequest, "Stop": learner_pb2.StopRequest}[method](**fields)
        metadata = [("authorization", f"Bearer {self.token}")] if authenticated else None
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            return getattr(learner_pb2_grpc.LearnerStub(channel), method)(request, timeout=10, metadata=metadata)

    def wait_phase(self, phase: str, *, after_step: int, timeout: float = 600):
        """The learner's Status once it is in `phase` of a step after `after_step` (polled over the control RPC)."""
        import grpc

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = self.learner_rpc("Status")
            except grpc.RpcError:  # the control service is not up yet
                status = None
            if status is not None and status.phase == phase and status.step >= after_step:
                return status
            time.sleep(0.05)
        raise AssertionError(f"the learner was never in phase {phase!r} after step {after_step}")

    def sampler_info(self, cid: str) -> dict:
        """The replica's own Info (weight version, replica id), asked from inside its container (with the token)."""
        code = ("import grpc\nfrom dgrpo.v1 import sampler_pb2 as p, sampler_pb2_grpc as g\n"
                "c = grpc.insecure_channel('localhost:50051')\n"
                f"t = open('{TOKEN_FILE}').read().strip()\n"
                "i = g.SamplerStub(c).Info(p.InfoRequest(), timeout=10, metadata=[('authorization', 'Bearer ' + t)])\n"
                "print(i.weight_version, i.replica_id)")
        version, replica = run(["docker", "exec", cid, "python3", "-c", code]).stdout.split()
        return {"weight_version": int(version), "replica_id": replica}

    def bound_cores(self, cid: str) -> list[int]:
        """The cores a sampler container's engine bound its OpenMP threads to, as vLLM's CPU executor logged them
        (vllm/utils/ompmultiprocessing.py: "local_rank=0, core ids=[...]")."""
        out = run(["docker", "logs", cid])
        logs = out.stdout + out.stderr
        found = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", logs)
        assert found, f"{cid}: no OpenMP binding in its log\n{logs[-3000:]}"
        return [int(c) for c in found[-1].split(",") if c.strip()]

    def slots(self, cid: str) -> set[str]:
        """The weight-slot segments a container sees in its /dev/shm."""
        listing = run(["docker", "exec", cid, "ls", "/dev/shm"]).stdout.split()
        return {s for s in listing if s.startswith("dgrpo-w-")}

    def note_namespaces(self) -> str:
        """Remember the holder's PID namespace and /dev/shm mount (checked after `down -v`); returns the holder."""
        holder = self.containers("shm")[0]
        self.shm_pidns = run(["docker", "exec", self.containers("learner")[0], "readlink",
                              "/proc/1/ns/pid"]).stdout.strip()[5:-1]
        root = run(["docker", "info", "--format", "{{.DockerRootDir}}"]).stdout.strip()
        self.shm_mount = f"{root}/containers/{holder}/mounts/shm"
        return holder

    def down_and_check_nothing_left(self) -> None:
        down = self("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300, check=False)
        assert down.returncode == 0, down.stderr
        label = f"label=com.docker.compose.project={self.project}"
        for kind in ("ps -a", "network ls", "volume ls"):
            left = run(["docker", *kind.split(), "-q", "--filter", label]).stdout.split()
            assert not left, f"`down -v` left {kind.split()[0]} objects: {left}"
        # The weight slots lived in the holder's IPC namespace (its own /dev/shm tmpfs, shared by learner and
        # samplers): that mount is gone, and no segment named after the stack's PID namespace reached the host's.
        if self.shm_mount != "unset":
            assert self.shm_mount not in Path("/proc/self/mounts").read_text(), f"{self.shm_mount} is still mounted"
            assert not Path(self.shm_mount).exists(), f"{self.shm_mount} is still there"
        leaked = [n for n in os.listdir("/dev/shm") if self.shm_pidns in n]
        assert not leaked, f"the host's /dev/shm holds the stack's segments {leaked}"

    @contextmanager
    def phase(self, name: str):
        """One phase of a phased run (a module-scoped fixture whose tests each check one property of it): timed
        into `timings`; on failure the containers' logs are printed, as the fixture's error is all pytest shows."""
        t = time.monotonic()
        try:
            yield
        except BaseException:
            logs = self("logs", "--no-color", "--tail", "150", timeout=120, check=False)
            print(logs.stdout[-30000:], file=sys.stderr)
            raise
        finally:
            self.timings[name] = time.monotonic() - t

    def down(self, label: str) -> None:
        """`down -v`, once (the last phase or the run fixture's teardown), checking that nothing is left; prints
        the phases' timings under `label`."""
        if self.is_down:
            return
        self.is_down = True
        try:
            self.down_and_check_nothing_left()
        finally:
            self.timings["total"] = time.monotonic() - self.started
            print(f"\n[{label}] timings (s): {json.dumps({k: round(v, 1) for k, v in self.timings.items()})}")
