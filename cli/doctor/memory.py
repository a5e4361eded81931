"""`dgrpo plan`'s memory model: bytes per device of each service, from the model's config.json and the config's knobs.

No weights are loaded: the parameter count comes from the safetensors headers when the folder has them, else from
config.json's shapes. Every term names its formula and source; benchmarks/bench_plan.py checks the sum against the
peak memory measured on this machine (docs/doctor.md has the figures). When something does not fit, the plan names
the knob to turn first, in the seeds' order of preference: a smaller micro-batch (gradient accumulation keeps the
effective batch) before gradient checkpointing, before more learner ranks (FSDP shards the states); for a sampler,
more `gpu_memory_utilization` on its dedicated device before a shorter context, before tensor parallelism.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dgrpo.common import preflight as pf
from dgrpo.common.config import ConfigError
from dgrpo.common.models import model_dir
from dgrpo.weights.transports import transport_for

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_DEFAULT_BATCHED_TOKENS = 8192
"""vLLM's max_num_batched_tokens for serving when unset (its profile run's forward is this many tokens)."""
RUNTIME = {"cpu": 0.6 * GiB, "cuda": 1.0 * GiB, "npu": 2.0 * GiB}
"""Per process, outside the tensors counted here: the interpreter with torch and transformers (CPU: measured here,
~0.6 GB RSS), the CUDA context, the NPU context plus HCCL buffers (HCCL_BUFFSIZE 200 MB per communicator, x2)."""
SAMPLER_RUNTIME = {"cpu": 2.2 * GiB, "cuda": 1.0 * GiB, "npu": 1.5 * GiB}
"""vLLM outside weights and KV: CPU: API process + engine core with torch, transformers and oneDNN's repacked
weights (measured here: bench_plan); GPU/NPU: graph capture memory (0 with enforce_eager) and the non-torch
allocations vLLM itself reserves around its budget."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from config.json (the text model's, for multimodal configs)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    params: int
    params_from: str

    @property
    def layer_params(self) -> int:
        """One decoder layer: q, o (hidden x heads*head_dim), k, v (hidden x kv_heads*head_dim), the gated MLP
        (3 x hidden x intermediate), two norms."""
        q = self.hidden * self.heads * self.head_dim
        kv = self.hidden * self.kv_heads * self.head_dim
        return 2 * q + 2 * kv + 3 * self.hidden * self.intermediate + 2 * self.hidden


