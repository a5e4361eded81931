"""`dgrpo import-config --from verl|trl FILE [-o OUT]`: a dgrpo stack config from the config a user already has.

verl: a ppo_trainer YAML (hydra-style nested sections, or dotted keys) or the run script of hydra overrides
(`python3 -m verl.trainer.main_ppo data.train_batch_size=1024 ...`, as in verl's examples/grpo_trainer).
TRL: a GRPOConfig (its TrainingArguments included) as YAML or JSON.

Every key with a counterpart is written under its dgrpo name; every other key is listed with the reason, as
comments at the end of the output and on stderr: "ignored" (dgrpo behaves the same without it) or "unsupported"
(dgrpo behaves differently). Where a peer's default differs from dgrpo's in a way that changes the objective or the
optimizer and the file does not set the key (verl's dual-clip 3.0, TRL's linear lr decay), the peer's default is
written. The output is validated with the stack schema before it is written. docs/peers.md has the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dgrpo.cli import import_openr1
from dgrpo.cli.import_dapo import verl_dapo
from dgrpo.cli.import_read import check_unresolved, read_source
from dgrpo.common.config import ConfigError, load_config
from dgrpo.learner.actor_config import TRL_LOSS_TYPES

VERL_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class Unsupported(Exception):
    """A key whose value dgrpo cannot reproduce; the message is the reason."""


@dataclass
class Imported:
    """The translation: dgrpo dotted key -> value, where each came from, and the keys left behind."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.values[key], self.origin[key] = value, origin


# ---- shared conversions ------------------------------------------------------------------------------------


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _run_name(v: Any) -> str:
    return (re.sub(r"[^A-Za-z0-9_.]", "_", str(v)) or "dgrpo")[:64]


def _loggers(v: Any) -> list[str]:
    names = [str(x) for x in _as_list(v) if str(x) not in ("none", "None")]
    names = ["jsonl" if n == "file" else n for n in names]  # verl's file logger writes a jsonl of metrics
    unknown = [n for n in names if n not in ("console", "jsonl", "wandb", "tensorboard")]
    if unknown:
        raise Unsupported(f"loggers {unknown} are not offered (console, jsonl, tensorboard, wandb)")
    return sorted({"console", "jsonl", *names}, key=["console", "jsonl", "tensorboard", "wandb"].index)


def _device(v: Any) -> str:
    if str(v) not in ("auto", "npu", "cuda", "cpu"):
        raise Unsupported(f"device {v!r} is not offered (npu, cuda, cpu)")
    return str(v)


def _schedule(v: Any) -> str:
    table = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine", "linear": "linear"}
    if str(v) not in table:
        raise Unsupported(f"lr schedule {v!r} is not offered (constant, cosine, linear)")
    return table[str(v)]


def _apply(flat: dict, out: Imported, rules: dict[str, tuple[str, Any]], used: set[str]) -> None:
    """Direct one-key rules: source key -> (dgrpo key, conversion or None)."""
    for src, (dst, conv) in rules.items():
        if src not in flat:
            continue
        used.add(src)
        if flat[src] is None:
            out.ignored[src] = f"null (unset): {dst} keeps dgrpo's default or what it derives"
            continue
        try:
            out.set(dst, conv(flat[src]) if conv else flat[src], src)
        except Unsupported as e:
            out.unsupported[src] = str(e)


def _leftovers(flat: dict, out: Imported, used: set[str], same: dict, reasons: dict[str, str], generic: str) -> None:
    """Keys no rule took: ignored where the value means what dgrpo does anyway, else unsupported."""
    for key, v in flat.items():
        if key in used or key in out.unsupported:
            continue
        if key in same and (same[key] is None or v in same[key]):
            out.ignored[key] = reasons.get(key, "dgrpo behaves this way already")
            continue
        prefix = next((p for p in reasons if p.endswith(".") and key.startswith(p)), None)
        reason = reasons.get(key) or (reasons[prefix] if prefix else generic)
        if v is None or (prefix and prefix in same):
            out.ignored[key] = reason
        else:
            out.unsupported[key] = reason


# ---- verl ----------------------------------------------------------------------------------------------------

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
    "algorithm.gamma": None, "algorithm.lam": None, "data.truncation": None, "trainer.log_val_generations": None,
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
    R + "log_prob_max_token_len_per_gpu": "one budget for no-grad forwards: learner.actor.logprob_max_tokens_per_micro_batch",
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
    "trainer.n_gpus_per_node": "devices per service: `dgrpo up --samplers N`, torchrun --nproc-per-node for the learner",
    "trainer.nnodes": "services are placed by hand or by deploy/ (one compose service each)",
    "algorithm.kl_ctrl.": "only used with use_kl_in_reward", "algorithm.gamma": "GRPO's outcome advantage has no "
    "discount", "algorithm.lam": "GRPO's outcome advantage has no GAE", "data.truncation": "prompts over max_prompt_length are "
    "dropped (learner.data.overlong_prompts; truncation=left maps to truncate)",
    "trainer.log_val_generations": "validation logs metrics only",
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
    same = dict(VERL_SAME)
    if not flat.get("reward_model.enable"):
        same["reward_model."] = None  # a disabled reward model's settings do nothing
    _leftovers(flat, out, used, same, VERL_REASONS, "no counterpart in dgrpo")
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
    "log_completions": None, "num_completions_to_print": None, "remove_unused_columns": None,
    "per_device_eval_batch_size": None, "repetition_penalty": (1, 1.0), "top_entropy_quantile": (1, 1.0),
    "sync_ref_model": (False,), "importance_sampling_level": ("token",), "fp16": (False,), "logging_dir": None,
    "save_strategy": None, "eval_strategy": None, "ds3_gather_for_generation": None, "bf16": None,
    **import_openr1.SAME,
}
TRL_REASONS = {
    "use_vllm": "samplers are always vLLM services", "vllm_mode": "samplers are separate services (sampler.addresses)",
    "vllm_server_base_url": "samplers are reached at sampler.addresses", "vllm_server_host": "sampler.addresses",
    "vllm_server_port": "sampler.addresses", "vllm_server_timeout": "learner.rollout.request_timeout_s",
    "vllm_group_port": "weights reach samplers through the weight channel (weights.*)",
    "logging_steps": "every step is logged", "log_completions": "completions are not logged",
    "num_completions_to_print": "completions are not logged",
    "remove_unused_columns": "extra columns always reach the reward functions",
    "per_device_eval_batch_size": "validation runs on the samplers",
    "repetition_penalty": "no repetition penalty in the samplers' requests",
    "top_entropy_quantile": "no entropy-quantile token mask",
    "sync_ref_model": "the reference stays the initial policy", "importance_sampling_level": "sequence-level "
    "ratios (GSPO) are not offered", "fp16": "fp16 autocast is not offered (learner.actor.dtype bfloat16/float32)",
    "logging_dir": "metrics go to learner.trainer.log_dir/run_name", "save_strategy": "learner.checkpoint.save_freq",
    "eval_strategy": "learner.trainer.test_freq", "ds3_gather_for_generation": "no DeepSpeed (FSDP2)",
    "bf16": "learner.actor.dtype is bfloat16 by default (bf16=false maps to float32)", "dataset_name": "dgrpo reads local parquet/jsonl (learner.data.train_files)",
    "reward_weights": "give each rewarder.spec.functions entry its weight",
    "disable_dropout": "dropout follows the model's config", "delta": "maps only when > 1 + epsilon_high",
    "generation_kwargs": "sampling takes temperature, top_p, top_k, min_p, stop only",
    "vllm_importance_sampling_correction": "only token_truncate maps (learner.algorithm.tis_cap)",
    "vllm_importance_sampling_mode": "only token_truncate maps (learner.algorithm.tis_cap)",
    "vllm_importance_sampling_cap": "only with vllm_importance_sampling_mode=token_truncate",
    "scale_rewards": "group, batch or none only",
    **import_openr1.REASONS,
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
        out.set("learner.algorithm.clip_high", high, "epsilon_high" if flat.get("epsilon_high") is not None else "epsilon")
    delta = flat.get("delta")
    if delta is not None:
        used.add("delta")
        if delta > 1 + high:
            out.set("learner.algorithm.clip_ratio_c", float(delta), "delta (= verl's dual clip when > 1 + epsilon_high)")
        else:
            out.unsupported["delta"] = f"{delta} <= 1 + epsilon_high: it would also clip positive advantages"
    loss_type = flat.get("loss_type", "dapo")
    used.add("loss_type")
    if loss_type in TRL_LOSS_TYPES:
        note = " (over the whole mini-batch here; TRL's bnpo normalises each local batch)" if loss_type == "bnpo" else ""
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


# ---- writing -------------------------------------------------------------------------------------------------


def _nest(values: dict[str, Any]) -> dict:
    root: dict = {}
    for key, v in values.items():
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return root


def finish(out: Imported) -> None:
    """Cross-checks a peer does implicitly: the sampler context holds prompt + response (verl's max_model_len)."""
    if "sampler.max_model_len" not in out.values:
        total = out.values.get("learner.data.max_prompt_length", 512) + out.values.get(
            "learner.rollout.max_response_length", 256)
        if total > 2048:
            out.set("sampler.max_model_len", total, "max_prompt_length + max_response_length")


def validate(out: Imported) -> None:
    """The output must load as a stack config; errors name the dgrpo key and the peer key it came from."""
    from dgrpo.cli.stack import StackConfig

    overrides = [f"{k}={json.dumps(v)}" for k, v in out.values.items()]
    try:
        load_config(StackConfig, None, overrides).check_whole_stack()
    except ConfigError as e:
        origins = [f"{k} <- {o}" for k, o in out.origin.items() if k in str(e)]
        raise ConfigError(f"{e}\n  (from: {'; '.join(origins) or 'the peer defaults'})") from None


def render(out: Imported, source: str, path: str) -> str:
    lines = [yaml.safe_dump(_nest(out.values), sort_keys=False).rstrip(), "",
             f"# Imported by `dgrpo import-config --from {source} {path}` (docs/peers.md).", "# dgrpo key <- source:"]
    lines += [f"#   {k} <- {o}" for k, o in out.origin.items()]
    for title, entries in (("ignored (no counterpart; dgrpo behaves the same)", out.ignored),
                           ("unsupported (no counterpart; dgrpo behaves differently)", out.unsupported)):
        if entries:
            lines.append(f"# {source} keys {title}:")
            lines += [f"#   {k}: {reason}" for k, reason in entries.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dgrpo import-config", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", choices=("verl", "trl"), required=True, help="the peer's format")
    parser.add_argument("file", help="verl: ppo_trainer YAML or run script of overrides; trl: GRPOConfig YAML/JSON")
    parser.add_argument("-o", "--output", help="write the dgrpo stack YAML here (default: stdout)")
    parser.add_argument("--num-processes", type=int, default=1,
                        help="trl: training processes the batch sizes were for (per_device_* x processes)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="verl run script: a variable the script reads from the environment (repeatable; on top "
                             "of this process's environment)")
    args = parser.parse_args(argv)
    try:
        env = dict(os.environ)
        for item in args.env:
            name, eq, value = item.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise ConfigError(f"--env {item!r}: expected NAME=VALUE")
            env[name] = value
        flat = read_source(Path(args.file), env)
        same, reasons = (VERL_SAME, VERL_REASONS) if args.source == "verl" else (TRL_SAME, TRL_REASONS)
        unknown = check_unresolved(flat, same, reasons)
        out = from_verl(flat) if args.source == "verl" else from_trl(flat, args.num_processes)
        out.ignored.update(unknown)
        finish(out)
        validate(out)
    except ConfigError as e:
        print(f"dgrpo import-config: {e}", file=sys.stderr)
        return 2
    text = render(out, args.source, args.file)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: {len(out.values)} keys", file=sys.stderr)
    else:
        sys.stdout.write(text)
    for title, entries in (("ignored", out.ignored), ("unsupported", out.unsupported)):
        for k, reason in entries.items():
            print(f"{title}: {k}={flat.get(k)!r}: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
