"""TRL -> dgrpo for `dgrpo import-config --from trl`: a GRPOConfig (its TrainingArguments included), translated key
by key; LoRA and open-r1's reward settings through cli/importers/lora.py and cli/importers/openr1.py (docs/peers.md)."""

from __future__ import annotations

import math
from typing import Any

from dgrpo.cli.importers import lora as import_lora
from dgrpo.cli.importers import openr1 as import_openr1
from dgrpo.cli.importers.common import Imported, Unsupported, _apply, _leftovers, _loggers, _run_name, _schedule
from dgrpo.common.config import ConfigError
from dgrpo.learner.update.config import TRL_LOSS_TYPES

TRL_RULES: dict[str, tuple[str, Any]] = {
    "model_name_or_path": ("model.path", None),
    "trust_remote_code": ("model.trust_remote_code", None),
    "learning_rate": ("learner.optim.lr", None),
    "adam_epsilon": ("learner.optim.eps", None),
    "max_grad_norm": ("learner.optim.grad_clip", None),
    "warmup_steps": ("learner.optim.warmup_steps", None),
    "num_generations": ("learner.rollout.n", None),
    "max_completion_length": ("learner.rollout.max_response_length", None),
    "max_prompt_length": ("learner.data.max_prompt_length", None),
    "temperature": ("learner.rollout.temperature", None),
    "top_p": ("learner.rollout.top_p", None),
    "top_k": ("learner.rollout.top_k", None),
    "min_p": ("learner.rollout.min_p", None),
    "beta": ("learner.algorithm.beta", None),
    "mask_truncated_completions": ("learner.algorithm.mask_truncated", None),
    "num_iterations": ("learner.actor.ppo_epochs", None),
    "seed": ("learner.data.seed", None),
    "shuffle_dataset": ("learner.data.shuffle", None),
    "output_dir": ("learner.checkpoint.dir", str),
    "save_total_limit": ("learner.checkpoint.keep_last", None),
    "report_to": ("learner.trainer.loggers", _loggers),
    "log_completions": ("learner.trainer.log_completions", None),
    "num_completions_to_print": ("learner.trainer.num_completions_to_print", None),
    "run_name": ("learner.trainer.run_name", _run_name),
    "gradient_checkpointing": ("learner.actor.gradient_checkpointing", None),
    "vllm_gpu_memory_utilization": ("sampler.gpu_memory_utilization", None),
    "vllm_tensor_parallel_size": ("sampler.tensor_parallel_size", None),
    "vllm_max_model_length": ("sampler.max_model_len", None),
    "vllm_max_model_len": ("sampler.max_model_len", None),
}
TRL_SAME: dict[str, Any] = {
    "use_vllm": None, "vllm_mode": None, "vllm_server_base_url": None, "vllm_server_host": None,
    "vllm_server_port": None, "vllm_server_timeout": None, "vllm_group_port": None, "logging_steps": None,
    "remove_unused_columns": None,
    "per_device_eval_batch_size": None, "repetition_penalty": (1, 1.0), "top_entropy_quantile": (1, 1.0),
    "sync_ref_model": (False,), "importance_sampling_level": ("token",), "fp16": (False,), "logging_dir": None,
    "save_strategy": None, "eval_strategy": None, "ds3_gather_for_generation": None, "bf16": None,
    **import_openr1.SAME, **import_lora.TRL_SAME,
}
TRL_REASONS = {
    "use_vllm": "samplers are always vLLM services", "vllm_mode": "samplers are separate services (sampler.addresses)",
    "vllm_server_base_url": "samplers are reached at sampler.addresses", "vllm_server_host": "sampler.addresses",
    "vllm_server_port": "sampler.addresses", "vllm_server_timeout": "learner.rollout.request_timeout_s",
    "vllm_group_port": "weights reach samplers through the weight channel (weights.*)",
    "logging_steps": "every step is logged",
    "remove_unused_columns": "extra columns always reach the reward functions",
    "per_device_eval_batch_size": "validation runs on the samplers",
    "repetition_penalty": "no repetition penalty in the samplers' requests",
    "top_entropy_quantile": "no entropy-quantile token mask",
    "sync_ref_model": "the reference stays the initial policy", "importance_sampling_level": "sequence-level "
    "ratios (GSPO) are not offered", "fp16": "fp16 autocast is not offered (learner.actor.dtype bfloat16/float32)",
    "logging_dir": "metrics go to learner.trainer.log_dir/run_name", "save_strategy": "learner.checkpoint.save_freq",
    "eval_strategy": "learner.trainer.test_freq", "ds3_gather_for_generation": "no DeepSpeed (FSDP2)",
    "bf16": "learner.actor.dtype is bfloat16 by default (bf16=false maps to float32)",
    "dataset_name": "dgrpo reads local parquet/jsonl (learner.data.train_files)",
    "reward_weights": "give each rewarder.spec.functions entry its weight",
    "disable_dropout": "dropout follows the model's config", "delta": "maps only when > 1 + epsilon_high",
    "generation_kwargs": "sampling takes temperature, top_p, top_k, min_p, stop only",
    "vllm_importance_sampling_correction": "only token_truncate maps (learner.algorithm.tis_cap)",
    "vllm_importance_sampling_mode": "only token_truncate maps (learner.algorithm.tis_cap)",
    "vllm_importance_sampling_cap": "only with vllm_importance_sampling_mode=token_truncate",
    "scale_rewards": "group, batch or none only",
    **import_openr1.REASONS, **import_lora.TRL_REASONS,
}


