"""LoRA on the learner with PEFT: wrap the policy, name what trains, and produce what each version publishes.

With `learner.lora.rank > 0` the actor (learner/update/actor.py) wraps its policy here: PEFT adds the adapter, the base
model is frozen (stored in bf16 when the actor computes in bf16, so it costs half the memory), and only the adapter's
parameters reach AdamW. The KL reference is the same model with the adapter switched off (`reference_mode`), so no
second model is loaded. Each version publishes either the adapter alone (PEFT's saved names and
adapter_config.json, dgrpo.weights.lora) or, with `merge_on_sync`, the merged full weights, computed out of place so
the frozen base never drifts.

PEFT: https://huggingface.co/docs/peft/developer_guides/lora ; TRL's GRPOTrainer takes the same `peft_config`
(https://huggingface.co/docs/trl/grpo_trainer), verl the same rank/alpha/target_modules
(https://verl.readthedocs.io/en/latest/advance/ppo_lora.html).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dgrpo.common.config import ConfigError
from dgrpo.weights.config import LoraConfig
from dgrpo.weights.gather import DEFAULT_BUCKET_BYTES, full_tensors

log = logging.getLogger(__name__)

ADAPTER = "default"
"""PEFT's adapter name; it appears in parameter names (`lora_A.default.weight`) but not in saved ones."""
PEFT_PREFIX = "base_model.model."


def _require_peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("learner.lora.rank > 0 needs the peft package: pip install 'dgrpo[lora]'") from None
    return peft


def _linear_suffixes(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_target_modules(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Every listed target module must name a linear layer of the model (PEFT alone only fails when none does)."""
    if not isinstance(cfg.target_modules, list):
        return
    names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ConfigError(
            f"learner.lora.target_modules: {missing} match no linear layer of the model; its linear layers are "
            f"{sorted(_linear_suffixes(model))} (or use 'all-linear')")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, base_dtype: torch.dtype) -> torch.nn.Module:
    """The policy wrapped by PEFT: base frozen in `base_dtype`, adapter weights trainable in fp32."""
    peft = _require_peft()
    check_target_modules(model, cfg)
    model.to(base_dtype)
    config = peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=cfg.target_modules, bias="none", task_type="CAUSAL_LM")
    try:
        # autocast_adapter_dtype: adapter weights in fp32 over a bf16 base (PEFT's default).
        wrapped = peft.get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as e:  # e.g. all-linear on a model without linear layers
        raise ConfigError(f"learner.lora.target_modules={cfg.target_modules!r}: {e}") from None
    for p in wrapped.parameters():
        if p.requires_grad and p.dtype != torch.float32:  # fp32 master weights for what AdamW updates
            p.data = p.data.float()
    trainable, frozen = count_parameters(wrapped)
    log.info("LoRA rank %d, alpha %g: %.2fM adapter parameters train over a frozen %.0fM base; each version "
             "publishes %s", cfg.rank, cfg.alpha, trainable / 1e6, frozen / 1e6,
             "the merged full weights (merge_on_sync)" if cfg.merge_on_sync else "the adapter alone")
    return wrapped


def adapter_config_json(model: torch.nn.Module) -> str:
    """PEFT's adapter_config.json of the wrapped policy (target modules resolved, e.g. all-linear to names)."""
    config = model.peft_config[ADAPTER].to_dict()
    targets = config["target_modules"]
    if not isinstance(targets, str):  # all-linear resolves to full module paths: their suffixes match the same set
        config["target_modules"] = sorted({t.rsplit(".", 1)[-1] for t in targets})
    return json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set) else str(o), sort_keys=True)


def saved_name(name: str) -> str:
    """A parameter's name as PEFT saves it (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`)."""
    return name.replace(f".{ADAPTER}.", ".")


def adapter_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT saved name, full tensor) of every adapter weight, as `adapter_model.safetensors` holds them."""
    for name, tensor in full_tensors(model, bucket_bytes=bucket_bytes, dtype=dtype, trainable_only=True):
        yield saved_name(name), tensor


def adapter_layout(model: torch.nn.Module) -> list[tuple[str, list[int]]]:
    return [(saved_name(n), list(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def base_name(name: str) -> str:
    """A base parameter's checkpoint name (`base_model.model.X.base_layer.weight` -> `X.weight`)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def merged_layout(model: torch.nn.Module) -> list[tuple[str, list[int]]]:
    return [(base_name(n), list(p.shape)) for n, p in model.named_parameters() if not p.requires_grad]


@torch.no_grad()
def merged_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, base + (alpha / r) * B @ A) of every base weight, computed out of place in fp32 (single
    device): what `merge_and_unload` would give, without touching the frozen base (TRL merges and unmerges it in
    place, which a bf16 base does not survive exactly)."""
    deltas = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and ADAPTER in getattr(module, "lora_A", {}):
            deltas[f"{module_name}.base_layer.weight"] = module
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        tensor = param.detach()
        module = deltas.get(name)
        if module is not None:
            tensor = tensor.float() + module.get_delta_weight(ADAPTER).float()
        yield base_name(name), tensor.to(dtype) if dtype is not None else tensor


@contextmanager
def reference_mode(model: torch.nn.Module):
    """The base model: the wrapped policy with its adapter switched off (the KL reference)."""
    with model.disable_adapter():
        yield model


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable adapter parameters, frozen base parameters)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable
