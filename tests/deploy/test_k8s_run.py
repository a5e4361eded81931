"""The Kubernetes manifests' pod specs, run for real: deploy/k8s/overlays/cpu rendered by kustomize, then
every container it describes started with Docker as a kubelet would start it, training for a few steps.

No cluster can start here (no node images can be fetched), so `PodRunner` below plays the kubelet's part for the
fields the manifests use, and refuses any field it does not know rather than skipping it:

- image, command / args (command replaces the image's entrypoint, as in Kubernetes; `$(VAR)` expanded from the
  container's env), env (values, the Secret's keys, the pod's own name and address from the downward API), the pod
  name as hostname, a pod address fixed before its containers start (as the CNI assigns it);
- the Services: each pod joins one user-defined network (`--internal`: nothing outside it is reachable, as the
  NetworkPolicies want) under the names of the Services that select it (the headless `sampler` Service's name is
  shared by every sampler pod, so dns:///sampler:50051 resolves to every replica, as CoreDNS answers for a headless
  Service); a Service port must equal the container port it targets, since Docker cannot remap;
- volumes: ConfigMaps and the Secret as folders in the kubelet's layout (files are symlinks through `..data` into a
  timestamped folder, swapped atomically on update: what the rewarder's hot swap has to cope with), emptyDirs as
  host folders shared by the pod's containers (`medium: Memory` at /dev/shm as the container's shm of `sizeLimit`),
  a StatefulSet's volumeClaimTemplates as one host folder per pod (`<template>-<pod>`, kept across restarts),
  hostPath as a bind mount;
- securityContext: runAsUser / runAsGroup / fsGroup, readOnlyRootFilesystem, dropped capabilities,
  allowPrivilegeEscalation=false (no-new-privileges); resources: limits as --cpus (at most this machine's cores) and
  --memory, requests as CPU shares; restartPolicy (Always: StatefulSets and Deployments allow nothing else);
- init containers run to completion first, on the same volumes;
- probes: the `grpc:` probes are asked from another container on the network, at the pod's address and the
  probe's port (as the kubelet asks: a server bound to loopback only would fail here), by the image's own
  deploy/healthcheck.py; the startup probe must pass within its failureThreshold x periodSeconds, and the liveness
  probe may never fail failureThreshold times in a row afterwards.

The test (cpu overlay with a config of its own: the tiny 2-layer model from a hostPath instead of SmolLM2, so two
vLLM replicas and the learner fit on 2 cores, and one sampler pod to start; no step limit: the test stops the
learner) checks: every pod becomes healthy through its probes; 2 steps train on the first sampler pod, every version
sent to its relay over its torch.distributed group (weights.transport=collective); a second sampler pod (`kubectl
scale statefulset/sampler --replicas=2`) joins with a group of its own, serves the latest weights when ready and
serves groups next to the first; 2 more steps; the reward spec hot-swapped as docs/kubernetes.md says (replace the
ConfigMap, then `kubectl exec deploy/rewarder -- sh -c 'kill -HUP 1'`); a SIGKILLed learner is restarted and
resumes from its checkpoint on its claim; nothing in any container listens on a non-loopback port beyond its
declared containerPorts and, in learner and samplers, the weight groups' ephemeral ports; the control RPC's Stop ends
the run and the learner stays up (Status: stopped), and a restart of its container trains nothing.

The run is a chain of module-scoped phase fixtures (`pods` -> `two_steps` -> `scaled_up` -> `reward_swapped` ->
`learner_crashed` -> `stopped` -> `stopped_restarted`), each keeping what it saw; every test checks one property of
one phase, so a broken property is named by its test and the others are still checked.

Needs a Docker daemon and kustomize (kubectl's or standalone); skipped, saying why, without either. The image is
built with deploy/build.sh like tests/deploy/test_compose_run.py (cached); DGRPO_TEST_IMAGE=IMAGE uses an
existing image instead of building.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from compose_support import OWNER_LABEL, sweep_stale_test_objects
from k8s_support import MISSING, kustomize_command, render

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "cpu"
BATCH = 8
RUN_NAME = "k8s_test"
PREFIX = "dgrpo-k8s-"


def _run(args: list[str], *, timeout: float = 300, check: bool = True, input_text: str | None = None):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, input=input_text)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


def _problem() -> str | None:
    if kustomize_command() is None:
        return MISSING
    if shutil.which("docker") is None:
        return "no docker CLI (CI: .ci/run installs docker.io and starts dockerd when it runs as root)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          check=False)
    if info.returncode != 0:
        return f"no Docker daemon reachable ({(info.stderr.strip().splitlines() or [''])[-1]})"
    return None


# --- Kubernetes quantities ------------------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def memory_bytes(q: str | int) -> int:
    q = str(q)
    for suffix, mult in {**_BINARY, **_DECIMAL}.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * mult)
    return int(q)


def cpu_cores(q: str | float) -> float:
    q = str(q)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


# --- the kubelet's part -------------------------------------------------------------------------------------------


def write_atomic_dir(folder: Path, files: dict[str, str], mode: int, gid: int = 0) -> None:
    """ConfigMap / Secret files as the kubelet writes them: `..<time>/<key>`, `..data -> ..<time>`,
    `<key> -> ..data/<key>`; an update writes a new timestamped folder and swaps `..data` atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    stamp = folder / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{secrets.token_hex(4)}"
    stamp.mkdir()
    os.chmod(stamp, 0o755)
    for key, text in files.items():
        (stamp / key).write_text(text)
        os.chown(stamp / key, 0, gid)
        os.chmod(stamp / key, mode)
    old = os.readlink(folder / "..data") if (folder / "..data").is_symlink() else None
    tmp = folder / "..data_tmp"
    os.symlink(stamp.name, tmp)
    os.replace(tmp, folder / "..data")
    for key in files:
        if not (folder / key).is_symlink():
            os.symlink(f"..data/{key}", folder / key)
    if old:
        shutil.rmtree(folder / old)


