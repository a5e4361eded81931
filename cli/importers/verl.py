"""verl -> dgrpo for `dgrpo import-config --from verl`: a ppo_trainer config (hydra-style nested sections, dotted
keys, or the overrides of a run script), flattened to dotted keys, translated key by key (docs/peers.md)."""

from __future__ import annotations

import typing
from typing import Any

from dgrpo.cli.importers import lora as import_lora
from dgrpo.cli.importers.common import (
    Imported,
    _apply,
    _as_list,
    _device,
    _leftovers,
    _loggers,
    _run_name,
    _schedule,
)
from dgrpo.cli.importers.dapo import verl_dapo
from dgrpo.learner.update.config import LossAgg

VERL_AGGS: tuple[str, ...] = typing.get_args(LossAgg)  # verl's loss_agg_mode values are ours


A, R, F = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref."
VERL_RULES: dict[str, tuple[str, Any]] = {
    "data.train_files": ("learner.data.train_files", _as_list),
    "data.val_files": ("learner.data.val_files", _as_list),
    "data.prompt_key": ("learner.data.prompt_key", None),
    "data.max_prompt_length": ("learner.data.max_prompt_length", None),
    "data.max_response_length": ("learner.rollout.max_response_length", None),
    R + "response_length": ("learner.rollout.max_response_length", None),
    "data.train_batch_size": ("learner.data.train_batch_size", None),
    "data.seed": ("learner.data.seed", None),
    "data.shuffle": ("learner.data.shuffle", None),
    F + "model.path": ("model.path", None),
    F + "model.trust_remote_code": ("model.trust_remote_code", None),
    F + "model.enable_gradient_checkpointing": ("learner.actor.gradient_checkpointing", None),
    A + "ppo_mini_batch_size": ("learner.actor.ppo_mini_batch_size", None),
    A + "ppo_micro_batch_size_per_gpu": ("learner.actor.micro_batch_size_per_device", None),
    A + "use_dynamic_bsz": ("learner.actor.use_dynamic_bsz", None),
    A + "ppo_max_token_len_per_gpu": ("learner.actor.max_tokens_per_micro_batch", None),
    F + "ref.log_prob_max_token_len_per_gpu": ("learner.actor.logprob_max_tokens_per_micro_batch", None),
    A + "ppo_epochs": ("learner.actor.ppo_epochs", None),
    A + "fsdp_config.reshard_after_forward": ("learner.actor.fsdp_reshard_after_forward", None),
    A + "clip_ratio_c": ("learner.algorithm.clip_ratio_c", None),
    A + "loss_scale_factor": ("learner.algorithm.loss_scale_factor", None),
    A + "optim.lr": ("learner.optim.lr", None),
    A + "optim.weight_decay": ("learner.optim.weight_decay", None),
    A + "optim.betas": ("learner.optim.betas", list),
    A + "optim.min_lr_ratio": ("learner.optim.min_lr_ratio", None),
    A + "optim.warmup_style": ("learner.optim.schedule", _schedule),
    A + "optim.lr_scheduler_type": ("learner.optim.schedule", _schedule),
    A + "grad_clip": ("learner.optim.grad_clip", None),
    R + "n": ("learner.rollout.n", None),
    R + "temperature": ("learner.rollout.temperature", None),
    R + "top_p": ("learner.rollout.top_p", None),
    R + "top_k": ("learner.rollout.top_k", lambda v: max(int(v), 0)),  # verl: -1 = off
    R + "gpu_memory_utilization": ("sampler.gpu_memory_utilization", None),
    R + "tensor_model_parallel_size": ("sampler.tensor_parallel_size", None),
    R + "enable_chunked_prefill": ("sampler.enable_chunked_prefill", None),
    R + "enable_prefix_caching": ("sampler.enable_prefix_caching", None),
    R + "max_num_seqs": ("sampler.max_num_seqs", None),
    R + "max_num_batched_tokens": ("sampler.max_num_batched_tokens", None),
    R + "max_model_len": ("sampler.max_model_len", None),
    R + "enforce_eager": ("sampler.enforce_eager", None),
    R + "dtype": ("model.dtype", None),
    "trainer.total_epochs": ("learner.trainer.total_epochs", None),
    "trainer.total_training_steps": ("learner.trainer.total_training_steps", None),
    "trainer.save_freq": ("learner.checkpoint.save_freq", lambda v: max(int(v), 0)),  # -1 (never): at the end here
    "trainer.test_freq": ("learner.trainer.test_freq", lambda v: max(int(v), 0)),
    "trainer.val_before_train": ("learner.trainer.val_before_train", None),
    "trainer.project_name": ("learner.trainer.wandb_project", str),
    "trainer.experiment_name": ("learner.trainer.run_name", _run_name),
    "trainer.logger": ("learner.trainer.loggers", _loggers),
    "trainer.rollout_data_dir": ("learner.trainer.rollout_data_dir", str),
    "trainer.validation_data_dir": ("learner.trainer.validation_data_dir", str),
    "trainer.log_val_generations": ("learner.trainer.log_val_generations", None),
    "trainer.default_local_dir": ("learner.checkpoint.dir", str),
    "trainer.max_actor_ckpt_to_keep": ("learner.checkpoint.keep_last", None),
    "trainer.balance_batch": ("learner.actor.balance_batch", None),
    "trainer.device": ("model.device", _device),
    A + "optim.clip_grad": ("learner.optim.grad_clip", None),  # the megatron config's name for grad_clip
    R + "multi_turn.enable": ("learner.rollout.multi_turn.enable", None),
    R + "multi_turn.tool_config_path": ("learner.rollout.multi_turn.tool_config_path", str),
    R + "multi_turn.max_assistant_turns": ("learner.rollout.multi_turn.max_assistant_turns", None),
    R + "multi_turn.max_parallel_calls": ("learner.rollout.multi_turn.max_parallel_calls", None),
    R + "multi_turn.max_tool_response_length": ("learner.rollout.multi_turn.max_tool_response_length", None),
    R + "multi_turn.tool_response_truncate_side": ("learner.rollout.multi_turn.tool_response_truncate_side", None),
    R + "multi_turn.format": ("learner.rollout.multi_turn.format", None),
}
# Keys whose listed values (None: any value) mean what dgrpo does anyway.
VERL_SAME: dict[str, Any] = {
    A + "entropy_coeff": (0, 0.0), "algorithm.use_kl_in_reward": (False,), A + "policy_loss.loss_mode": ("vanilla",),
    R + "name": ("vllm",), A + "strategy": ("fsdp", "fsdp2"), A + "fsdp_config.param_offload": (False,),
    A + "fsdp_config.optimizer_offload": (False,), F + "ref.fsdp_config.param_offload": None,
    F + "model.use_remove_padding": None, R + "log_prob_micro_batch_size_per_gpu": None,
    F + "ref.log_prob_micro_batch_size_per_gpu": None, R + "log_prob_max_token_len_per_gpu": None,
    F + "ref.log_prob_use_dynamic_bsz": None, R + "log_prob_use_dynamic_bsz": None, R + "calculate_log_probs": None,
    R + "mode": None, R + "free_cache_engine": None, R + "load_format": None, R + "prompt_length": None,
    A + "ulysses_sequence_parallel_size": (1,), "reward_model.enable": (False,), R + "multi_turn.max_user_turns": None,
    R + "multi_turn.interaction_config_path": (None,),
    A + "tis_imp_ratio_cap": (-1, 0, -1.0, 0.0), "trainer.critic_warmup": None,
    "trainer.n_gpus_per_node": None, "trainer.nnodes": None, "critic.": None, "algorithm.kl_ctrl.": None,
    "algorithm.gamma": None, "algorithm.lam": None, "data.truncation": None,
    A + "use_token_level_loss": (True,), R + "val_kwargs.n": (1,), R + "val_kwargs.do_sample": (False,),
    R + "val_kwargs.temperature": (0, 0.0), R + "val_kwargs.top_p": (1, 1.0), R + "val_kwargs.top_k": (-1, 0),
    F + "ref.ulysses_sequence_parallel_size": (1,), A + "fsdp_config.fsdp_size": (-1,),
    A + "use_torch_compile": (False,), F + "ref.use_torch_compile": (False,), A + "fsdp_config.forward_prefetch": None,
    F + "ref.fsdp_config.forward_prefetch": None, A + "entropy_from_logits_with_chunking": None,
    F + "ref.entropy_from_logits_with_chunking": None, "hydra.config_path": None,
    "hydra.config_name": ("ppo_trainer", "ppo_trainer.yaml"), "data.return_raw_chat": None,
    R + "data_parallel_size": None, R + "n_gpus_per_node": None, R + "expert_parallel_size": (1,),
}
VERL_REASONS = {
    A + "entropy_coeff": "no entropy bonus in dgrpo's loss",
    "algorithm.use_kl_in_reward": "dgrpo puts the KL in the loss only (learner.algorithm.beta)",
    A + "policy_loss.loss_mode": "dgrpo's policy loss is verl's vanilla PPO clip (+ dual clip)",
    R + "name": "samplers are vLLM",
    A + "strategy": "the learner shards with FSDP2 under torchrun; megatron is not offered",
    A + "fsdp_config.param_offload": "no CPU offload of parameters",
    A + "fsdp_config.optimizer_offload": "no CPU offload of optimizer states",
    F + "ref.fsdp_config.param_offload": "the reference is sharded like the policy",
    F + "model.use_remove_padding": "packed micro-batches (learner.actor.use_dynamic_bsz) carry no padding",
    R + "log_prob_micro_batch_size_per_gpu": "no-grad forwards take 2x micro_batch_size_per_device",
    F + "ref.log_prob_micro_batch_size_per_gpu": "no-grad forwards take 2x micro_batch_size_per_device",
    R + "log_prob_max_token_len_per_gpu":
        "one budget for no-grad forwards: learner.actor.logprob_max_tokens_per_micro_batch",
    F + "ref.log_prob_use_dynamic_bsz": "no-grad forwards follow learner.actor.use_dynamic_bsz",
    R + "log_prob_use_dynamic_bsz": "no-grad forwards follow learner.actor.use_dynamic_bsz",
    R + "calculate_log_probs": "samplers always return logprobs",
    R + "mode": "samplers are separate services", R + "free_cache_engine": "samplers keep their own devices",
    R + "load_format": "samplers load model.path and then published weights", R + "prompt_length": "from data",
    A + "ulysses_sequence_parallel_size": "no sequence parallelism",
    R + "multi_turn.max_user_turns": "conversations have no simulated user turns: only tool turns follow the model's",
    R + "multi_turn.interaction_config_path": "no interaction agents (simulated users): tools only",
    R + "multi_turn.": "not offered by dgrpo's multi-turn rollouts (learner.rollout.multi_turn)",
    "reward_model.enable": "a reward model is a rewarder function: rewarder.spec.functions [{type: model, path}] "
    "(AutoModelForSequenceClassification; verl's scores the last token of AutoModelForTokenClassification)",
    "reward_model.": "reward models are rewarder functions ({type: model})",
    "trainer.critic_warmup": "GRPO has no critic", "critic.": "GRPO has no critic",
    "trainer.n_gpus_per_node":
        "devices per service: `dgrpo up --samplers N`, torchrun --nproc-per-node for the learner",
    "trainer.nnodes": "services are placed by hand or by deploy/ (one compose service each)",
    "algorithm.kl_ctrl.": "only used with use_kl_in_reward", "algorithm.gamma": "GRPO's outcome advantage has no "
    "discount", "algorithm.lam": "GRPO's outcome advantage has no GAE",
    "data.truncation": "prompts over max_prompt_length are dropped (learner.data.overlong_prompts; truncation=left "
    "maps to truncate)",
    A + "ppo_micro_batch_size": "the global micro-batch size is deprecated in verl: ppo_micro_batch_size_per_gpu",
    A + "tis_imp_ratio_cap": "only a positive cap maps (learner.algorithm.tis_cap)",
    A + "use_token_level_loss": "verl's older spelling of loss_agg_mode=token-mean (learner.algorithm.loss_agg)",
    R + "val_kwargs.": "dgrpo validates greedily, one completion per prompt (temperature 0)",
    F + "ref.ulysses_sequence_parallel_size": "no sequence parallelism",
    A + "fsdp_config.fsdp_size": "the learner shards over every torchrun rank (verl's -1); no hybrid sharding groups",
    A + "use_torch_compile": "dgrpo does not torch.compile the model", F + "ref.use_torch_compile": "no torch.compile",
    A + "fsdp_config.forward_prefetch": "a speed setting of verl's FSDP wrapper: results do not change",
    F + "ref.fsdp_config.forward_prefetch": "a speed setting of verl's FSDP wrapper: results do not change",
    A + "entropy_from_logits_with_chunking": "a memory setting of verl's entropy metric: results do not change",
    F + "ref.entropy_from_logits_with_chunking": "a memory setting of verl's entropy metric: results do not change",
    "hydra.config_path": "where verl's trainer config lives: dgrpo's defaults are its own",
    "hydra.config_name": "verl's base trainer config: the missing keys take dgrpo's defaults; a megatron config's "
    "settings are not offered (the learner is FSDP2)",
    "data.return_raw_chat": "the learner applies the chat template itself and sends token ids",
    R + "data_parallel_size": "vLLM data-parallel ranks are sampler replicas here (`dgrpo up --samplers N`)",
    R + "n_gpus_per_node": "devices per sampler: sampler.tensor_parallel_size and replicas",
    R + "expert_parallel_size": "no expert parallelism in the samplers",
    A + "megatron.": "megatron is not offered: the learner is FSDP2 (learner.actor)",
    F + "ref.megatron.": "megatron is not offered: the learner is FSDP2",
    A + "torchtitan.": "torchtitan is not offered: the learner is FSDP2 in plain PyTorch",
    F + "ref.torchtitan.": "torchtitan is not offered", "model_engine": "the learner is FSDP2 in plain PyTorch",
    F + "model.override_config.": "dgrpo loads the model's own config.json: edit the checkpoint's config instead",
}


