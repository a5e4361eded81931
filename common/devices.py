"""The one place that knows npu / cuda / cpu.

Everything device-specific — which accelerator, which collective backend, which environment the Ascend
stack needs — is decided here so the rest of dgrpo reads the same on every device.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Literal

DeviceKind = Literal["npu", "cuda", "cpu"]

DIST_BACKENDS: dict[str, str] = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# Env var that restricts which accelerators a process sees.
VISIBLE_DEVICES_ENV: dict[str, str | None] = {
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "cuda": "CUDA_VISIBLE_DEVICES",
    "cpu": None,
}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)

    return bool(getattr(torch, "npu", None)) and torch.npu.is_available() and torch.npu.device_count() > 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def detect_device(requested: str = "auto") -> DeviceKind:
    """`auto`: torch_npu present with a visible NPU -> npu; else a visible CUDA GPU -> cuda; else cpu."""
    if requested not in ("auto", "npu", "cuda", "cpu"):
        raise ValueError(f"device {requested!r} is not one of auto, npu, cuda, cpu")
    if requested != "auto":
        if requested == "npu" and not _npu_available():
            raise RuntimeError("device 'npu' requested but torch_npu is missing or no NPU is visible")
        if requested == "cuda" and not _cuda_available():
            raise RuntimeError("device 'cuda' requested but no CUDA GPU is visible")
        return requested  # type: ignore[return-value]
    if _npu_available():
        return "npu"
    if _cuda_available():
        return "cuda"
    return "cpu"


def dist_backend(device: DeviceKind) -> str:
    """torch.distributed backend: hccl on Ascend, nccl on CUDA, gloo on CPU."""
    return DIST_BACKENDS[device]


WEIGHT_BACKEND_DEVICES: dict[str, str] = {"nccl": "cuda", "hccl": "npu"}
"""The device whose memory each device backend of weights.transport=collective stages bytes in (gloo: host memory)."""


def weight_collective_backend(setting: str, device: str) -> str:
    """The backend the weight groups of weights.transport=collective use for weights.collective_backend=`setting` in a
    process on `device`: auto follows the device (as dist_backend); gloo works on every device (host memory over
    TCP); nccl needs CUDA and hccl Ascend."""
    if setting == "auto":
        return DIST_BACKENDS[device]
    if setting != "gloo" and WEIGHT_BACKEND_DEVICES.get(setting) is None:
        raise ValueError(f"weights.collective_backend={setting!r}: expected one of auto, gloo, nccl, hccl")
    if setting != "gloo" and WEIGHT_BACKEND_DEVICES[setting] != device:
        raise ValueError(f"weights.collective_backend={setting} needs model.device={WEIGHT_BACKEND_DEVICES[setting]}, "
                         f"but this process runs on {device!r}: use auto (the device's own backend) or gloo (host "
                         "memory over TCP)")
    return setting


def torch_device(device: DeviceKind, local_rank: int = 0):
    import torch

    return torch.device("cpu") if device == "cpu" else torch.device(device, local_rank)


def fused_adamw(device: DeviceKind) -> bool:
    """Whether AdamW's fused kernel exists for the device: one pass over the fp32 states instead of a chain of
    foreach ops (135M parameters on 2 CPU cores: 0.09 s vs 0.3 s per step). torch_npu ships its own fused
    optimizers instead of this flag."""
    return device in ("cpu", "cuda")


def fp32_attention_backward(device: str) -> bool:
    """Whether bf16 attention should run in fp32: CPU's bf16 flash-attention backward takes twice its fp32 one
    (2 cores, [1, 9, 170, 64] blocks: 31 ms vs 16 ms), while NPU and CUDA kernels are fastest in bf16."""
    return device == "cpu"


CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of CPUs with bf16 matrix instructions (Intel AMX since Sapphire Rapids, AVX512-BF16 since
Cooper Lake / AMD Zen 4): oneDNN runs bf16 matmuls natively there and emulates them elsewhere."""


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def computes_bf16(device: str, flags: set[str] | None = None) -> bool:
    """Whether bf16 compute is the faster choice for the learner (learner.actor.dtype `auto`). NPUs and CUDA GPUs
    since Ampere compute bf16 natively. On CPUs it pays only with bf16 instructions: one demo update ran 1.5x
    faster in bf16 than fp32 on a Xeon with AMX-BF16, and 2.7x slower on a Xeon with AVX-512 but no BF16
    (docs/bench_vs_trl.md)."""
    if device == "cpu":
        return bool(set(CPU_BF16_FLAGS) & (cpu_flags() if flags is None else flags))
    if device == "cuda":
        import torch

        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    return True


def auto_dtype(device: str) -> str:
    """What a dtype of `auto` means on `device` (auto: this host's): bfloat16 where it computes bf16 natively, else
    float32. A named device is taken as named, so a config for another kind of host loads here too."""
    return "bfloat16" if computes_bf16(detect_device() if device == "auto" else device) else "float32"


def lora_merges_on_sync(device: str) -> bool:
    """learner.lora.merge_on_sync `auto`: publish merged full weights instead of the adapter where vLLM serves LoRA
    slowly. vLLM-CPU turns compilation off with LoRA and runs its LoRA kernels as plain torch ops: the demo samples
    2.4-5x slower with an adapter, and merging is 1.4-2.3x faster per step despite 55x the bytes (docs/lora.md).
    CUDA and NPU have LoRA kernels (Punica, vllm-ascend's), so the adapter alone travels there."""
    return device == "cpu"


