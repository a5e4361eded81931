"""deploy/: the compose files validate with a real compose implementation, every service command is a valid dgrpo
configuration of today's StackConfig, and the topology keeps its promises (scalable samplers without host ports, shared
memory and PID namespace held by `shm` for the learner and samplers, gRPC health checks, restart policies, one device
set per service).

There is no Docker engine here: `docker compose config` / `docker-compose config` parse, merge and interpolate the
files exactly as `up` would, without starting anything. CI installs Debian's compose with
`apt-get install -y --no-install-recommends docker-compose`; without a compose binary the compose tests skip, saying so.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOKEN_FILE = "/run/dgrpo-secrets/token"
DEPLOY = ROOT / "deploy"
VARIANTS = {
    "cpu": ["docker-compose.yml"],
    "cuda": ["docker-compose.yml", "docker-compose.cuda.yml"],
    "npu": ["docker-compose.yml", "docker-compose.npu.yml"],
}
DEVICE_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# Resolved by `docker compose config` (a child process): integration tier (tests/tiers.py).
pytestmark = pytest.mark.usefixtures("child_processes")


def _compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


COMPOSE = _compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE is None, reason="no compose implementation (CI: apt-get install -y --no-install-recommends docker-compose)"
)


@functools.cache
def resolved(variant: str, profiles: tuple[str, ...] = ("swap",)) -> dict:
    """The merged, interpolated compose model of a variant, as the compose binary prints it."""
    args = [*COMPOSE]
    for f in VARIANTS[variant]:
        args += ["-f", str(DEPLOY / f)]
    for p in profiles:
        args += ["--profile", p]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DGRPO_", "COMPOSE_"))}
    proc = subprocess.run([*args, "config"], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def dgrpo_services(variant: str) -> dict:
    """The services that run `dgrpo <service>` (all but the namespace holder `shm` and the one-shot `token`)."""
    services = resolved(variant)["services"]
    assert services["shm"]["command"] == ["sleep", "infinity"], "shm runs something that can fail"
    assert services["token"]["command"] == ["python3", "-m", "dgrpo.cli.token", TOKEN_FILE]
    return {name: s for name, s in services.items() if name not in ("shm", "token")}


def dgrpo_command(command: list[str]) -> tuple[str, str, list[str]]:
    """(subcommand, config file in the repository, overrides) of a service's `dgrpo <cmd> --config=... k=v` line."""
    assert command[0] == "dgrpo", command
    sub, config, overrides = command[1], None, []
    for arg in command[2:]:
        if arg.startswith("--config="):
            config = arg.removeprefix("--config=")
        else:
            overrides.append(arg)
    assert config and config.startswith("/opt/dgrpo/configs/"), f"{sub}: no --config from the mounted configs/"
    return sub, str(ROOT / "configs" / Path(config).name), overrides


@needs_compose
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_service_command_is_a_valid_stack_config(variant):
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    services = dgrpo_services(variant)
    assert {"rewarder", "rewarder-next", "learner", "sampler"} <= set(services)
    for name, svc in services.items():
        sub, config, overrides = dgrpo_command(svc["command"])
        assert sub in ("rewarder", "learner", "sampler"), f"{name} runs `dgrpo {sub}`"
        assert Path(config).is_file(), f"{name} uses {config}, which configs/ does not have"
        load_config(StackConfig, config, overrides)  # raises ConfigError naming the key if a section changed