def from_verl(flat: dict[str, Any]) -> Imported:
    out, used = Imported(), set()
    _apply(flat, out, VERL_RULES, used)
    if flat.get("trainer.project_name") is not None:  # verl's mlflow logger names its experiment after the project
        out.set("learner.trainer.mlflow_experiment", str(flat["trainer.project_name"]), "trainer.project_name")
    est = flat.get("algorithm.adv_estimator", "gae")  # verl's default is PPO's gae
    used.add("algorithm.adv_estimator")
    if est != "grpo":
        out.unsupported["algorithm.adv_estimator"] = f"{est!r}: dgrpo trains GRPO only (adv_estimator=grpo)"
    if "algorithm.norm_adv_by_std_in_grpo" in flat:
        used.add("algorithm.norm_adv_by_std_in_grpo")
        out.set("learner.algorithm.adv_scale", "group" if flat["algorithm.norm_adv_by_std_in_grpo"] else "none",
                "algorithm.norm_adv_by_std_in_grpo")
    clip = flat.get(A + "clip_ratio")
    used.add(A + "clip_ratio")
    for side in ("low", "high"):
        key = A + f"clip_ratio_{side}"
        used.add(key)
        if flat.get(key) is not None:
            out.set(f"learner.algorithm.clip_{side}", flat[key], key)
        elif clip is not None:
            out.set(f"learner.algorithm.clip_{side}", clip, A + "clip_ratio")
    if "learner.algorithm.clip_ratio_c" not in out.values:
        out.set("learner.algorithm.clip_ratio_c", 3.0, "(verl's default: dual-clip on)")
    mode = flat.get(A + "loss_agg_mode", "token-mean")
    used.add(A + "loss_agg_mode")
    if mode in VERL_AGGS:
        out.set("learner.algorithm.loss_agg", mode, A + "loss_agg_mode")
    else:
        out.unsupported[A + "loss_agg_mode"] = f"{mode!r} is not one of {', '.join(VERL_AGGS)}"
    kl_keys = [A + k for k in ("use_kl_loss", "kl_loss_coef", "kl_loss_type")]
    used.update(kl_keys)
    if flat.get(kl_keys[0]):
        kl_type = flat.get(kl_keys[2], "low_var_kl")
        if kl_type in ("low_var_kl", "k3"):
            out.set("learner.algorithm.beta", float(flat.get(kl_keys[1], 0.001)), kl_keys[1])
            out.set("learner.algorithm.kl_cap", 10.0, f"{kl_keys[2]}={kl_type} (verl clamps it at 10)")
        else:
            out.unsupported[kl_keys[2]] = f"{kl_type!r}: dgrpo's KL is k3 (low_var_kl) only"
    cap = flat.get(A + "tis_imp_ratio_cap")
    if cap is not None and cap > 0:
        used.add(A + "tis_imp_ratio_cap")
        out.set("learner.algorithm.tis_cap", float(cap), A + "tis_imp_ratio_cap")
    verl_dapo(flat, out, used)  # before _verl_reward: custom_reward_function.overlong_buffer.* is DAPO's
    _verl_reward(flat, out, used)
    _verl_warmup(flat, out, used)
    _verl_checkpoint(flat, out, used)
    import_lora.verl_lora(flat, out, used)
    if flat.get("data.filter_overlong_prompts"):
        out.set("learner.data.overlong_prompts", "drop", "data.filter_overlong_prompts")
    elif flat.get("data.truncation") == "left":
        out.set("learner.data.overlong_prompts", "truncate", "data.truncation=left")
        used.add("data.truncation")
    used.add("data.filter_overlong_prompts")
    truncation = flat.get("data.truncation")
    if "data.truncation" in flat and "data.truncation" not in used:
        used.add("data.truncation")
        if flat.get("data.filter_overlong_prompts") and truncation in ("error", "right", "middle"):
            out.ignored["data.truncation"] = "filter_overlong_prompts drops every longer prompt first (dgrpo: drop)"
        elif truncation == "error":
            out.unsupported["data.truncation"] = ("error: verl stops at the first prompt over max_prompt_length; dgrpo "
                                                  "drops and counts them (learner.data.overlong_prompts)")
        elif truncation is not None:
            out.unsupported["data.truncation"] = (f"{truncation!r}: dgrpo drops longer prompts or keeps their last "
                                                  "tokens (learner.data.overlong_prompts: drop / truncate)")
    same = dict(VERL_SAME, **import_lora.VERL_SAME)
    if not flat.get("reward_model.enable"):
        same["reward_model."] = None  # a disabled reward model's settings do nothing
    _leftovers(flat, out, used, same, {**VERL_REASONS, **import_lora.VERL_REASONS}, "no counterpart in dgrpo")
    return out


