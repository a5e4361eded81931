"""The devices and what their stacks read: the accelerators (from /dev and the vendor's smi tool), the visible
devices and the collective backend, the environment variables each service needs or refuses, the CPU allocator."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from dgrpo.cli.doctor.findings import Finding, Status
from dgrpo.cli.doctor.software import installed_packages, installed_version
from dgrpo.common import preflight as pf
from dgrpo.common.devices import DIST_BACKENDS, VISIBLE_DEVICES_ENV, find_tcmalloc, preloaded_allocator, visible_devices

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
    got = installed if installed is not None else installed_packages()
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