class Pod:
    def __init__(self, name: str, owner: dict, spec: dict, labels: dict):
        self.name, self.owner, self.spec, self.labels = name, owner, spec, labels
        self.containers: dict[str, str] = {}  # container name -> docker container name
        self.started_at = 0.0
        self.ip = ""
        self.started = False  # the startup probe passed: liveness and readiness probes run from then on
        self.expected_down = False

    @property
    def main(self) -> dict:
        return self.spec["containers"][0]

    def docker_name(self, container: str | None = None) -> str:
        return self.containers[container or self.main["name"]]


class PodRunner:
    """Runs rendered pod templates as Docker containers on one network (see the module docstring)."""

    def __init__(self, objects: list[dict], tmp: Path, image: str | None, secrets_: dict[str, dict[str, str]],
                 host_paths: dict[str, Path]):
        self.objects = objects
        self.tmp = tmp
        self.image = image
        self.secrets = secrets_
        self.host_paths = host_paths
        self.id = secrets.token_hex(3)
        self.network = f"{PREFIX}{self.id}"
        self.label = f"dgrpo-k8s-test={self.id}"
        self.owner_label = f"{OWNER_LABEL}={os.getpid()}"  # what a killed run leaves: sweep_stale_test_objects
        self.subnet: ipaddress.IPv4Network | None = None
        self.addresses = 0  # pod addresses handed out (from the lower half of the subnet; Docker's own: the upper)
        self.pods: dict[str, Pod] = {}
        self.pvcs: dict[str, Path] = {}
        self.nproc = os.cpu_count() or 1
        self.prober = f"{PREFIX}{self.id}-kubelet"
        self.probe_dir = tmp / "probe"
        self.configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        self.services = [o for o in objects if o["kind"] == "Service"]
        self.lock = threading.Lock()
        self.liveness_failures: dict[str, float] = {}  # pod -> longest run of failing liveness probes (s)
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    # objects -------------------------------------------------------------------------------------------------
    def workload(self, kind: str, name: str) -> dict:
        found = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]

    def image_of(self, container: dict) -> str:
        return self.image or container["image"]

    # lifecycle -----------------------------------------------------------------------------------------------
    def start_network(self) -> None:
        for _ in range(20):  # a private /24 no other Docker network uses
            subnet = ipaddress.ip_network(f"10.{secrets.choice(range(200, 250))}.{secrets.randbelow(256)}.0/24")
            upper = list(subnet.subnets())[1]
            proc = _run(["docker", "network", "create", "--internal", "--label", self.label,
                         "--label", self.owner_label, "--subnet", str(subnet), "--ip-range", str(upper),
                         self.network], check=False)
            if proc.returncode == 0:
                self.subnet = subnet
                break
        assert self.subnet is not None, f"no free subnet for {self.network}: {proc.stderr}"
        self.probe_dir.mkdir()
        os.chmod(self.probe_dir, 0o777)
        image = self.image_of(self.workload("Deployment", "rewarder")["spec"]["template"]["spec"]["containers"][0])
        _run(["docker", "run", "-d", "--name", self.prober, "--label", self.label, "--label", self.owner_label,
              "--network", self.network, "--user", "10001:10001", "--read-only", "--cap-drop", "ALL",
              "-v", f"{self.probe_dir}:/probe",
              "--entrypoint", "sleep", image, "infinity"])

    def start_pod(self, kind: str, name: str, ordinal: int | None = None) -> Pod:
        obj = self.workload(kind, name)
        template = obj["spec"]["template"]
        pod_name = f"{name}-{ordinal}" if ordinal is not None else f"{name}-{secrets.token_hex(3)[:5]}"
        pod = Pod(pod_name, obj, template["spec"], template["metadata"].get("labels", {}))
        emulated = {"containers", "initContainers", "volumes", "securityContext", "restartPolicy",
                    "terminationGracePeriodSeconds", "enableServiceLinks",
                    # what only a cluster acts on: API access, placement
                    "serviceAccountName", "automountServiceAccountToken", "tolerations", "topologySpreadConstraints"}
        assert set(pod.spec) <= emulated, f"{pod_name}: pod fields not emulated: {set(pod.spec) - emulated}"
        assert pod.spec.get("automountServiceAccountToken") is False, "the runner mounts no API token either"
        self.pods[pod_name] = pod
        self.addresses += 1
        pod.ip = str(self.subnet[10 + self.addresses])  # known before start: the downward API's status.podIP
        volumes = self._volumes(pod)
        for init in pod.spec.get("initContainers", []):
            args = self._docker_args(pod, init, volumes, detach=False)
            _run(args, timeout=300)
        pod.started_at = time.monotonic()
        for c in pod.spec["containers"]:
            _run(self._docker_args(pod, c, volumes, detach=True))
        address = f"{{{{(index .NetworkSettings.Networks \"{self.network}\").IPAddress}}}}"
        seen = _run(["docker", "inspect", "-f", address, pod.docker_name()]).stdout.strip()
        assert seen == pod.ip, f"{pod_name} has address {seen!r} on {self.network}, not {pod.ip}"
        return pod

    def stop_pod(self, pod: Pod, grace: float | None = None) -> None:
        pod.expected_down = True
        grace = pod.spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace
        for cname in pod.containers.values():
            _run(["docker", "stop", "-t", str(int(grace)), cname], timeout=grace + 60, check=False)

    def cleanup(self) -> None:
        self._stop.set()
        if self._monitor:
            self._monitor.join(timeout=30)
        ids = _run(["docker", "ps", "-aq", "--filter", f"label={self.label}"], check=False).stdout.split()
        if ids:
            _run(["docker", "rm", "-f", *ids], timeout=300, check=False)
        _run(["docker", "network", "rm", self.network], check=False)

    def logs(self, tail: int = 60) -> str:
        out = []
        for pod in self.pods.values():
            for cname in pod.containers.values():
                proc = _run(["docker", "logs", "--tail", str(tail), cname], check=False)
                out.append(f"----- {cname}\n{proc.stdout[-6000:]}{proc.stderr[-6000:]}")
        return "\n".join(out)

    # translation ---------------------------------------------------------------------------------------------
    def _volumes(self, pod: Pod) -> dict[str, dict]:
        """volume name -> {"kind", "path" (host), "size"} for the pod; files written as the kubelet would."""
        sec = pod.spec.get("securityContext", {})
        fs_group = sec.get("fsGroup", 0)
        out: dict[str, dict] = {}
        base = self.tmp / "pods" / pod.name
        for vol in pod.spec.get("volumes", []):
            name = vol["name"]
            kinds = set(vol) - {"name"}
            assert len(kinds) == 1, vol
            kind = kinds.pop()
            if kind == "configMap":
                cm = self.configmaps[vol["configMap"]["name"]]
                path = self.tmp / "configmaps" / cm["metadata"]["name"]
                if not path.exists():
                    write_atomic_dir(path, cm["data"], vol["configMap"].get("defaultMode", 0o644))
                out[name] = {"kind": kind, "path": path}
            elif kind == "secret":
                src = self.secrets[vol["secret"]["secretName"]]
                items = vol["secret"].get("items") or [{"key": k, "path": k} for k in src]
                path = base / "secrets" / name
                write_atomic_dir(path, {i["path"]: src[i["key"]] for i in items},
                                 vol["secret"].get("defaultMode", 0o644), gid=fs_group)
                out[name] = {"kind": kind, "path": path}
            elif kind == "emptyDir":
                ed = vol["emptyDir"] or {}
                if ed.get("medium") == "Memory":
                    out[name] = {"kind": "shm", "size": memory_bytes(ed["sizeLimit"])}
                else:
                    path = base / "emptydir" / name
                    path.mkdir(parents=True)
                    os.chmod(path, 0o1777)
                    out[name] = {"kind": kind, "path": path}
            elif kind == "persistentVolumeClaim":
                claim = vol["persistentVolumeClaim"]["claimName"]
                assert any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim
                           for o in self.objects), f"claim {claim} is not among the manifests"
                out[name] = {"kind": kind, "path": self._claim(claim, fs_group)}
            elif kind == "hostPath":
                out[name] = {"kind": kind, "path": self.host_paths[vol["hostPath"]["path"]]}
            else:
                raise AssertionError(f"volume kind {kind} is not emulated")
        for template in pod.owner["spec"].get("volumeClaimTemplates", []):  # the claim <template>-<pod>, kept
            name = template["metadata"]["name"]
            assert name not in out, f"{pod.name}: volume {name} is both a volume and a claim template"
            out[name] = {"kind": "persistentVolumeClaim", "path": self._claim(f"{name}-{pod.name}", fs_group)}
        return out

    def _claim(self, claim: str, fs_group: int) -> Path:
        path = self.pvcs.setdefault(claim, self.tmp / "pvc" / claim)
        if not path.exists():
            path.mkdir(parents=True)
            os.chown(path, 0, fs_group)
            os.chmod(path, 0o2775)
        return path

    def _aliases(self, pod: Pod) -> list[str]:
        names = []
        for svc in self.services:
            sel = svc["spec"].get("selector") or {}
            if sel and all(pod.labels.get(k) == v for k, v in sel.items()):
                names.append(svc["metadata"]["name"])
                for port in svc["spec"]["ports"]:  # Docker cannot remap: the Service port must be the container's
                    target = port.get("targetPort", port["port"])
                    numbers = [p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])
                               if target in (p.get("name"), p["containerPort"])]
                    assert numbers == [port["port"]], (svc["metadata"]["name"], port, numbers)
        service_name = pod.owner["spec"].get("serviceName")
        if service_name:
            names.append(f"{pod.name}.{service_name}")
        return names

    def _env(self, pod: Pod, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
                continue
            src = e["valueFrom"]
            if "secretKeyRef" in src:
                env[e["name"]] = self.secrets[src["secretKeyRef"]["name"]][src["secretKeyRef"]["key"]]
            elif "fieldRef" in src and src["fieldRef"]["fieldPath"] == "metadata.name":
                env[e["name"]] = pod.name
            elif "fieldRef" in src and src["fieldRef"]["fieldPath"] == "status.podIP":
                env[e["name"]] = pod.ip
            else:
                raise AssertionError(f"env source {src} is not emulated")
        assert "envFrom" not in container, "envFrom is not emulated"
        return env

    def _docker_args(self, pod: Pod, c: dict, volumes: dict[str, dict], *, detach: bool) -> list[str]:
        known = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "resources",
                 "securityContext", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe"}
        assert set(c) <= known, f"{pod.name}/{c['name']}: fields not emulated: {set(c) - known}"
        cname = f"{PREFIX}{self.id}-{pod.name}-{c['name']}"
        args = ["docker", "run", "--name", cname, "--label", self.label, "--label", self.owner_label,
                "--hostname", pod.name, "--network", self.network]
        if detach:
            pod.containers[c["name"]] = cname
            args += ["-d", "--ip", pod.ip]
            for alias in self._aliases(pod):
                args += ["--network-alias", alias]
            policy = pod.spec.get("restartPolicy", "Always")
            args += ["--restart", {"Always": "always", "OnFailure": "on-failure", "Never": "no"}[policy]]
        else:
            args += ["--rm"]
        psec = pod.spec.get("securityContext", {})
        csec = c.get("securityContext", {})
        uid = csec.get("runAsUser", psec.get("runAsUser"))
        gid = csec.get("runAsGroup", psec.get("runAsGroup"))
        if uid is not None:
            args += ["--user", f"{uid}:{gid if gid is not None else 0}"]
        if psec.get("runAsNonRoot") or csec.get("runAsNonRoot"):
            assert uid not in (None, 0), f"{pod.name}: runAsNonRoot without a non-zero runAsUser"
        if psec.get("fsGroup") is not None:
            args += ["--group-add", str(psec["fsGroup"])]
        if csec.get("readOnlyRootFilesystem"):
            args += ["--read-only"]
        for cap in csec.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        for cap in csec.get("capabilities", {}).get("add", []):
            args += ["--cap-add", cap]
        if csec.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        assert not csec.get("privileged"), f"{pod.name}: privileged"
        res = c.get("resources", {})
        limits, requests = res.get("limits", {}), res.get("requests", {})
        if "cpu" in limits:
            args += ["--cpus", f"{min(cpu_cores(limits['cpu']), self.nproc):g}"]
        if "memory" in limits:
            args += ["--memory", str(memory_bytes(limits["memory"])), "--memory-swap",
                     str(memory_bytes(limits["memory"]))]
        if "cpu" in requests:
            args += ["--cpu-shares", str(max(2, int(cpu_cores(requests["cpu"]) * 1024)))]
        env = self._env(pod, c)
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        for m in c.get("volumeMounts", []):
            vol = volumes[m["name"]]
            assert "subPath" not in m, "subPath mounts are not emulated (and would never see ConfigMap updates)"
            if vol["kind"] == "shm":
                assert m["mountPath"] == "/dev/shm", f"memory emptyDir at {m['mountPath']} is not emulated"
                args += ["--shm-size", str(vol["size"])]
                continue
            ro = m.get("readOnly") or vol["kind"] in ("configMap", "secret")
            args += ["-v", f"{vol['path']}:{m['mountPath']}{':ro' if ro else ''}"]
        command = c.get("command")
        if command:
            args += ["--entrypoint", command[0]]
        args += [self.image_of(c)]
        # $(VAR) in command and args: the container's env, as the kubelet expands it (an unknown one stays literal)
        args += [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                 for a in [*(command[1:] if command else []), *c.get("args", [])]]
        return args

    # probes ----------------------------------------------------------------------------------------------------
    def probe(self, pod: Pod, kind: str) -> tuple[bool, str]:
        """One probe of the pod's main container: `grpc:` from the kubelet container at the pod's address, `exec:`
        inside the container (as the kubelet runs both)."""
        spec = pod.main[kind]
        assert set(spec) - {"grpc", "exec", "periodSeconds", "timeoutSeconds", "failureThreshold",
                            "initialDelaySeconds", "successThreshold"} == set(), spec
        if "exec" in spec:
            proc = _run(["docker", "exec", pod.docker_name(), *spec["exec"]["command"]], check=False,
                        timeout=spec.get("timeoutSeconds", 1) + 30)
            return proc.returncode == 0, (proc.stdout + proc.stderr).strip()[-300:]
        target = f"{pod.ip}:{spec['grpc']['port']}"
        code = ("import sys; sys.path.insert(0, '/opt/dgrpo/deploy'); from healthcheck import check\n"
                f"ok, seen = check({target!r}, {spec['grpc'].get('service', '')!r}, "
                f"timeout_s={float(spec.get('timeoutSeconds', 1))})\nprint(seen); sys.exit(0 if ok else 1)")
        proc = _run(["docker", "exec", self.prober, "python3", "-c", code], check=False, timeout=60)
        return proc.returncode == 0, (proc.stdout + proc.stderr).strip()[-300:]

    def wait_started(self, pod: Pod) -> float:
        """Seconds until the startup probe passed; fails when its budget (failureThreshold x periodSeconds) ran out."""
        spec = pod.main["startupProbe"]
        budget = spec.get("initialDelaySeconds", 0) + spec.get("failureThreshold", 3) * spec.get("periodSeconds", 10)
        while True:
            ok, seen = self.probe(pod, "startupProbe")
            elapsed = time.monotonic() - pod.started_at
            if ok:
                pod.started = True
                return elapsed
            state = _run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", pod.docker_name()],
                         check=False).stdout.strip()
            assert state.startswith("running"), f"{pod.name} is {state} before its startup probe passed: {seen}"
            assert elapsed < budget, f"{pod.name}: startup probe still failing after {budget} s: {seen}"
            time.sleep(min(2, spec.get("periodSeconds", 10)))

    def start_liveness_monitor(self) -> None:
        """Probe every started pod's liveness at its periodSeconds (as the kubelet does, only once its startup probe
        has passed); record the longest run of failures."""
        def loop():
            last: dict[str, float] = {}
            failing_since: dict[str, float] = {}
            while not self._stop.is_set():
                for pod in list(self.pods.values()):
                    spec = pod.main.get("livenessProbe")
                    if not spec or pod.expected_down or not pod.started:
                        continue
                    now = time.monotonic()
                    if now - last.get(pod.name, 0) < spec.get("periodSeconds", 10):
                        continue
                    last[pod.name] = now
                    ok, _ = self.probe(pod, "livenessProbe")
                    if pod.expected_down:
                        continue
                    if ok:
                        failing_since.pop(pod.name, None)
                    else:
                        failing_since.setdefault(pod.name, now)
                        with self.lock:
                            run = now - failing_since[pod.name] + spec.get("periodSeconds", 10)
                            self.liveness_failures[pod.name] = max(self.liveness_failures.get(pod.name, 0), run)
                self._stop.wait(1)

        self._monitor = threading.Thread(target=loop, daemon=True)
        self._monitor.start()

    def non_loopback_listeners(self, pod: Pod) -> set[int]:
        """TCP ports something in the pod's main container listens on at a non-loopback address."""
        text = _run(["docker", "exec", pod.docker_name(), "cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout
        ports = set()
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 4 or parts[3] != "0A" or ":" not in parts[1]:
                continue
            addr_hex, port_hex = parts[1].split(":")
            raw = b"".join(bytes.fromhex(addr_hex[i:i + 8])[::-1] for i in range(0, len(addr_hex), 8))
            addr = ipaddress.ip_address(raw)
            if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
                addr = addr.ipv4_mapped
            if not addr.is_loopback:
                ports.add(int(port_hex, 16))
        return ports


# --- the test -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image(launcher) -> str | None:
    problem = _problem()
    if problem:
        print(f"\n[test_k8s_run] SKIPPED: {problem}", file=sys.stderr)
        pytest.skip(problem)
    stale = sweep_stale_test_objects()
    if stale:
        print(f"\n[test_k8s_run] removed {len(stale)} objects a killed earlier test run left: {stale}", file=sys.stderr)
    if os.environ.get("DGRPO_TEST_IMAGE"):
        return os.environ["DGRPO_TEST_IMAGE"]
    build = _run(["bash", str(ROOT / "deploy" / "build.sh"), "cpu"], timeout=5400)
    print("\n".join(line for line in build.stdout.splitlines() if line.startswith("[build]")))
    return None  # the overlay's own image reference (dgrpo:cpu)


def render_test_overlay(tmp: Path) -> list[dict]:
    """The cpu overlay under a test overlay that swaps in a config of its own and mounts the tiny model."""
    overlay = tmp / "overlay"
    overlay.mkdir()
    config = yaml.safe_load((OVERLAY / "stack.yaml").read_text())
    config["model"] = {"path": "/models/tiny", "dtype": "bfloat16"}
    config["sampler"].update(max_model_len=512, max_num_seqs=32, cpu_cores="all")
    learner = config["learner"]
    learner["data"]["train_batch_size"] = BATCH
    learner["rollout"].update(n=4, max_response_length=48)
    learner["actor"].update(max_tokens_per_micro_batch=4096)
    learner["checkpoint"].update(save_freq=1, export_dir=None)  # every step: the crash phase resumes
    learner["trainer"].update(total_training_steps=100_000, test_freq=0, val_before_train=False,
                              run_name=RUN_NAME, loggers=["console", "jsonl"])
    (overlay / "stack.yaml").write_text(yaml.safe_dump(config))
    model_patch = [
        {"op": "add", "path": "/spec/template/spec/volumes/-",
         "value": {"name": "model", "hostPath": {"path": "/var/lib/dgrpo-test/tiny-model", "type": "Directory"}}},
        {"op": "add", "path": "/spec/template/spec/containers/0/volumeMounts/-",
         "value": {"name": "model", "mountPath": "/models/tiny", "readOnly": True}},
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAY, overlay)],
        "configMapGenerator": [{"name": "dgrpo-config", "behavior": "replace", "files": ["stack.yaml"]}],
        # One sampler pod to start (the overlay ships 2): the scale-up phase adds the second, one vLLM start fewer
        # on 2 cores than 2 then 3, proving the same join.
        "replicas": [{"name": "sampler", "count": 1}],
        "patches": [{"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(model_patch)}
                    for kind, name in (("StatefulSet", "sampler"), ("StatefulSet", "learner"))],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    load_config(StackConfig, overlay / "stack.yaml", [])  # a bad key fails here, not in a crash-looping container
    return render(overlay)


class Run:
    def __init__(self, runner: PodRunner):
        self.runner = runner
        self.run_dir = runner.tmp / "pvc" / "runs-learner-0" / RUN_NAME
        self.metrics = self.run_dir / "metrics.jsonl"

    def steps(self) -> list[dict]:
        if not self.metrics.exists():
            return []
        complete = self.metrics.read_text().rpartition("\n")[0]  # the learner may be writing the last line
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def wait_step(self, predicate, what: str, after: int = 0, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.steps():
                if rec["step"] > after and predicate(rec):
                    return rec
            learner = next(p for p in self.runner.pods.values() if p.name.startswith("learner-"))
            state = _run(["docker", "inspect", "-f", "{{.State.Status}}", learner.docker_name()]).stdout.strip()
            assert state == "running", f"the learner is {state}"
            time.sleep(1)
        raise AssertionError(f"no step after {after} {what} within {timeout:.0f} s; last: {self.steps()[-1:]}")

    def exec_python(self, pod: Pod, code: str) -> str:
        return _run(["docker", "exec", pod.docker_name(), "python3", "-c", code], timeout=60).stdout.strip()

    def wait_status(self, learner: Pod, code: str, phase: str, timeout: float = 300) -> list[str]:
        """The learner's Status (phase, step) once it reports `phase`."""
        deadline = time.monotonic() + timeout
        while True:
            proc = _run(["docker", "exec", learner.docker_name(), "python3", "-c", code], timeout=60, check=False)
            seen = proc.stdout.split()
            if proc.returncode == 0 and seen[0] == phase:
                return seen
            assert time.monotonic() < deadline, f"learner phase {seen[:1]} after {timeout:.0f} s, not {phase}"
            time.sleep(1)

    def relays(self, learner: Pod) -> set[str]:
        """Hostnames of the sampler pods whose relay joined the learner's weight groups (its log)."""
        logs = _run(["docker", "logs", learner.docker_name()])
        return set(re.findall(r"weights: host ([\w.-]+) \([\d.]+\) joined \(collective group",
                              logs.stdout + logs.stderr))


def replicas(rec: dict) -> dict[str, float]:
    prefix = "rollout/groups_by_replica/"
    return {k.removeprefix(prefix): v for k, v in rec.items() if k.startswith(prefix)}


RPC = ("import grpc\nfrom dgrpo.v1 import {mod}_pb2 as p, {mod}_pb2_grpc as g\n"
       "t = open('/var/run/secrets/dgrpo/token').read().strip()\n"
       "c = grpc.insecure_channel('localhost:{port}')\n"
       "r = g.{stub}(c).{method}(p.{request}({fields}), timeout=10, metadata=[('authorization', 'Bearer ' + t)])\n")


# A phase's set-up is its test's: the second sampler pod takes minutes to start on 2 cores shared with a training
# learner and the first; the first phase may build the image.
LONG_PHASE = pytest.mark.timeout(900)
pytestmark = pytest.mark.slow
STATUS = RPC.format(mod="learner", port=50053, stub="LearnerStub", method="Status", request="StatusRequest",
                    fields="") + "print(r.phase, r.step)"


@contextmanager
def phase(runner: PodRunner, timings: dict[str, float], name: str):
    """One phase of the run (a module fixture): timed; on failure every container's logs are printed, as the
    fixture's error is all pytest shows."""
    t = time.monotonic()
    try:
        yield
    except BaseException:
        print(runner.logs(), file=sys.stderr)
        raise
    finally:
        timings[name] = time.monotonic() - t


@pytest.fixture(scope="module")
def timings():
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    yield timings
    timings["total"] = time.monotonic() - t0
    print(f"\n[test_k8s_run] timings (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")


@pytest.fixture(scope="module")
def runner(image, tiny_model, tmp_path_factory, timings):
    tmp = tmp_path_factory.mktemp("k8s_run")
    model = tmp / "tiny-model"
    shutil.copytree(tiny_model, model)
    for p in [model, *model.rglob("*")]:  # world-readable, as a hostPath a non-root pod reads must be
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    objects = render_test_overlay(tmp)
    runner = PodRunner(objects, tmp, image, {"dgrpo-token": {"token": secrets.token_urlsafe(32)}},
                       {"/var/lib/dgrpo-test/tiny-model": model})
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.fixture(scope="module")
def run(runner):
    return Run(runner)


@pytest.fixture(scope="module")
def pods(runner, timings):
    """kubectl apply: every workload's pods at once (no ordering between them, as in Kubernetes); the readiness
    probe of each once its startup probe passed."""
    with phase(runner, timings, "all_ready"):
        runner.start_network()
        sts = runner.workload("StatefulSet", "sampler")
        assert sts["spec"]["replicas"] == 1  # the test overlay's (render_test_overlay)
        rewarder = runner.start_pod("Deployment", "rewarder")
        learner = runner.start_pod("StatefulSet", "learner", 0)
        sampler = runner.start_pod("StatefulSet", "sampler", 0)
        for pod in (rewarder, learner, sampler):
            kind = pod.name.rsplit("-", 1)[0] if pod.owner["kind"] != "StatefulSet" else pod.name
            timings[f"started_{kind}"] = runner.wait_started(pod)
        runner.start_liveness_monitor()
        ready = {pod.name: runner.probe(pod, "readinessProbe") for pod in (rewarder, learner, sampler)}
    return {"rewarder": rewarder, "learner": learner, "sampler": sampler, "ready": ready}


@pytest.fixture(scope="module")
def two_steps(runner, run, pods, timings):
    """Two steps on the first sampler pod; the learner's published version."""
    with phase(runner, timings, "two_steps"):
        two = run.wait_step(lambda r: r["step"] >= 2, "the second")
        status = run.exec_python(pods["learner"], RPC.format(mod="learner", port=50053, stub="LearnerStub",
                                                              method="Status", request="StatusRequest", fields="")
                                 + "print(r.weight_version)")
    return {"two": two, "version": int(status), "relays": run.relays(pods["learner"])}


@pytest.fixture(scope="module")
def scaled_up(runner, run, pods, two_steps, timings):
    """kubectl scale statefulset/sampler --replicas=2: the new pod's Info once started, and the steps after it
    (both pods' groups in one step or over several: with two replicas on 2 cores the rollout's straggler watch often
    hedges one's prompts on the other, and the first complete group wins)."""
    with phase(runner, timings, "scaled_to_2"):
        second = runner.start_pod("StatefulSet", "sampler", 1)
        timings["second_started"] = runner.wait_started(second)
        info = run.exec_python(second, RPC.format(mod="sampler", port=50051, stub="SamplerStub", method="Info",
                                                  request="InfoRequest", fields="")
                               + "print(r.weight_version, r.replica_id)")
        version, replica = info.split()
        relays = run.relays(pods["learner"])
        served: set[str] = set()
        both = run.wait_step(lambda r: bool(served.update(replicas(r))) or len(served) == 2,
                             "with groups from both sampler pods", after=two_steps["two"]["step"])
        later = run.wait_step(lambda r: True, "after the scale-up", after=both["step"])
    return {"pod": second, "version": int(version), "replica": replica, "relays": relays, "served": served,
            "later": later}


@pytest.fixture(scope="module")
def reward_swapped(runner, run, pods, scaled_up, timings):
    """As docs/kubernetes.md says: replace the ConfigMap, wait until the pod sees it, SIGHUP."""
    with phase(runner, timings, "reward_swap"):
        first_version = scaled_up["later"]["reward/spec_version_max"]
        spec = yaml.safe_load(runner.configmaps["dgrpo-rewards"]["data"]["spec.yaml"])
        spec["name"] = "math-v2"
        write_atomic_dir(runner.tmp / "configmaps" / "dgrpo-rewards", {"spec.yaml": yaml.safe_dump(spec)}, 0o644)
        seen = _run(["docker", "exec", pods["rewarder"].docker_name(), "cat", "/opt/dgrpo/rewards/spec.yaml"]).stdout
        _run(["docker", "exec", pods["rewarder"].docker_name(), "sh", "-c", "kill -HUP 1"])
        step = run.wait_step(lambda r: r["reward/spec_version_min"] > first_version, "scored by the reloaded spec",
                             after=scaled_up["later"]["step"])
    return {"first_version": first_version, "seen": seen, "step": step}


@pytest.fixture(scope="module")
def learner_crashed(runner, run, pods, reward_swapped, timings):
    """A crash (SIGKILL of the container's PID 1 from the host's PID namespace, outside Docker's API: `docker kill`
    counts as a manual stop, which no restart policy restarts; needs root, as CI is): the StatefulSet's pod restarts
    the container; the first step after it."""
    learner = pods["learner"]
    with phase(runner, timings, "crash_resume"):
        killed_after = run.steps()[-1]["step"]
        pid = int(_run(["docker", "inspect", "-f", "{{.State.Pid}}", learner.docker_name()]).stdout)
        learner.expected_down = True
        try:
            os.kill(pid, signal.SIGKILL)
        except PermissionError:
            learner.expected_down = False
            pytest.skip(f"not allowed to kill pid {pid} (not root)")
        deadline = time.monotonic() + 120
        while True:
            state = _run(["docker", "inspect", "-f", "{{.RestartCount}} {{.State.Status}}", learner.docker_name()]
                         ).stdout.split()
            if int(state[0]) >= 1 and state[1] == "running":
                break
            assert time.monotonic() < deadline, f"the learner was not restarted after a crash: {state}"
            time.sleep(0.5)
        learner.started_at, learner.started = time.monotonic(), False
        runner.wait_started(learner)
        learner.expected_down = False
        after_crash = run.wait_step(lambda r: True, "after the restart", after=killed_after)
    logs = _run(["docker", "logs", learner.docker_name()])
    return {"killed_after": killed_after, "after_crash": after_crash, "logs": logs.stdout + logs.stderr}


@pytest.fixture(scope="module")
def stopped(runner, run, pods, learner_crashed, timings):
    """The control RPC's Stop (a StatefulSet would restart an exit, so the learner stays up answering Status)."""
    with phase(runner, timings, "stop"):
        last = run.exec_python(pods["learner"], RPC.format(mod="learner", port=50053, stub="LearnerStub",
                                                            method="Stop", request="StopRequest",
                                                            fields="reason='k8s test'")
                               + "print(r.stopping_after_step)")
        _, step = run.wait_status(pods["learner"], STATUS, "stopped")
    return {"last": int(last), "step": int(step), "steps": run.steps(),
            "ended": json.loads((run.run_dir / "ended.json").read_text())}


@pytest.fixture(scope="module")
def stopped_restarted(runner, run, pods, stopped, timings):
    """`docker restart` of the stopped learner (the pod restarted: a node reboot), given a few seconds to train."""
    learner = pods["learner"]
    with phase(runner, timings, "stopped_restart"):
        learner.expected_down = True
        _run(["docker", "restart", "-t", "30", learner.docker_name()], timeout=120)
        learner.started_at, learner.started = time.monotonic(), False
        runner.wait_started(learner)
        learner.expected_down = False
        _, step = run.wait_status(learner, STATUS, "stopped")
        time.sleep(5)
    logs = _run(["docker", "logs", "--tail", "20", learner.docker_name()])
    state = _run(["docker", "inspect", "-f", "{{.State.Status}}", learner.docker_name()]).stdout.strip()
    return {"step": int(step), "last_logged": run.steps()[-1]["step"], "logs": logs.stdout + logs.stderr,
            "state": state}


# 1. Every pod ready


@LONG_PHASE
def test_every_pod_passes_its_startup_and_readiness_probes(pods):
    assert all(ok for ok, _ in pods["ready"].values()), pods["ready"]


# 2. Training on one sampler pod


def test_the_first_sampler_pod_serves_every_group_and_gets_weights_over_its_own_group(pods, two_steps):
    """weights.transport=collective: the pod's relay received every version over its torch.distributed group."""
    assert replicas(two_steps["two"]) == {f"{pods['sampler'].name}:50051": BATCH}, replicas(two_steps["two"])
    assert pods["sampler"].name in two_steps["relays"], "a sampler pod got its weights another way"
    assert two_steps["version"] >= 1, "the learner has published no weights"


# 3. Scaled to two sampler pods


@LONG_PHASE
def test_a_sampler_pod_added_mid_run_joins_with_its_own_group_on_the_latest_weights(two_steps, scaled_up):
    assert scaled_up["replica"] == "sampler-1:50051"
    assert scaled_up["version"] >= two_steps["version"], scaled_up
    assert "sampler-1" in scaled_up["relays"]


def test_both_sampler_pods_serve_groups(pods, two_steps, scaled_up):
    assert scaled_up["served"] == {f"{p.name}:50051" for p in (pods["sampler"], scaled_up["pod"])}, scaled_up
    assert scaled_up["later"]["step"] >= two_steps["two"]["step"] + 2


# 4. Reward hot swap


def test_a_replaced_configmap_and_sighup_swap_the_reward_spec(reward_swapped):
    assert "math-v2" in reward_swapped["seen"], "the pod never saw the replaced ConfigMap"
    assert reward_swapped["step"]["reward/spec_version_min"] > reward_swapped["first_version"]


# 5. The learner crashes


def test_a_crashed_learner_is_restarted_and_resumes_from_its_claim(learner_crashed):
    """From its newest checkpoint on its claim (written as the non-root user through fsGroup)."""
    assert learner_crashed["after_crash"]["step"] > learner_crashed["killed_after"]
    assert re.search(r"resumed from \S+ at step [1-9]", learner_crashed["logs"]), "the learner did not resume"


def test_nothing_listens_beyond_the_declared_ports(runner, learner_crashed):
    """Beyond the declared containerPorts, only the weight groups' ephemeral ports (a TCPStore on the learner,
    gloo's pairs on both ends) in learner and samplers: the range the NetworkPolicies open between those two."""
    low, high = map(int, _run(["cat", "/proc/sys/net/ipv4/ip_local_port_range"]).stdout.split())
    for pod in runner.pods.values():
        declared = {p["containerPort"] for p in pod.main.get("ports", [])}
        extra = runner.non_loopback_listeners(pod) - declared
        if pod.labels["app.kubernetes.io/component"] in ("learner", "sampler"):
            extra = {port for port in extra if not low <= port <= high}
        assert not extra, f"{pod.name} listens on undeclared ports {sorted(extra)} (declared {sorted(declared)})"


# 6. Stopped


def test_every_step_trained_once_on_a_whole_batch(learner_crashed, reward_swapped, stopped):
    """A step logged just before the kill but not yet checkpointed is trained again by the resumed run (at most
    once); a learner that started over instead of resuming would repeat every step."""
    numbers = [r["step"] for r in stopped["steps"]]
    repeated = {n: numbers.count(n) for n in set(numbers) if numbers.count(n) > 1}
    killed_after = learner_crashed["killed_after"]
    assert len(repeated) <= 1 and set(repeated) <= {killed_after, killed_after + 1} \
        and set(repeated.values()) <= {2}, f"steps logged: {numbers}"
    steps = list({r["step"]: r for r in stopped["steps"]}.values())
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "a step failed or was skipped"
    for r in steps:
        assert sum(replicas(r).values()) == BATCH, f"step {r['step']} trained on {replicas(r)} groups"
    print(f"\n[test_k8s_run] {len(steps)} steps; groups {replicas(steps[-1])}; spec version "
          f"{reward_swapped['first_version']:.0f} -> {reward_swapped['step']['reward/spec_version_min']:.0f} at step "
          f"{reward_swapped['step']['step']}")


def test_the_stop_rpc_ends_the_run_and_the_learner_stays_up_answering_status(stopped):
    assert stopped["step"] == stopped["last"] == stopped["steps"][-1]["step"]
    assert stopped["ended"]["phase"] == "stopped"


def test_a_restarted_learner_finds_the_runs_end_and_trains_nothing(stopped, stopped_restarted):
    assert stopped_restarted["step"] == stopped["last"]
    assert stopped_restarted["last_logged"] == stopped["last"], "the restarted learner trained"
    assert "ended at step" in stopped_restarted["logs"]
    assert stopped_restarted["state"] == "running", f"the ended learner is {stopped_restarted['state']}"


def test_no_liveness_probe_failed_long_enough_for_a_restart(runner, stopped_restarted):
    with runner.lock:
        failures = dict(runner.liveness_failures)
    for name, seconds in failures.items():
        spec = runner.pods[name].main["livenessProbe"]
        budget = spec.get("failureThreshold", 3) * spec.get("periodSeconds", 10)
        assert seconds < budget, f"{name}: liveness failed for {seconds:.0f} s: the kubelet would have restarted it"


def test_cleanup_leaves_no_container(runner, stopped_restarted):
    runner.cleanup()
    left = _run(["docker", "ps", "-aq", "--filter", f"label={runner.label}"]).stdout.split()
    assert not left, f"containers left behind: {left}"


def make_tls(names: list[str]) -> dict[str, str]:
    """A CA and one certificate for `names` (serverAuth and clientAuth), as the Secret dgrpo-tls holds them."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dgrpo test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {"ca.crt": ca.public_bytes(pem).decode(), "tls.crt": cert.public_bytes(pem).decode(),
            "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()).decode()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tls_component_serves_mutual_tls_and_its_exec_probes_pass(image, tmp_path):
    """components/tls on the cpu overlay, the rewarder pod run for real: it starts with the Secret's certificate,
    its exec probes (health over mutual TLS) pass, while a plaintext probe - what a `grpc:` probe would do - and a
    TLS client without a certificate are refused."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    k8s = ROOT / "deploy" / "k8s"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAY, overlay)],
        "components": [os.path.relpath(k8s / "components" / "tls", overlay)]}))
    objects = render(overlay)
    runner = PodRunner(objects, tmp_path, image, {"dgrpo-token": {"token": secrets.token_urlsafe(32)},
                                                  "dgrpo-tls": make_tls(["dgrpo", "localhost"])}, {})
    try:
        runner.start_network()
        pod = runner.start_pod("Deployment", "rewarder")
        assert "exec" in pod.main["startupProbe"] and "grpc" not in pod.main["startupProbe"]
        started = runner.wait_started(pod)
        ok, seen = runner.probe(pod, "livenessProbe")
        assert ok, seen
        # What Kubernetes' own grpc probe does (plaintext, at the pod's address): refused by the TLS-only server.
        pod.main["readinessProbe"] = {"grpc": {"port": 50052}, "timeoutSeconds": 3}
        ok, seen = runner.probe(pod, "readinessProbe")
        assert not ok, f"a plaintext health check got an answer: {seen}"
        # TLS at the pod's address: with the client certificate it answers; without one the handshake fails
        # (require_client_cert).
        check = ["docker", "exec", pod.docker_name(), "python3", "/opt/dgrpo/deploy/healthcheck.py", f"{pod.ip}:50052",
                 "--ca-file", "/var/run/secrets/dgrpo-tls/ca.crt", "--server-name", "dgrpo"]
        client = ["--cert-file", "/var/run/secrets/dgrpo-tls/tls.crt",
                  "--key-file", "/var/run/secrets/dgrpo-tls/tls.key"]
        proc = _run([*check, *client], check=False)
        assert proc.returncode == 0 and "SERVING" in proc.stdout, proc.stdout + proc.stderr
        proc = _run(check, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        print(f"\n[test_k8s_run] tls: rewarder started in {started:.1f} s; plaintext: {seen}; "
              f"no client certificate: {proc.stdout.strip()}")
    except BaseException:
        print(runner.logs(), file=sys.stderr)
        raise
    finally:
        runner.cleanup()