def sampler_env(device: DeviceKind, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment defaults a sampler needs before vLLM is imported (user settings win).

    npu: VLLM_ASCEND_ENABLE_NZ=0 — the NZ weight layout breaks in-place RL weight updates (0.23 raises);
    and vllm-ascend's sleep-mode allocator refuses `expandable_segments`, so that setting is dropped.
    cpu: a small KV-cache budget so several engines fit on a 24 GiB machine.
    """
    env = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}
    if device == "npu":
        out["VLLM_ASCEND_ENABLE_NZ"] = env.get("VLLM_ASCEND_ENABLE_NZ", "0")
        alloc = env.get("PYTORCH_NPU_ALLOC_CONF", "")
        if "expandable_segments:True" in alloc:
            out["PYTORCH_NPU_ALLOC_CONF"] = ",".join(p for p in alloc.split(",") if "expandable_segments" not in p)
    elif device == "cpu":
        out["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", "1")
    return out


def cpu_thread_binding(cores: str) -> dict[str, str]:
    """vLLM-CPU's OpenMP binding for a sampler.cpu_cores setting: auto (vLLM's default: one core kept for the
    scheduler), all (every core this process may use, none reserved; a replica sharing the host with others binds
    the share common/cpu_leases.py leases it, passed here as a list) or an explicit list such as 0-3."""
    if cores == "auto":
        return {}
    if cores == "all":
        cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def replica_cpu_cores(index: int, replicas: int, cores: list[int] | None = None) -> str | None:
    """The cores replica `index` of `replicas` on one CPU host binds (a sampler.cpu_cores list), or None for one
    replica. Under `auto` every vLLM-CPU instance picks the same cores (under `all`, every core), so replicas started
    side by side pin their compute threads onto the same cores and a restarted replica's worker was seen waiting
    10 minutes there behind its busy sibling;
    vLLM's CPU guide gives each instance its own VLLM_CPU_OMP_THREADS_BIND instead. Contiguous equal shares, or one
    core each in turn when there are more replicas than cores."""
    if replicas < 2:
        return None
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < replicas:
        return str(cores[index % len(cores)])
    share = len(cores) // replicas
    return ",".join(str(c) for c in cores[index * share:(index + 1) * share])


VLLM_CPU_BATCHED_TOKENS = 4096
"""vLLM-CPU's own default token budget per engine step (its LLM class)."""


def sampler_prefill(device: DeviceKind, chunked: bool | None, batched_tokens: int | None,
                    max_model_len: int) -> tuple[bool | None, int | None, bool]:
    """(enable_chunked_prefill, max_num_batched_tokens, seeds_safe) for the engine. vLLM-CPU cannot rewind a
    seeded request's generator after a split prefill: the engine dies ("CPU Generator does not use offset"), so a
    seeded rollout with long prompts took the replica down. On CPU, unless asked otherwise, prefills are not split
    (the budget then covers a whole max_model_len); where they are, seeded requests must be refused."""
    if device != "cpu":
        return chunked, batched_tokens, True
    if chunked is False or (chunked is None and (batched_tokens is None or batched_tokens >= max_model_len)):
        return False, batched_tokens or max(max_model_len, VLLM_CPU_BATCHED_TOKENS), True
    return chunked, batched_tokens, False


def learner_env(device: DeviceKind, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment defaults for the learner: on Ascend, expandable segments against fragmentation."""
    env = dict(os.environ if environ is None else environ)
    if device == "npu":
        return {"PYTORCH_NPU_ALLOC_CONF": env.get("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")}
    return {}


TCMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/libtcmalloc_minimal.so.4", "/usr/local/lib/libtcmalloc_minimal.so.4")
"""Where distributions put gperftools' tcmalloc (Debian and Ubuntu: libtcmalloc-minimal4)."""


def find_tcmalloc() -> str | None:
    for pattern in TCMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def preloaded_allocator(environ: dict[str, str] | None = None) -> str | None:
    """The malloc replacement LD_PRELOAD names (tcmalloc, jemalloc, mimalloc, ...), if any."""
    env = os.environ if environ is None else environ
    return next((lib for lib in env.get("LD_PRELOAD", "").split(":") if "malloc" in lib), None)


def host_allocator_env(device: DeviceKind, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a CPU learner re-executes itself with so that it runs on tcmalloc, where the system has it
    ({} when nothing changes). A training step frees and reallocates gigabytes of activations and gradients; glibc's
    heap keeps the freed holes, tcmalloc reuses them: on the demo's learner update (2 cores) peak memory 6.4 -> 3.9
    GB with LoRA and 5.1 -> 4.6 GB without, and the update 11-12% faster (docs/lora.md). vLLM's CPU backend
    recommends the same allocator. DGRPO_CPU_ALLOCATOR=system keeps glibc's; an LD_PRELOAD that already names an
    allocator is left as it is."""
    env = os.environ if environ is None else environ
    preload = env.get("LD_PRELOAD", "")
    if device != "cpu" or env.get("DGRPO_CPU_ALLOCATOR", "tcmalloc") == "system" or preloaded_allocator(env):
        return {}
    path = find_tcmalloc()
    if path is None:
        return {}
    # tcmalloc reports every allocation above 1 GiB on stderr (vLLM's KV cache, a big model's weights): not news.
    return {"LD_PRELOAD": f"{path}:{preload}" if preload else path,
            "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": env.get("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))}


def visible_devices(device: DeviceKind, environ: dict[str, str] | None = None) -> list[int] | None:
    """Device indices this process may use, from ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES (None: all)."""
    env = os.environ if environ is None else environ
    name = VISIBLE_DEVICES_ENV[device]
    if name is None or not env.get(name, "").strip():
        return None
    return [int(x) for x in env[name].split(",") if x.strip()]
