"""LoRA adapters: the adapter format both ends of the weight channel agree on (`learner.lora`, the settings, is
LoraConfig in weights/config.py).

The learner trains a LoRA adapter with PEFT (learner/update/lora.py) and, unless `merge_on_sync`, publishes only the
adapter: its tensors under PEFT's saved names (`base_model.model.<module>.lora_A.weight`, what
`peft.get_peft_model_state_dict` returns and `adapter_model.safetensors` holds) plus PEFT's `adapter_config.json`,
carried in the slot's manifest. Each sampler replica then runs vLLM with LoRA enabled and loads every version in
place (sampler/lora_target.py). Shared by learner and sampler, so it lives with the channel.

PEFT: https://huggingface.co/docs/peft/package_reference/lora ; vLLM: https://docs.vllm.ai/en/latest/features/lora.html
"""

from __future__ import annotations

import json
import re

ADAPTER_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
"""A published adapter tensor: PEFT's saved name of one LoRA factor of one base module."""


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