@needs_compose
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_topology(variant):
    everything = resolved(variant)["services"]
    services = dgrpo_services(variant)
    learner = services["learner"]
    samplers = {n: s for n, s in services.items() if s["command"][1] == "sampler"}
    assert "sampler" in samplers

    # The learner finds every replica through one DNS name, and weights through its own address.
    assert "sampler.addresses=[dns:///sampler:50051]" in learner["command"]
    assert "learner.rollout.rewarder_address=dns:///rewarder:50052" in learner["command"]
    # /dev/shm (the weight slots) and the PID namespace belong to `shm`, which runs nothing that can fail: a
    # learner that restarts or is recreated never takes the samplers' namespaces (and the samplers) with it.
    holder = everything["shm"]
    assert holder["ipc"] == "shareable" and holder["shm_size"] and holder["init"] is True
    assert holder["network_mode"] == "none" and holder["restart"] == "unless-stopped" and not holder["environment"]
    assert learner["restart"] == "on-failure"
    assert learner["ipc"] == "service:shm" and learner["pid"] == "service:shm" and "shm_size" not in learner
    assert set(learner["depends_on"]) == {"token", "shm", "rewarder"}
    for name, s in samplers.items():
        # --scale needs no fixed host port and no container_name; joining the holder's namespaces shares /dev/shm
        # and the process ids the stale-segment check compares.
        assert "ports" not in s and "container_name" not in s, name
        assert s["ipc"] == "service:shm" and s["pid"] == "service:shm", name
        assert "learner" not in s.get("depends_on", {}), f"{name} would be restarted with the learner"
        assert "weights.host=learner" in s["command"], name
        if name != "sampler":
            assert "sampler" in s["networks"]["default"]["aliases"], f"{name} is not reachable as `sampler`"
    for name, s in services.items():
        health = s["healthcheck"]["test"]
        assert health[:3] == ["CMD", "python3", "/opt/dgrpo/deploy/healthcheck.py"], name
        port = next(a.split("=")[1] for a in s["command"] if a.split("=")[0].endswith((".port", "control_port")))
        assert health[3] == port, f"{name} probes {health[3]} but serves {port}"
        assert s["restart"] in ("unless-stopped", "on-failure"), name
    assert "rewarder" in services["rewarder-next"]["networks"]["default"]["aliases"]


def _mount(volume) -> tuple[str, str, bool]:
    """(source, target, read-only) of a volume entry, in the long form (Compose v2) or the short one (1.29)."""
    if isinstance(volume, dict):
        return volume.get("source", ""), volume["target"], bool(volume.get("read_only"))
    source, target, *mode = volume.split(":")
    return source, target, mode == ["ro"]


@needs_compose
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_service_runs_without_the_token(variant):
    """`docker compose up` with no DGRPO_TOKEN still authenticates every call: `token` writes one before anything
    starts, every service reads it from the read-only secrets volume, and nothing else carries it."""
    everything = resolved(variant)["services"]
    token = everything["token"]
    assert token["network_mode"] == "none" and token["restart"] == "no"
    assert token["environment"] == {"DGRPO_TOKEN": ""}  # empty here: the caller's DGRPO_* is dropped
    assert token["image"] == everything["learner"]["image"]
    for name, s in dgrpo_services(variant).items():
        assert f"auth.token_file={TOKEN_FILE}" in s["command"], name
        assert s["depends_on"]["token"]["condition"] == "service_completed_successfully", name
        mounts = [_mount(v) for v in s["volumes"] if _mount(v)[0] == "dgrpo-secrets"]
        assert mounts == [("dgrpo-secrets", "/run/dgrpo-secrets", True)], name
        assert "DGRPO_TOKEN" not in (s.get("environment") or {}), f"{name} carries the token in its environment"
        assert s["environment"].get("GLOO_SOCKET_IFNAME") == "lo" or variant != "cpu", name


@needs_compose
@pytest.mark.parametrize("variant", ["cuda", "npu"])
def test_each_device_service_has_its_own_devices(variant):
    services = dgrpo_services(variant)
    var = DEVICE_VAR[variant]
    used: dict[str, str] = {}
    for name, s in services.items():
        visible = str(s["environment"][var])
        for dev in filter(None, visible.split(",")):
            assert dev not in used, f"{variant}: device {dev} is given to both {used[dev]} and {name}"
            used[dev] = name
    learner_devices = str(services["learner"]["environment"][var]).split(",")
    assert int(services["learner"]["environment"]["DGRPO_NPROC_PER_NODE"]) == len(learner_devices)
    if variant == "npu":
        for name, s in services.items():
            if s["command"][1] in ("sampler", "learner"):
                assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(_device_paths(s)), name
                assert s["environment"]["VLLM_ASCEND_ENABLE_NZ"] == "0", name
                targets = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in s["volumes"]}
                assert "/usr/local/Ascend/driver/lib64/" in targets or "/usr/local/Ascend/driver/lib64" in targets


def _device_paths(service: dict) -> list[str]:
    return [d["source"] if isinstance(d, dict) else d.split(":")[0] for d in service.get("devices", [])]