def _verl_reward(flat: dict, out: Imported, used: set[str]) -> None:
    """custom_reward_function -> the rewarder's `{type: python, path, name, reward_kwargs}` (verl's spelling, its
    compute_score(data_source, solution_str, ground_truth, extra_info) called unchanged)."""
    prefix = "custom_reward_function."
    keys = [k for k in flat if k.startswith(prefix)]
    used.update(keys)
    if not flat.get(prefix + "path"):
        return
    fn: dict[str, Any] = {"type": "python", "path": flat[prefix + "path"],
                          "name": flat.get(prefix + "name") or "compute_score"}
    kwargs = {k.removeprefix(prefix + "reward_kwargs."): flat[k] for k in keys
              if k.startswith(prefix + "reward_kwargs.")}
    if kwargs:
        fn["reward_kwargs"] = kwargs
    out.set("rewarder.spec", {"name": "verl_custom_reward", "functions": [fn]}, prefix + "path")


def _verl_warmup(flat: dict, out: Imported, used: set[str]) -> None:
    steps, ratio = flat.get(A + "optim.lr_warmup_steps"), flat.get(A + "optim.lr_warmup_steps_ratio")
    used.update({A + "optim.lr_warmup_steps", A + "optim.lr_warmup_steps_ratio", A + "optim.total_training_steps"})
    if steps is not None and steps >= 0:
        out.set("learner.optim.warmup_steps", int(steps), A + "optim.lr_warmup_steps")
    elif ratio:
        total = flat.get("trainer.total_training_steps")
        if total:
            out.set("learner.optim.warmup_steps", int(ratio * total), A + "optim.lr_warmup_steps_ratio x steps")
        else:
            out.unsupported[A + "optim.lr_warmup_steps_ratio"] = "needs trainer.total_training_steps to become steps"


def _verl_checkpoint(flat: dict, out: Imported, used: set[str]) -> None:
    for key in (A + "checkpoint.save_contents", A + "checkpoint.contents"):
        if flat.get(key) is not None:
            used.add(key)
            contents = [c for c in _as_list(flat[key]) if c in ("model", "optimizer", "extra")]
            out.set("learner.checkpoint.contents", contents, key)
    mode = flat.get("trainer.resume_mode")
    used.update({"trainer.resume_mode", "trainer.resume_from_path"})
    if mode is not None:
        resume = {"auto": "auto", "disable": "never"}.get(mode) or flat.get("trainer.resume_from_path") or "auto"
        out.set("learner.checkpoint.resume", resume, "trainer.resume_mode")


# ---- TRL -----------------------------------------------------------------------------------------------------
