"""Sampler configuration: where it listens and how its vLLM engine is built."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dgrpo.common.config import StrictConfig


class SamplerConfig(StrictConfig):
    """One sampler replica (vLLM / vllm-ascend engine behind gRPC)."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds. Loopback by default: only this host can call it; `0.0.0.0` (all interfaces, e.g.
    inside a container) together with a token (`auth.token_file` or DGRPO_TOKEN; docs/security.md)."""
    port: int = Field(default=50051, ge=0, le=65535)
    """gRPC port (0: pick a free one and print it)."""
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the Prometheus `/metrics` endpoint (unset: none; 0: any free port, logged): this replica's
    `dgrpo_sampler_*` series and vLLM's own `vllm:*` engine metrics (docs/sampler.md)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds. Loopback by default; `0.0.0.0` for a Prometheus in another container or
    host (it serves counts and timings, no prompts, and takes no token)."""
    replica_id: str | None = None
    """Name of this replica in Info, logs and metrics (unset: hostname:port)."""
    addresses: list[str] = Field(default_factory=lambda: ["localhost:50051"])
    """Where clients (the learner, `dgrpo up`) find the replicas: host:port entries, or one `dns:///name:port`
    that resolves to every replica (docker compose --scale)."""

    # --- engine (vLLM EngineArgs; same names as `vllm serve`) ---
    max_model_len: int = Field(default=2048, ge=16)
    """Longest prompt + completion in tokens; bounds the KV cache per sequence."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Share of device memory for weights + KV cache (a dedicated sampler device can go to 0.9)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Devices the model is split over (tensor parallel)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills into chunks (lower memory peak on long prompts, slower on short). Unset: vLLM's default,
    except on CPU: off (a seeded request whose prefill is split kills vLLM-CPU's engine; common/devices.py), with
    max_num_batched_tokens raised to max_model_len. Set true on CPU and seeded requests are refused."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of a shared prefix — the n samples of a GRPO group share their prompt."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Sequences the engine runs at once (continuous batching width)."""
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    """Token budget of one engine step (unset: vLLM default)."""
    attention_backend: str | None = None
    """vLLM attention backend name (e.g. FLASH_ATTN, TRITON_ATTN; unset: vLLM picks per device)."""
    enforce_eager: bool = False
    """Skip graph capture / compilation: much faster start (~25 s vs ~2.5 min on CPU), slower decode."""
    seed: int = 0
    """Engine seed."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which distribution the returned logprobs come from. processed: after temperature (and top-k/top-p), the
    distribution tokens are drawn from, which the learner reproduces; raw: the model's own softmax."""
    kv_cache_space_gib: int | None = Field(default=None, ge=1)
    """CPU backend only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE; default 1 GiB here)."""
    cpu_cores: str = Field(default="auto", pattern=r"^(auto|all|[0-9][0-9,\-]*)$")
    """CPU backend only: the cores vLLM's worker runs its OpenMP threads on (VLLM_CPU_OMP_THREADS_BIND).
    auto: vLLM's choice, which keeps a core for its scheduler process (on 2 cores: one compute thread); all:
    every core this process may use, for a host where sampler and learner take turns, as in the synchronous
    loop (decode 1.4x faster on 2 cores); or a list such as 0-3 or 0,2,4."""

    # --- serving ---
    max_prompts_per_request: int = Field(default=4096, ge=1)
    """Largest batch one Generate call may carry."""
    max_prompt_chars: int | None = Field(default=None, ge=1)
    """Longest text prompt (a chat counts the characters of all its messages) accepted for tokenization; longer ones
    are refused with INVALID_ARGUMENT naming the prompt, before any tokenizer time is spent. Unset: 16 characters per
    token of `max_model_len` — no prompt that fits the context is that long unless its tokens average over 16
    characters (long runs of spaces in code can; raise it for such data). Token-id prompts are bounded by
    `max_model_len` alone."""
    weight_wait_timeout_s: float = Field(default=120.0, gt=0)
    """Default bound on waiting for `min_weight_version` before answering DEADLINE_EXCEEDED."""
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    """On SIGTERM: seconds in-flight streams may finish before they are aborted."""

    @property
    def prompt_char_limit(self) -> int:
        """`max_prompt_chars`, or its default of 16 characters per token of `max_model_len`."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else 16 * self.max_model_len
