"""LoRA settings for `dgrpo import-config`: verl's `actor_rollout_ref.model.lora_*` keys and TRL's PEFT arguments
(`use_peft`, `lora_r`, ... of TRL's ModelConfig, which its scripts and open-r1 recipes take), onto `learner.lora`.

verl: https://verl.readthedocs.io/en/latest/advance/ppo_lora.html (lora_rank > 0 turns LoRA on; lora_alpha,
target_modules default all-linear). TRL: https://huggingface.co/docs/trl/peft_integration (use_peft with lora_r 16,
lora_alpha 32, lora_dropout 0.05; lora_target_modules unset takes PEFT's per-architecture default).
"""

from __future__ import annotations

from typing import Any

M = "actor_rollout_ref.model."
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]
"""PEFT's default target modules for Llama / Qwen / Mistral-style models when none are given
(peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)."""
R = "actor_rollout_ref.rollout."
VERL_SAME = {M + "use_shm": None, M + "layered_summon": None, R + "layered_summon": None,
             M + "lora_adapter_path": (None,)}
VERL_REASONS = {
    M + "use_shm": "how verl loads the base model for its colocated rollout; samplers here load model.path",
    M + "layered_summon": "how verl gathers FSDP LoRA weights for its rollout; dgrpo publishes the adapter alone",
    R + "layered_summon": "how verl gathers FSDP LoRA weights for its rollout; dgrpo publishes the adapter alone",
    M + "lora_adapter_path": "starting from a saved adapter is not offered: training starts from a fresh adapter",
    M + "exclude_modules": "exclude_modules is not offered: list learner.lora.target_modules instead",
}
TRL_SAME = {"lora_task_type": ("CAUSAL_LM",), "use_rslora": (False,), "use_dora": (False,),
            "lora_modules_to_save": (None, []), "load_in_4bit": (False,), "load_in_8bit": (False,)}
TRL_REASONS = {
    "lora_task_type": "the policy is a causal LM", "use_rslora": "rank-stabilised LoRA is not offered",
    "use_dora": "DoRA is not offered (vLLM serves plain LoRA)",
    "lora_modules_to_save": "modules_to_save is not offered (vLLM serves LoRA factors only)",
    "load_in_4bit": "QLoRA (a quantized base) is not offered",
    "load_in_8bit": "QLoRA (a quantized base) is not offered",
}


def _targets(v: Any) -> str | list[str]:
    if isinstance(v, str) and "," in v:
        return [m.strip() for m in v.split(",") if m.strip()]
    return v if isinstance(v, str) else [str(m) for m in v]


def verl_lora(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    """verl's LoRA keys into `out` (an import_config.Imported); every key read is added to `used`."""
    rank = flat.get(M + "lora_rank")
    if rank is None:
        return
    used.update(k for k in (M + "lora_rank", M + "lora_alpha", M + "target_modules") if k in flat)
    if int(rank) <= 0:
        out.ignored[M + "lora_rank"] = "0: full fine-tuning, as learner.lora.rank=0"
        return
    out.set("learner.lora.rank", int(rank), M + "lora_rank")
    out.set("learner.lora.alpha", float(flat.get(M + "lora_alpha", 16)),
            M + "lora_alpha" if M + "lora_alpha" in flat else "(verl's default lora_alpha 16)")
    out.set("learner.lora.target_modules", _targets(flat.get(M + "target_modules", "all-linear")),
            M + "target_modules" if M + "target_modules" in flat else "(verl's default target_modules all-linear)")


def trl_lora(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    """TRL's PEFT arguments into `out`; without use_peft TRL ignores the lora_* keys, and so does this."""
    keys = ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    if not flat.get("use_peft"):
        for k in keys:
            if k in flat:
                used.add(k)
                out.ignored[k] = "use_peft is false: TRL trains the full model and ignores the lora_* settings"
        return
    used.update(k for k in keys if k in flat)
    out.set("learner.lora.rank", int(flat.get("lora_r", 16)), "lora_r" if "lora_r" in flat else "(TRL's lora_r 16)")
    out.set("learner.lora.alpha", float(flat.get("lora_alpha", 32)),
            "lora_alpha" if "lora_alpha" in flat else "(TRL's lora_alpha 32)")
    out.set("learner.lora.dropout", float(flat.get("lora_dropout", 0.05)),
            "lora_dropout" if "lora_dropout" in flat else "(TRL's lora_dropout 0.05)")
    targets = flat.get("lora_target_modules")
    out.set("learner.lora.target_modules", _targets(targets) if targets else PEFT_DEFAULT_TARGETS,
            "lora_target_modules" if targets else "(PEFT's default for Llama-style models: q_proj, v_proj)")