def from_trl(flat: dict[str, Any], num_processes: int = 1) -> Imported:
    out, used = Imported(), set()
    _apply(flat, out, TRL_RULES, used)
    g = flat.get("num_generations") or 8
    if "num_generations" not in flat:
        out.set("learner.rollout.n", 8, "(TRL's default num_generations)")
    eps = flat.get("epsilon", 0.2)
    high = flat.get("epsilon_high") if flat.get("epsilon_high") is not None else eps  # TRL: defaults to epsilon
    used.update({"epsilon", "epsilon_high"})
    if "epsilon" in flat:
        out.set("learner.algorithm.clip_low", eps, "epsilon")
    if flat.get("epsilon_high") is not None or "epsilon" in flat:
        out.set("learner.algorithm.clip_high", high,
                "epsilon_high" if flat.get("epsilon_high") is not None else "epsilon")
    delta = flat.get("delta")
    if delta is not None:
        used.add("delta")
        if delta > 1 + high:
            out.set("learner.algorithm.clip_ratio_c", float(delta),
                    "delta (= verl's dual clip when > 1 + epsilon_high)")
        else:
            out.unsupported["delta"] = f"{delta} <= 1 + epsilon_high: it would also clip positive advantages"
    loss_type = flat.get("loss_type", "dapo")
    used.add("loss_type")
    if loss_type in TRL_LOSS_TYPES:
        note = (" (over the whole mini-batch here; TRL's bnpo normalises each local batch)" if loss_type == "bnpo"
                else "")
        out.set("learner.algorithm.loss_agg", TRL_LOSS_TYPES[loss_type], f"loss_type={loss_type}{note}")
        if loss_type == "dr_grpo":
            out.set("learner.algorithm.loss_scale_factor", flat.get("max_completion_length") or 256,
                    "max_completion_length (dr_grpo's constant)")
    else:
        out.unsupported["loss_type"] = f"{loss_type!r} is not offered ({', '.join(TRL_LOSS_TYPES)})"
    if "scale_rewards" in flat:
        scale = {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}.get(
            flat["scale_rewards"])
        if scale:
            used.add("scale_rewards")
            out.set("learner.algorithm.adv_scale", scale, "scale_rewards")
    betas = [flat.get("adam_beta1", 0.9), flat.get("adam_beta2", 0.999)]
    used.update({"adam_beta1", "adam_beta2", "weight_decay", "lr_scheduler_type"})
    if "adam_beta1" in flat or "adam_beta2" in flat:
        out.set("learner.optim.betas", betas, "adam_beta1, adam_beta2")
    out.set("learner.optim.weight_decay", flat.get("weight_decay", 0.0),
            "weight_decay" if "weight_decay" in flat else "(transformers' default weight_decay)")
    try:
        out.set("learner.optim.schedule", _schedule(flat.get("lr_scheduler_type", "linear")),
                "lr_scheduler_type" if "lr_scheduler_type" in flat else "(transformers' default: linear decay)")
    except Unsupported as e:
        out.unsupported["lr_scheduler_type"] = str(e)
    if flat.get("bf16") is False and not flat.get("fp16"):
        used.add("bf16")
        out.set("learner.actor.dtype", "float32", "bf16=false")
    _trl_batches(flat, out, used, g, num_processes)
    _trl_tis(flat, out, used)
    if flat.get("save_steps") and flat.get("save_strategy", "steps") == "steps":
        used.add("save_steps")
        out.set("learner.checkpoint.save_freq", int(flat["save_steps"]), "save_steps")
    if flat.get("eval_steps") and flat.get("eval_strategy") == "steps":
        used.add("eval_steps")
        out.set("learner.trainer.test_freq", int(flat["eval_steps"]), "eval_steps")
    if "seed" in flat:
        out.set("learner.trainer.seed", flat["seed"], "seed")
    import_openr1.open_r1(flat, out, used)
    import_lora.trl_lora(flat, out, used)
    _leftovers(flat, out, used, TRL_SAME, TRL_REASONS, "no counterpart in dgrpo")
    return out