def read_shape(folder: str | Path) -> ModelShape:
    """config.json -> ModelShape; the parameter count from the safetensors headers when there are weights."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model.path={str(folder)!r} is not a Hugging Face folder (no config.json there)")
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    cfg = cfg.get("text_config", cfg) | {k: v for k, v in cfg.items() if k == "tie_word_embeddings"}
    try:
        hidden, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
        vocab, inter = cfg["vocab_size"], cfg.get("intermediate_size", 4 * cfg["hidden_size"])
    except KeyError as e:
        raise ConfigError(f"{path} has no {e.args[0]}: not a decoder-only transformer config dgrpo plan reads") \
            from None
    shape = ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                       head_dim=cfg.get("head_dim") or hidden // heads, intermediate=inter, vocab=vocab,
                       tied=bool(cfg.get("tie_word_embeddings", False)), params=0, params_from="")
    counted = pf.parameter_count(folder)
    formula = layers * shape.layer_params + vocab * hidden * (1 if shape.tied else 2) + hidden
    params, source = (counted, "safetensors headers") if counted else (formula, "config.json shapes")
    return ModelShape(**{**shape.__dict__, "params": params, "params_from": source})


@dataclass
class Term:
    name: str
    bytes: float
    formula: str


@dataclass
class ServicePlan:
    """Memory of one service per device."""

    service: str
    devices: int
    """Devices it spans (learner ranks; a sampler's tensor_parallel_size)."""
    terms: list[Term]
    device_bytes: int | None
    """Memory of one device (None: unknown)."""
    budget: float | None = None
    """What the service may use of the device (a sampler: gpu_memory_utilization x memory)."""
    problem: str = ""
    fix: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool:
        if self.problem:
            return False
        limit = self.budget if self.budget is not None else self.device_bytes
        return limit is None or self.total <= limit

    def as_dict(self) -> dict[str, Any]:
        return {"service": self.service, "devices": self.devices, "total_bytes": int(self.total),
                "device_bytes": self.device_bytes, "budget_bytes": None if self.budget is None else int(self.budget),
                "fits": self.fits, "problem": self.problem, "fix": self.fix, "notes": self.notes,
                "terms": [{"name": t.name, "bytes": int(t.bytes), "formula": t.formula} for t in self.terms]}


# ---- learner -------------------------------------------------------------------------------------------------------


def layer_activation_bytes(m: ModelShape, dtype: str, device: str = "cuda") -> float:
    """Bytes one decoder layer keeps for backward per token. The form is Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models": 34·h per token and layer for a 4h MLP, 16-bit, with no
    stored attention matrix), with the coefficients counted here on transformers' Llama layer as the learner runs it
    (torch.autograd.graph.saved_tensors_hooks, weights excluded; tests/test_plan.py re-counts them):
    float32: 46·h + 16·I (the gated MLP's gate, up, silu(gate) and product at 4 B; per RMSNorm its input and
    output; q, k, v after repeat_kv, so at the full head count: no term in the KV width; the attention output).
    bfloat16 autocast: 46·h + 8·I on CPU, where the block attention runs in fp32 (devices.fp32_attention_backward:
    its fp32 q, k, v and output are kept), 38·h + 8·I elsewhere, where sdpa runs in bf16 (counted on CPU while
    autocast still cast sdpa's inputs to bf16 there; not re-counted on a device)."""
    h, inter = m.hidden, m.intermediate
    if dtype == "float32":
        return 46 * h + 16 * inter
    return (46 if device == "cpu" else 38) * h + 8 * inter


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama-style decoder layer: what `all-linear` targets (PEFT excludes the output head)."""


def lora_module_dims(m: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {"q_proj": (m.hidden, q), "k_proj": (m.hidden, kv), "v_proj": (m.hidden, kv), "o_proj": (q, m.hidden),
            "gate_proj": (m.hidden, m.intermediate), "up_proj": (m.hidden, m.intermediate),
            "down_proj": (m.intermediate, m.hidden)}


def lora_params(m: ModelShape, rank: int, target_modules: str | list[str]) -> int:
    """Adapter parameters: per targeted linear layer r x (in + out) (A is r x in, B is out x r; Hu et al. 2021)."""
    dims = lora_module_dims(m)
    names = LORA_MODULES if isinstance(target_modules, str) else [t.rsplit(".", 1)[-1] for t in target_modules]
    return m.layers * sum(rank * sum(dims[n]) for n in names if n in dims)


def micro_batch_tokens(cfg: Any) -> tuple[int, int]:
    """(tokens of one training micro-batch, of which positions predict a completion token), at the longest
    prompt and response the config allows."""
    a, p, r, n = cfg.learner.actor, cfg.learner.data.max_prompt_length, cfg.learner.rollout.max_response_length, \
        cfg.learner.rollout.n
    if a.use_dynamic_bsz:
        # Packing takes whole units: a group block (its prompt once, then n completions) with shared prompts, one
        # sequence otherwise; a unit longer than the budget gets a micro-batch of its own.
        budget = a.max_tokens_per_micro_batch
        unit, kept = (p + n * r, n * r) if a.share_prompts else (p + r, r)
        if unit > budget and a.share_prompts:  # a group longer than the budget is cut: its prompt + k completions
            k = max(1, (budget - p) // r)
            return p + k * r, k * r
        units = max(1, budget // unit)
        return units * unit, units * kept
    return a.micro_batch_size_per_device * (p + r), a.micro_batch_size_per_device * r


def learner_terms(m: ModelShape, cfg: Any, ranks: int, device: str, tokens: int | None = None,
                  checkpointing: bool | None = None) -> list[Term]:
    """Per-rank bytes of the learner. Weights, gradients and AdamW's two moments are fp32 (master weights:
    4 + 4 + 8 = 16 bytes per parameter, ZeRO's K=12 plus fp32 gradients; Rajbhandari et al. 2020), sharded over
    the ranks by FSDP2 (ZeRO-3)."""
    a, P, W = cfg.learner.actor.on_device(device), m.params, ranks  # dtype auto: as decided on this host's kind
    if tokens is None:
        tokens, kept = micro_batch_tokens(cfg)
    else:
        kept = math.ceil(tokens * micro_batch_tokens(cfg)[1] / micro_batch_tokens(cfg)[0])
    ckpt = a.gradient_checkpointing if checkpointing is None else checkpointing
    lora = cfg.learner.lora
    if lora.enabled:  # PEFT: frozen base (bf16 under bf16 compute), fp32 adapter with its gradients and moments
        A = lora_params(m, lora.rank, lora.target_modules)
        base_b = 4 if a.dtype == "float32" else 2
        out = [Term(f"frozen base {'fp32' if base_b == 4 else 'bf16'}", base_b * P / W,
                    f"{base_b} B x {P / 1e6:.0f}M params / {W} rank(s) (learner.lora: no gradients, no AdamW)"),
               Term("LoRA adapter fp32", 4 * A / W, f"4 B x {A / 1e6:.2f}M adapter params (rank {lora.rank})"),
               Term("adapter gradients fp32", 4 * A / W, "4 B x adapter params / ranks"),
               Term("adapter AdamW moments fp32", 8 * A / W, "2 x 4 B x adapter params / ranks")]
    else:
        out = [Term("weights fp32", 4 * P / W, f"4 B x {P / 1e6:.0f}M params / {W} rank(s)"),
               Term("gradients fp32", 4 * P / W, "4 B x params / ranks"),
               Term("AdamW moments fp32", 8 * P / W, "2 x 4 B x params / ranks (exp_avg, exp_avg_sq)")]
    if cfg.learner.algorithm.beta > 0 and not lora.enabled:  # LoRA: the reference is the base, adapter off
        out.append(Term("reference fp32", 4 * P / W, "algorithm.beta > 0: a frozen fp32 copy, sharded alike"))
    if W > 1:
        gathered = 4 * P * (W - 1) / W if not a.fsdp_reshard_after_forward else 2 * 2 * 4 * m.layer_params
        out.append(Term("FSDP gathered", gathered, "reshard_after_forward: 2 layers gathered + 2 unsharded layer "
                        "gradients (fp32)" if a.fsdp_reshard_after_forward else "ZeRO-2: whole model gathered"))
    if a.dtype == "bfloat16" and not lora.enabled and a.bf16_weights == "published" and W == 1:  # else autocast
        out.append(Term("bf16 compute copy", 2 * P, "learner/update/compute_copy.py: the 2 B weights forwards run on"))
        out.append(Term("bf16 copy gradients", 2 * P, "2 B x params: one micro-batch's, before they join the fp32 "
                        "gradients"))
    elif a.dtype == "bfloat16" and not lora.enabled:  # (a LoRA base is stored in bf16: nothing to cast)
        cast = P - m.vocab * m.hidden  # the embedding is looked up, not cast
        out.append(Term("autocast bf16 weights", 2 * cast / W if W == 1 else 2 * 2 * m.layer_params,
                        "the 2 B copy of each matmul weight autocast makes, kept for backward"))
    per_layer = layer_activation_bytes(m, a.dtype, device)
    if ckpt:
        act = Term("activations", tokens * (m.layers * 4 * m.hidden + per_layer),
                   f"{tokens} tokens x (layers x 4·h fp32 layer inputs + one layer recomputed): checkpointing")
    else:
        act = Term("activations", tokens * m.layers * per_layer,
                   f"{tokens} tokens x {m.layers} layers x {per_layer / 1e3:.1f} kB/token/layer")
    out.append(act)
    saved = 8 if a.dtype == "float32" else 6  # counted like the layers: fp32 rows for logsumexp (+ 16-bit logits)
    out.append(Term("logits", saved * kept * m.vocab, f"{kept} completion positions x {saved} B x vocab {m.vocab} "
                    "(saved for backward)"))
    out.append(Term("logits backward", 4 * kept * m.vocab, "the fp32 gradient of those rows, alive during backward"))
    out.append(Term("runtime", RUNTIME[device], "interpreter, torch, device context (measured / vendor defaults)"))
    return out


def plan_learner(m: ModelShape, cfg: Any, ranks: int, device: str, device_bytes: int | None) -> ServicePlan:
    sp = ServicePlan("learner", ranks, learner_terms(m, cfg, ranks, device), device_bytes)
    if device_bytes is None or sp.total <= device_bytes:
        return sp
    a = cfg.learner.actor
    sp.problem = f"{pf.fmt_bytes(sp.total)} per rank exceeds {pf.fmt_bytes(device_bytes)}"
    fixed = sum(t.bytes for t in learner_terms(m, cfg, ranks, device, tokens=1))
    per_token = sum(t.bytes for t in learner_terms(m, cfg, ranks, device, tokens=1001)) - fixed
    seq = cfg.learner.data.max_prompt_length + cfg.learner.rollout.max_response_length
    room = (device_bytes - fixed) / (per_token / 1000) if per_token else 0
    if room >= seq:  # 1. a smaller micro-batch: gradient accumulation keeps the effective batch
        if a.use_dynamic_bsz:
            sp.fix = f"learner.actor.max_tokens_per_micro_batch={int(room // 16 * 16)} (micro-batches accumulate)"
        else:
            sp.fix = f"learner.actor.micro_batch_size_per_device={max(1, int(room // seq))} (gradients accumulate)"
        return sp
    ckpt_total = sum(t.bytes for t in learner_terms(m, cfg, ranks, device, tokens=seq, checkpointing=True))
    if not a.gradient_checkpointing and ckpt_total <= device_bytes:  # 2. recompute activations (~30% compute)
        sp.fix = "learner.actor.gradient_checkpointing=true" + (
            " and learner.actor.max_tokens_per_micro_batch=" + str(seq) if a.use_dynamic_bsz else
            " and learner.actor.micro_batch_size_per_device=1")
        return sp
    for w in (2, 4, 8, 16, 32, 64, 128):  # 3. more ranks: FSDP shards weights, gradients, AdamW states
        if w > ranks and sum(t.bytes for t in learner_terms(m, cfg, w, device, tokens=seq, checkpointing=True)) \
                <= device_bytes:
            sp.fix = (f"{w} learner ranks (torchrun --nproc-per-node {w}) with gradient_checkpointing=true and one "
                      "sequence per micro-batch")
            return sp
    sp.fix = "the model does not fit even on 128 ranks; dgrpo has no CPU offload of parameters or AdamW states yet"
    return sp


# ---- sampler -------------------------------------------------------------------------------------------------------


def kv_bytes_per_token(m: ModelShape, dtype: str, tp: int = 1) -> int:
    """vLLM's KV cache per token and device: 2 (K and V) x layers x KV heads x head_dim x dtype bytes; KV heads are
    split over tensor-parallel ranks (replicated when fewer than the ranks)."""
    return 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * DTYPE_BYTES[dtype]


def _lora_serving(m: ModelShape, cfg: Any, device: str) -> list[Term]:
    """vLLM with LoRA keeps one adapter slot (max_loras 1) of max_lora_rank for every targeted module."""
    lora = cfg.learner.lora.on_device(device)
    if not lora.serves_adapters:
        return []
    A = lora_params(m, lora.vllm_max_lora_rank, lora.target_modules)
    size = DTYPE_BYTES[cfg.model.dtype]
    return [Term("LoRA slot", A * size / cfg.sampler.tensor_parallel_size,
                 f"max_lora_rank {lora.vllm_max_lora_rank} x (in + out) of each targeted module x {size} B")]


def plan_sampler(m: ModelShape, cfg: Any, device: str, device_bytes: int | None) -> ServicePlan:
    s, dtype = cfg.sampler, cfg.model.dtype
    tp = s.tensor_parallel_size
    weights = m.params * DTYPE_BYTES[dtype] / tp
    per_token = kv_bytes_per_token(m, dtype, tp)
    batched = s.max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS
    act = batched * (6 * m.hidden + 4 * m.intermediate) * DTYPE_BYTES[dtype] / tp + 2 * 4 * s.max_num_seqs * m.vocab
    terms = [Term("weights", weights, f"{m.params / 1e6:.0f}M params x {DTYPE_BYTES[dtype]} B ({dtype}) / TP {tp}"),
             *_lora_serving(m, cfg, device),
             Term("activations (profile)", act, f"max_num_batched_tokens {batched} x (6·h + 4·I) x dtype / TP + "
                  f"max_num_seqs {s.max_num_seqs} x vocab x 8 B (fp32 logits, sampler)")]
    runtime = 0.0 if s.enforce_eager and device != "cpu" else SAMPLER_RUNTIME[device]
    terms.append(Term("runtime", runtime, "vLLM outside weights and KV (CPU: processes and oneDNN copies; GPU/NPU: "
                      "graphs)" if runtime else "enforce_eager: no graph memory"))
    if device == "cpu":
        kv = (s.kv_cache_space_gib or 1) * GiB
        budget, how = None, f"sampler.kv_cache_space_gib={s.kv_cache_space_gib or 1} (VLLM_CPU_KVCACHE_SPACE)"
    elif device_bytes is None:
        kv, budget, how = 0.0, None, "device memory unknown"
    else:
        budget = s.gpu_memory_utilization * device_bytes
        kv = max(0.0, budget - sum(t.bytes for t in terms))
        how = f"sampler.gpu_memory_utilization={s.gpu_memory_utilization} x {pf.fmt_bytes(device_bytes)} - the above"
    terms.append(Term("KV cache", kv, f"{how}; {per_token / 1e3:.1f} kB/token (2 x {m.layers} layers x "
                      f"{max(1, m.kv_heads // tp)} KV heads x {m.head_dim} x {DTYPE_BYTES[dtype]} B)"))
    sp = ServicePlan("sampler", tp, terms, device_bytes, budget)
    seq = cfg.learner.data.max_prompt_length + cfg.learner.rollout.max_response_length
    fit_tokens = int(kv // per_token)
    concurrent = fit_tokens // seq
    replicas = max(1, len(s.addresses))
    step_seqs = math.ceil(cfg.learner.data.train_batch_size * cfg.learner.rollout.n / replicas)
    sp.notes.append(f"KV cache holds {fit_tokens:,} tokens = {concurrent:,} sequences of {seq} (prompt + response); "
                    f"max_num_seqs={s.max_num_seqs}; a step sends ~{step_seqs} sequences per replica "
                    f"(train_batch_size x n / {replicas} replica(s)); groups of {cfg.learner.rollout.n} share their "
                    "prompt's KV with prefix caching")
    if device_bytes is not None and device != "cpu" and sum(t.bytes for t in terms[:-1]) > budget:
        sp.problem = (f"weights and activations ({pf.fmt_bytes(sum(t.bytes for t in terms[:-1]))}) exceed "
                      f"gpu_memory_utilization's {pf.fmt_bytes(budget)}")
    elif (device == "cpu" or device_bytes is not None) and fit_tokens < s.max_model_len:
        sp.problem = (f"the KV cache holds {fit_tokens:,} tokens, less than one sequence of sampler.max_model_len="
                      f"{s.max_model_len} (vLLM refuses to start)")
    if sp.problem:
        if device == "cpu":
            sp.fix = f"sampler.kv_cache_space_gib={math.ceil(s.max_model_len * per_token / GiB) + 1}"
        elif s.gpu_memory_utilization < 0.9:
            sp.fix = "sampler.gpu_memory_utilization=0.9 (a dedicated sampler device)"
        elif s.max_model_len > seq:
            sp.fix = f"sampler.max_model_len={seq} (prompt + response is all a rollout needs)"
        else:
            sp.fix = f"sampler.tensor_parallel_size={2 * tp} (splits weights and KV heads)"
    elif concurrent < min(s.max_num_seqs, step_seqs):
        sp.notes.append(f"only {concurrent} sequences fit at once (< max_num_seqs / the step's share): vLLM preempts "
                        "and recomputes; raise gpu_memory_utilization (kv_cache_space_gib on CPU) or lower "
                        "max_num_seqs")
    return sp


# ---- the stack -----------------------------------------------------------------------------------------------------


@dataclass
class StackPlan:
    model: ModelShape
    device: str
    learner: ServicePlan
    sampler: ServicePlan
    shm: Term | None
    host: ServicePlan | None = None
    """CPU: every service shares host memory; this adds them up (learner + samplers + slots)."""

    @property
    def fits(self) -> bool:
        parts = [self.learner, self.sampler] + ([self.host] if self.host else [])
        return all(p.fits for p in parts)

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "model": self.model.__dict__, "fits": self.fits,
                "learner": self.learner.as_dict(), "sampler": self.sampler.as_dict(),
                "shm": None if self.shm is None else {"bytes": int(self.shm.bytes), "formula": self.shm.formula},
                "host": None if self.host is None else self.host.as_dict()}


def plan_stack(cfg: Any, *, device: str, device_bytes: int | None, learner_ranks: int = 1,
               samplers: int | None = None) -> StackPlan:
    """The plan of `cfg` (a StackConfig) on `device` with `device_bytes` per device (the host's memory on CPU)."""
    m = read_shape(model_dir(cfg.model.path)) if cfg.model.path else _bundled_shape()
    learner = plan_learner(m, cfg, learner_ranks, device, None if device == "cpu" else device_bytes)
    sampler = plan_sampler(m, cfg, device, None if device == "cpu" else device_bytes)
    shm = _weight_slots(m, cfg, device)
    host = None
    if device == "cpu":
        n = samplers or max(1, len(cfg.sampler.addresses))
        terms = [Term("learner", learner.total, "the learner above"),
                 Term("samplers", n * sampler.total, f"{n} replica(s) x the sampler above")]
        if shm:
            terms.append(shm)
        host = ServicePlan("host", 1, terms, device_bytes)
        if device_bytes is not None and host.total > device_bytes:
            host.problem = f"the services together need {pf.fmt_bytes(host.total)}, the host has " \
                           f"{pf.fmt_bytes(device_bytes)}"
            half_budget = max(16, cfg.learner.actor.max_tokens_per_micro_batch // 2)
            host.fix = (f"learner.actor.max_tokens_per_micro_batch={half_budget}"
                        if cfg.learner.actor.use_dynamic_bsz else "learner.actor.micro_batch_size_per_device=1") + \
                " first, then fewer sampler replicas or a smaller sampler.kv_cache_space_gib"
    return StackPlan(m, device, learner, sampler, shm, host)


def _weight_slots(m: ModelShape, cfg: Any, device: str) -> Term | None:
    """/dev/shm the weight channel needs (docs/weight_sync.md): the learner's two slots (shm), the two slots of each
    sampler host's relay (collective), one staging copy per replica (tcp)."""
    if not cfg.weights.enabled:
        return None
    size, dtype = DTYPE_BYTES[cfg.model.dtype], cfg.model.dtype
    what, slots, place = transport_for(cfg.weights).shm_copies()
    if not slots:
        return None
    lora = cfg.learner.lora.on_device(device)
    if lora.serves_adapters:  # a version is the adapter alone
        A = lora_params(m, lora.rank, lora.target_modules)
        return Term("weight slots", slots * A * size,
                    f"{what} x {A / 1e6:.2f}M adapter params (learner.lora) x {size} B ({dtype}) {place}")
    return Term("weight slots", slots * m.params * size, f"{what} x params x {size} B ({dtype}) {place}")


def _bundled_shape() -> ModelShape:
    """The bundled model's shape, prepared or not (SmolLM2-135M-Instruct's config.json)."""
    folder = model_dir(None)
    if (folder / "config.json").is_file():
        return read_shape(folder)
    return ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152,
                      tied=True, params=134_515_008, params_from="SmolLM2-135M-Instruct's config (not prepared yet)")
