"""open-r1's GRPO recipe keys for `dgrpo import-config --from trl` (recipes/*/grpo/config_*.yaml in
huggingface/open-r1): its `GRPOScriptArguments` and `ModelConfig` next to TRL's GRPOConfig.

`reward_funcs` names open-r1's registry (open_r1/rewards.py `get_reward_funcs`); the names whose function takes no
settings become TRL-convention rewarder functions imported from open-r1 itself (`module: open_r1.rewards:...`), so
they score exactly as in open-r1 where open-r1 is installed next to the rewarder; `reward_weights` weigh them.
"""

from __future__ import annotations

from typing import Any

# open-r1's registry name -> its function in open_r1.rewards (the ones built without arguments).
OPEN_R1_FUNCTIONS = {"accuracy": "accuracy_reward", "format": "format_reward",
                     "reasoning_steps": "reasoning_steps_reward", "length": "len_reward",
                     "tag_count": "tag_count_reward"}

SAME: dict[str, Any] = {
    "model_revision": ("main",), "torch_dtype": ("bfloat16", "auto"), "attn_implementation": None,
    "vllm_device": None, "do_eval": (False,), "gradient_checkpointing_kwargs.": None, "hub_model_id": None,
    "hub_strategy": None, "push_to_hub": (False,), "log_level": None, "logging_first_step": None,
    "logging_strategy": None, "overwrite_output_dir": None, "wandb_project": None, "wandb_entity": None,
    "dataset_config": None, "dataset_configs": None, "callbacks": ([],),
}
REASONS = {
    "model_revision": "dgrpo loads model.path as it is: download that revision and point model.path at it",
    "torch_dtype": "bfloat16 compute is dgrpo's default (learner.actor.dtype, model.dtype); fp16 is not offered",
    "attn_implementation": "the attention kernel: the learner picks its own (learner/update/attention.py), same result",
    "vllm_device": "samplers are separate services with their own devices",
    "do_eval": "validation: learner.data.val_files with learner.trainer.test_freq",
    "gradient_checkpointing_kwargs.": "learner.actor.gradient_checkpointing uses non-reentrant checkpointing",
    "hub_model_id": "no Hub upload", "hub_strategy": "no Hub upload",
    "push_to_hub": "no Hub upload: learner.checkpoint.export_dir writes a Hugging Face folder to push yourself",
    "log_level": "log levels follow dgrpo's own logging", "logging_first_step": "every step is logged",
    "logging_strategy": "every step is logged", "overwrite_output_dir": "checkpoints go to learner.checkpoint.dir",
    "wandb_project": "learner.trainer.wandb_project", "wandb_entity": "set WANDB_ENTITY in the environment",
    "dataset_config": "the dataset is local files (learner.data.train_files)",
    "dataset_configs": "the dataset is local files (learner.data.train_files)",
    "system_prompt": "open-r1 prepends it to every prompt as a system turn: put it in the prompt column of your data",
    "dataset_prompt_column": "learner.data.prompt_key", "callbacks": "no trainer callbacks",
}


def open_r1(flat: dict[str, Any], out: Any, used: set[str]) -> None:
    """Translate open-r1's keys into `out` (an import_config.Imported); every key read is added to `used`."""
    if "wandb_project" in flat:
        used.add("wandb_project")
        out.set("learner.trainer.wandb_project", str(flat["wandb_project"]), "wandb_project")
    if flat.get("dataset_prompt_column"):
        used.add("dataset_prompt_column")
        out.set("learner.data.prompt_key", str(flat["dataset_prompt_column"]), "dataset_prompt_column")
    names = flat.get("reward_funcs")
    if names is None:
        return
    used.update({"reward_funcs", "reward_weights"})
    names = [str(n) for n in (names if isinstance(names, list) else [names])]
    weights = flat.get("reward_weights") or [1.0] * len(names)
    missing = [n for n in names if n not in OPEN_R1_FUNCTIONS]
    if missing or len(weights) != len(names):
        why = (f"{missing} take settings from open-r1's script arguments (or are not open-r1's); list them under "
               "rewarder.spec.functions" if missing else "reward_weights and reward_funcs differ in length")
        out.unsupported["reward_funcs"] = why
        return
    functions = [{"type": "file", "module": f"open_r1.rewards:{OPEN_R1_FUNCTIONS[n]}", "name": n, "weight": float(w)}
                 for n, w in zip(names, weights, strict=True)]
    out.set("rewarder.spec", {"name": "open_r1", "functions": functions},
            "reward_funcs, reward_weights (open-r1's own functions: install open-r1 next to the rewarder)")