@needs_compose
def test_base_and_override_learner_commands_agree():
    """Override files repeat the learner's wiring; only the config file may differ."""
    base = [a for a in resolved("cpu")["services"]["learner"]["command"] if not a.startswith("--config=")]
    for variant in ("cuda", "npu"):
        other = [a for a in resolved(variant)["services"]["learner"]["command"] if not a.startswith("--config=")]
        assert other == base, variant


def test_dockerfiles_copy_every_package_folder():
    """A new top-level package in pyproject must reach the images (they install the folders they copy)."""
    tomllib = pytest.importorskip("tomllib")

    folders = {d.split("/")[0] for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"].values()}
    for dockerfile in sorted(DEPLOY.glob("Dockerfile.*")):
        if dockerfile.suffix == ".dockerignore":
            continue
        text = dockerfile.read_text()
        missing = [f for f in sorted(folders) if f"COPY {f}/ {f}/" not in text]
        assert not missing, f"{dockerfile.name} does not copy {missing}"
        ignore = (DEPLOY / f"{dockerfile.name}.dockerignore").read_text()
        assert all(f"!{f}/" in ignore for f in folders), f"{dockerfile.name}.dockerignore excludes a package folder"


def test_entrypoint_runs_learner_under_torchrun(child_processes, tmp_path):
    """DGRPO_NPROC_PER_NODE=2 turns `dgrpo learner ...` into two torchrun ranks (here: each prints --help)."""
    env = {**os.environ, "DGRPO_NPROC_PER_NODE": "2", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(DEPLOY / "entrypoint.sh"), "dgrpo", "learner", "--help"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("dgrpo learner: run GRPO training") == 2
    # Other commands pass through untouched.
    proc = subprocess.run([str(DEPLOY / "entrypoint.sh"), "dgrpo", "rewarder", "--help"], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.count("dgrpo rewarder:") == 1


@needs_compose
def test_metrics_override_scrapes_every_service():
    """docker-compose.metrics.yml: each service's metrics endpoint on the port deploy/prometheus.yml scrapes, valid
    keys, nothing published but Prometheus' UI on the host's loopback; without the file no service serves metrics."""
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import load_config

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DGRPO_", "COMPOSE_"))}
    args = [*COMPOSE, "-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.metrics.yml")]
    proc = subprocess.run([*args, "config"], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job for job in scrape}
    ports = {"learner": targets["dgrpo-learner"]["static_configs"][0]["targets"][0].split(":")[1],
             "rewarder": targets["dgrpo-rewarder"]["static_configs"][0]["targets"][0].split(":")[1],
             "sampler": str(targets["dgrpo-sampler"]["dns_sd_configs"][0]["port"])}
    assert targets["dgrpo-sampler"]["dns_sd_configs"][0]["names"] == ["sampler"]  # every replica, --scale included
    for name, port in ports.items():
        svc = services[name]
        overrides = svc["environment"]["DGRPO_OVERRIDES"].split()
        key = "learner.trainer" if name == "learner" else name
        assert f"{key}.metrics_port={port}" in overrides and f"{key}.metrics_host=0.0.0.0" in overrides
        assert str(port) in [str(p) for p in svc.get("expose", [])]
        assert port not in [_port(p)[2] for p in svc.get("ports", [])], f"{name}'s metrics port is published"
        _, config, command_overrides = dgrpo_command(svc["command"])
        load_config(StackConfig, config, [*command_overrides, *overrides])
    assert [_port(p) for p in services["prometheus"]["ports"]] == [("127.0.0.1", "9090", "9090")]
    volume = services["prometheus"]["volumes"][0]
    assert (volume["source"] if isinstance(volume, dict) else volume.split(":")[0]) == str(DEPLOY / "prometheus.yml")
    for name, svc in dgrpo_services("cpu").items():
        assert not any("metrics_port" in a for a in svc["command"]), name
        assert "metrics_port" not in (svc.get("environment") or {}).get("DGRPO_OVERRIDES", "")


def _port(p: str | dict) -> tuple[str, str, str]:
    """(host ip, published, target) of a port as compose v1 (`127.0.0.1:9090:9090/tcp`) or v2 (a mapping) prints it."""
    if isinstance(p, dict):
        return p.get("host_ip", ""), str(p.get("published", "")), str(p["target"])
    parts = p.split("/")[0].split(":")
    return (parts[0] if len(parts) == 3 else ""), (parts[-2] if len(parts) > 1 else ""), parts[-1]
