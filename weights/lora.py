"""LoRA adapters: the `learner.lora` settings, and the adapter format both ends of the weight channel agree on.

The learner trains a LoRA adapter with PEFT (learner/lora.py) and, unless `merge_on_sync`, publishes only the
adapter: its tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`, what
`peft.get_peft_model_state_dict` returns and `adapter_model.safetensors` holds) plus PEFT's `adapter_config.json`,
carried in the slot's manifest. Each sampler replica then runs vLLM with LoRA enabled and loads every version in
place (sampler/lora_target.py). Shared by learner and sampler, so it lives with the channel, and imports only
pydantic: the config validates before torch is imported.

PEFT: https://huggingface.co/docs/peft/package_reference/lora ; vLLM: https://docs.vllm.ai/en/latest/features/lora.html
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import Field, field_validator

from dgrpo.common import devices
from dgrpo.common.config import StrictConfig

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `max_lora_rank` (vllm/config/lora.py, MaxLoRARanks)."""
ADAPTER_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
"""A published adapter tensor: PEFT's saved name of one LoRA factor of one base module."""


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


def adapter_base_module(name: str) -> tuple[str, str]:
    """(base module name as the checkpoint spells it, "A" or "B") of a published adapter tensor name; ValueError for
    a name that is not one."""
    m = ADAPTER_NAME.match(name)
    if m is None:
        raise ValueError(f"tensor {name!r} is not a LoRA factor (base_model.model.<module>.lora_A|lora_B.weight)")
    return m.group("module"), m.group("part")


def check_adapter(names_shapes: list[tuple[str, list[int]]], adapter_config: str,
                  base_shapes: dict[str, list[int]]) -> str | None:
    """What is wrong with an adapter version, checked against the base checkpoint's shapes, or None.

    Every tensor must be a LoRA factor of a 2-D weight of the checkpoint: lora_A [r, in], lora_B [out, r], with the
    rank of `adapter_config` (PEFT's adapter_config.json). Checked before anything is copied, as full weights are.
    """
    try:
        config = json.loads(adapter_config)
        rank = int(config["r"])
    except (ValueError, KeyError, TypeError) as e:
        return f"adapter_config is not PEFT's adapter_config.json with a rank 'r' ({e})"
    for name, shape in names_shapes:
        try:
            module, part = adapter_base_module(name)
        except ValueError as e:
            return str(e)
        base = base_shapes.get(f"{module}.weight")
        if base is None or len(base) != 2:
            return f"tensor {name!r}: {module}.weight is not a 2-D weight of the sampler's checkpoint"
        out_features, in_features = base
        expected = [rank, in_features] if part == "A" else [out_features, rank]
        if list(shape) != expected:
            return f"tensor {name!r} has shape {list(shape)}; rank {rank} over {module}.weight {base} needs {expected}"
    return None