def _trl_batches(flat: dict, out: Imported, used: set[str], g: int, procs: int) -> None:
    """TRL counts completions per device and micro-step; dgrpo counts prompts per step and per update."""
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "max_steps", "num_train_epochs", "warmup_ratio")
    used.update(keys)
    per_dev, accum = flat.get("per_device_train_batch_size", 8), flat.get("gradient_accumulation_steps", 1)
    micro_step = per_dev * procs  # completions per micro-step over all processes
    gen = flat.get("generation_batch_size") or micro_step * (flat.get("steps_per_generation") or accum)
    update = micro_step * accum
    if gen % g or update % g or gen % update:
        raise ConfigError(
            f"per_device_train_batch_size={per_dev} x {procs} process(es) x gradient_accumulation_steps={accum} "
            f"= {update} completions per update and a generation batch of {gen} must be multiples of "
            f"num_generations={g}, the generation batch a multiple of the update (as TRL requires)"
        )
    out.set("learner.data.train_batch_size", gen // g, "generation batch / num_generations")
    out.set("learner.actor.ppo_mini_batch_size", update // g,
            "per_device_train_batch_size x processes x gradient_accumulation_steps / num_generations")
    out.set("learner.actor.micro_batch_size_per_device", per_dev, "per_device_train_batch_size")
    updates_per_step = (gen // update) * flat.get("num_iterations", 1)
    if flat.get("max_steps", -1) > 0:
        steps = math.ceil(flat["max_steps"] / updates_per_step)
        out.set("learner.trainer.total_training_steps", steps, "max_steps / optimizer updates per step")
        if flat.get("warmup_ratio") and "warmup_steps" not in flat:
            out.set("learner.optim.warmup_steps", int(flat["warmup_ratio"] * steps), "warmup_ratio x steps")
    elif flat.get("warmup_ratio"):
        out.unsupported["warmup_ratio"] = "needs max_steps to become steps"
    epochs = flat.get("num_train_epochs")
    if epochs is not None and flat.get("max_steps", -1) <= 0:
        if float(epochs).is_integer():
            out.set("learner.trainer.total_epochs", int(epochs), "num_train_epochs")
        else:
            out.unsupported["num_train_epochs"] = f"{epochs}: whole epochs only"


def _trl_tis(flat: dict, out: Imported, used: set[str]) -> None:
    keys = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap")
    if flat.get("use_vllm") and flat.get(keys[0], True) and flat.get(keys[1]) == "token_truncate":
        used.update(keys)
        out.set("learner.algorithm.tis_cap", float(flat.get(keys[2], 3.0)), "vllm_importance_sampling_cap")
