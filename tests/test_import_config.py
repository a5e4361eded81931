"""`dgrpo import-config`: a verl run script / ppo_trainer YAML and a TRL GRPOConfig become a stack config that loads,
with the mapped values, and every key without a counterpart listed with its reason."""

from __future__ import annotations

import json

import pytest
import yaml

from dgrpo.cli.main import main as dgrpo_main
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config

# verl's examples/grpo_trainer/run_qwen2-7b.sh, as users run it.
VERL_SCRIPT = r"""set -x

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.rollout_data_dir=/data/rollouts \
    trainer.validation_data_dir=/data/val \
    trainer.log_val_generations=10 \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='qwen2_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=5 \
    trainer.total_epochs=15 $@
"""

# A ppo_trainer.yaml in verl's nested layout (DAPO-style settings, hydra interpolations, a critic section).
VERL_YAML = """
data:
  train_files: [/data/dapo/train.parquet]
  val_files: /data/aime/test.parquet
  prompt_key: prompt
  max_prompt_length: 2048
  max_response_length: 8192
  train_batch_size: 512
  filter_overlong_prompts: false
  truncation: left
actor_rollout_ref:
  model:
    path: /models/Qwen2.5-Math-7B
    use_remove_padding: true
  actor:
    strategy: fsdp2
    ppo_mini_batch_size: 32
    ppo_micro_batch_size: null
    use_dynamic_bsz: true
    ppo_max_token_len_per_gpu: 20480
    clip_ratio: 0.2
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    clip_ratio_c: 10.0
    loss_agg_mode: seq-mean-token-sum-norm
    loss_scale_factor: 8192
    entropy_coeff: 0.001
    use_kl_loss: true
    kl_loss_coef: 0.01
    kl_loss_type: k1
    grad_clip: 1.0
    ppo_epochs: 1
    optim:
      lr: 1e-6
      lr_warmup_steps: -1
      lr_warmup_steps_ratio: 0.05
      warmup_style: cosine
      weight_decay: 0.1
      betas: [0.9, 0.99]
    fsdp_config:
      param_offload: false
      optimizer_offload: true
    checkpoint:
      save_contents: [model, optimizer, extra, hf_model]
  ref:
    log_prob_max_token_len_per_gpu: ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
  rollout:
    name: vllm
    n: 16
    temperature: 1.0
    top_p: 1.0
    top_k: -1
    response_length: ${data.max_response_length}
    gpu_memory_utilization: 0.8
    tensor_model_parallel_size: 4
    enable_chunked_prefill: true
    max_num_batched_tokens: 10240
    max_model_len: null
critic:
  ppo_mini_batch_size: 32
  optim:
    lr: 1e-5
reward_model:
  enable: false
  model:
    path: null
custom_reward_function:
  path: /work/reward.py
  name: compute_score
  reward_kwargs:
    format_score: 0.1
algorithm:
  adv_estimator: grpo
  norm_adv_by_std_in_grpo: false
  use_kl_in_reward: false
  gamma: 1.0
trainer:
  total_training_steps: 200
  logger: [console, mlflow]
  project_name: DAPO
  experiment_name: DAPO-Qwen2.5-7b (math)
  save_freq: -1
  test_freq: 10
  default_local_dir: /ckpt/dapo
  resume_mode: disable
  balance_batch: true
"""

# A TRL GRPOConfig as YAML (open-r1 recipe style).
TRL_CONFIG = {
    "model_name_or_path": "/models/Qwen2.5-1.5B-Instruct",
    "dataset_name": "open-r1/OpenR1-Math-220k",
    "bf16": True,
    "use_vllm": True,
    "vllm_gpu_memory_utilization": 0.7,
    "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_cap": 2.0,
    "learning_rate": 3.0e-06,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "max_prompt_length": 512,
    "max_completion_length": 1024,
    "num_generations": 16,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 4,
    "max_steps": 100,
    "beta": 0.04,
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "delta": 1.5,
    "loss_type": "dr_grpo",
    "scale_rewards": False,
    "mask_truncated_completions": True,
    "temperature": 0.7,
    "top_entropy_quantile": 0.2,
    "logging_steps": 1,
    "report_to": ["wandb"],
    "log_completions": True,
    "num_completions_to_print": 4,
    "output_dir": "data/Qwen2.5-1.5B-GRPO",
    "save_strategy": "steps",
    "save_steps": 50,
    "save_total_limit": 1,
    "seed": 42,
    "reward_weights": [1.0, 0.5],
    "gradient_checkpointing": True,
}


def run(tmp_path, capsys, source: str, text: str, *extra: str, name: str = "in.yaml"):
    src, out = tmp_path / name, tmp_path / "dgrpo.yaml"
    src.write_text(text)
    rc = dgrpo_main(["import-config", "--from", source, str(src), "-o", str(out), *extra])
    err = capsys.readouterr().err
    return rc, out, err


def listed(err: str, kind: str) -> set[str]:
    return {line.split(": ", 1)[1].split("=", 1)[0] for line in err.splitlines() if line.startswith(kind + ": ")}


def test_verl_run_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    rc, out, err = run(tmp_path, capsys, "verl", VERL_SCRIPT, name="run_qwen2-7b.sh")
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    cfg.check_whole_stack()
    lr = cfg.learner
    assert lr.data.train_files == ["/home/u/data/gsm8k/train.parquet"]
    assert (lr.data.train_batch_size, lr.data.max_prompt_length, lr.rollout.max_response_length) == (1024, 512, 1024)
    assert (lr.actor.ppo_mini_batch_size, lr.actor.micro_batch_size_per_device, lr.rollout.n) == (256, 40, 5)
    assert lr.optim.lr == 1e-6 and lr.actor.gradient_checkpointing
    assert (lr.algorithm.beta, lr.algorithm.kl_cap, lr.algorithm.clip_ratio_c) == (0.001, 10.0, 3.0)  # verl's
    assert lr.algorithm.loss_agg == "token-mean" and lr.data.overlong_prompts == "drop"
    assert (cfg.sampler.tensor_parallel_size, cfg.sampler.gpu_memory_utilization) == (2, 0.6)
    assert cfg.model.path == "Qwen/Qwen2-7B-Instruct"
    assert (lr.trainer.total_epochs, lr.trainer.test_freq, lr.checkpoint.save_freq) == (15, 5, 20)
    assert lr.trainer.loggers == ["console", "jsonl", "wandb"]
    assert (lr.trainer.wandb_project, lr.trainer.run_name) == ("verl_grpo_example_gsm8k", "qwen2_7b_function_rm")
    assert (lr.trainer.rollout_data_dir, lr.trainer.validation_data_dir) == ("/data/rollouts", "/data/val")
    assert lr.trainer.log_val_generations == 10
    # verl's default_compute_score is not bundled: math_verify on the ground truth is written, and the gap listed
    assert listed(err, "unsupported") == {"custom_reward_function.path"}
    (fn,) = cfg.rewarder.spec.functions
    assert (fn.type, fn.field) == ("math_verify", "reward_model.ground_truth")
    assert {"actor_rollout_ref.model.use_remove_padding", "trainer.n_gpus_per_node", "trainer.critic_warmup",
            "actor_rollout_ref.actor.entropy_coeff", "algorithm.use_kl_in_reward"} <= listed(err, "ignored")
    text = out.read_text()
    assert "#   learner.algorithm.clip_ratio_c <- (verl's default: dual-clip on)" in text
    assert "#   trainer.nnodes: " in text  # the reasons are in the file as well


def test_verl_nested_yaml_with_interpolations_and_unsupported_keys(tmp_path, capsys):
    rc, out, err = run(tmp_path, capsys, "verl", VERL_YAML)
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    cfg.check_whole_stack()
    lr, alg = cfg.learner, cfg.learner.algorithm
    assert lr.data.val_files == ["/data/aime/test.parquet"] and lr.data.overlong_prompts == "truncate"
    assert lr.rollout.max_response_length == 8192  # ${data.max_response_length}
    assert cfg.sampler.max_model_len == 2048 + 8192  # verl's default: prompt + response
    assert lr.actor.use_dynamic_bsz and lr.actor.max_tokens_per_micro_batch == 20480
    assert lr.actor.logprob_max_tokens_per_micro_batch == 20480  # ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
    assert (alg.clip_low, alg.clip_high, alg.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (alg.loss_agg, alg.loss_scale_factor, alg.adv_scale) == ("seq-mean-token-sum-norm", 8192, "none")
    assert alg.beta == 0.0 and alg.kl_cap is None  # kl_loss_type k1 is not offered: no KL written
    assert (lr.optim.schedule, lr.optim.warmup_steps, lr.optim.weight_decay) == ("cosine", 10, 0.1)
    assert lr.optim.betas == (0.9, 0.99)
    assert lr.checkpoint.contents == ["model", "optimizer", "extra"] and lr.checkpoint.resume == "never"
    assert (lr.checkpoint.save_freq, lr.checkpoint.dir) == (0, "/ckpt/dapo")
    assert lr.trainer.run_name == "DAPO-Qwen2.5-7b__math_".replace("-", "_")  # only [A-Za-z0-9_.] survive
    assert (cfg.sampler.tensor_parallel_size, cfg.sampler.enable_chunked_prefill) == (4, True)
    assert lr.rollout.top_k == 0  # verl's -1 (off)
    assert listed(err, "unsupported") == {
        "actor_rollout_ref.actor.entropy_coeff",  # 0.001: no entropy bonus
        "actor_rollout_ref.actor.kl_loss_type",  # k1
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",  # true
    }
    assert lr.trainer.loggers == ["console", "jsonl", "mlflow"] and lr.trainer.mlflow_experiment == "DAPO"
    assert {"critic.ppo_mini_batch_size", "critic.optim.lr", "reward_model.enable", "reward_model.model.path",
            "algorithm.gamma", "actor_rollout_ref.actor.ppo_micro_batch_size"} <= listed(err, "ignored")
    # verl's custom_reward_function: its compute_score is called unchanged, in verl's spelling.
    (fn,) = cfg.rewarder.spec.functions
    assert (fn.type, fn.function, str(fn.path)) == ("file", "compute_score", "/work/reward.py")
    assert fn.reward_kwargs == {"format_score": 0.1}


def test_verl_bad_values_fail_naming_both_keys(tmp_path, capsys):
    rc, out, err = run(tmp_path, capsys, "verl", "algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=1\n",
                       name="run.sh")
    assert rc == 2 and not out.exists()
    assert "learner.rollout.n=1" in err and "actor_rollout_ref.rollout.n" in err


def test_verl_other_estimators_are_listed(tmp_path, capsys):
    rc, _, err = run(tmp_path, capsys, "verl", "algorithm:\n  adv_estimator: gae\n")
    assert rc == 0
    assert "unsupported: algorithm.adv_estimator='gae': 'gae': dgrpo trains GRPO only" in err


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_trl_grpo_config(tmp_path, capsys, fmt):
    text = json.dumps(TRL_CONFIG) if fmt == "json" else yaml.safe_dump(TRL_CONFIG)
    rc, out, err = run(tmp_path, capsys, "trl", text, "--num-processes", "2", name=f"grpo.{fmt}")
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    cfg.check_whole_stack()
    lr, alg = cfg.learner, cfg.learner.algorithm
    # 16 completions x 2 processes x 4 accumulation steps = 128 per update = 8 prompts of 16; one update per step
    assert (lr.data.train_batch_size, lr.actor.ppo_mini_batch_size, lr.actor.micro_batch_size_per_device) == (8, 8, 16)
    assert (lr.rollout.n, lr.rollout.max_response_length, lr.data.max_prompt_length) == (16, 1024, 512)
    assert (lr.trainer.total_training_steps, lr.optim.warmup_steps, lr.optim.schedule) == (100, 10, "cosine")
    assert lr.optim.lr == 3e-6 and lr.optim.weight_decay == 0.0  # transformers' default weight decay
    assert (alg.beta, alg.clip_low, alg.clip_high, alg.clip_ratio_c) == (0.04, 0.2, 0.28, 1.5)
    assert (alg.loss_agg, alg.loss_scale_factor) == ("seq-mean-token-sum-norm", 1024)  # dr_grpo
    assert (alg.adv_scale, alg.mask_truncated, alg.tis_cap) == ("none", True, 2.0)
    assert lr.rollout.temperature == 0.7 and cfg.sampler.gpu_memory_utilization == 0.7
    assert (lr.checkpoint.save_freq, lr.checkpoint.keep_last, lr.checkpoint.dir) == (50, 1, "data/Qwen2.5-1.5B-GRPO")
    assert lr.trainer.loggers == ["console", "jsonl", "wandb"] and lr.data.seed == 42 == lr.trainer.seed
    assert lr.trainer.log_completions and lr.trainer.num_completions_to_print == 4
    assert cfg.model.path == "/models/Qwen2.5-1.5B-Instruct" and lr.actor.gradient_checkpointing
    assert listed(err, "unsupported") == {"dataset_name", "reward_weights", "top_entropy_quantile"}
    assert {"use_vllm", "logging_steps", "bf16", "save_strategy"} <= listed(err, "ignored")


def test_trl_defaults_where_ours_differ(tmp_path, capsys):
    rc, out, err = run(tmp_path, capsys, "trl", "learning_rate: 1.0e-5\n")
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    lr = cfg.learner
    assert lr.rollout.n == 8 and lr.optim.weight_decay == 0.0 and lr.optim.schedule == "linear"
    assert (lr.data.train_batch_size, lr.actor.ppo_mini_batch_size, lr.actor.micro_batch_size_per_device) == (1, 1, 8)
    assert lr.algorithm.loss_agg == "token-mean"  # TRL's default loss_type dapo
    assert "(transformers' default: linear decay)" in out.read_text()


def test_trl_batch_that_does_not_form_groups(tmp_path, capsys):
    rc, _, err = run(tmp_path, capsys, "trl", "num_generations: 4\nper_device_train_batch_size: 6\n")
    assert rc == 2 and "num_generations=4" in err and "per_device_train_batch_size=6" in err


def test_trl_delta_that_also_clips_positive_advantages_is_listed(tmp_path, capsys):
    rc, out, err = run(tmp_path, capsys, "trl", "delta: 1.1\nepsilon_high: 0.28\n")
    assert rc == 0
    assert load_config(StackConfig, out).learner.algorithm.clip_ratio_c is None
    assert "unsupported: delta=1.1" in err


def test_unreadable_input_is_a_clear_error(tmp_path, capsys):
    rc, _, err = run(tmp_path, capsys, "verl", "just words\n", name="notes.txt")
    assert rc == 2 and "neither a YAML/JSON mapping nor key=value overrides" in err
    assert dgrpo_main(["import-config", "--from", "verl", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_verl_multi_turn_tool_run(tmp_path, capsys):
    """verl's GSM8K tool-agent script (examples/sglang_multiturn): multi_turn maps onto learner.rollout.multi_turn;
    simulated-user settings, which dgrpo does not have, are listed."""
    script = (
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\\n"
        "    actor_rollout_ref.rollout.multi_turn.enable=True \\\n"
        "    actor_rollout_ref.rollout.multi_turn.tool_config_path=/cfg/gsm8k_tool_config.yaml \\\n"
        "    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5 \\\n"
        "    actor_rollout_ref.rollout.multi_turn.max_user_turns=2 \\\n"
        "    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=512 \\\n"
        "    actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right \\\n"
        "    actor_rollout_ref.rollout.multi_turn.format=hermes \\\n"
        "    actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True\n")
    rc, out, err = run(tmp_path, capsys, "verl", script, name="run.sh")
    assert rc == 0, err
    mt = load_config(StackConfig, out).learner.rollout.multi_turn
    assert (mt.enable, mt.tool_config_path, mt.max_assistant_turns) == (True, "/cfg/gsm8k_tool_config.yaml", 5)
    assert (mt.max_tool_response_length, mt.tool_response_truncate_side, mt.format) == (512, "right", "hermes")
    assert "actor_rollout_ref.rollout.multi_turn.max_user_turns" in listed(err, "ignored")
    assert "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template" in listed(err, "unsupported")


def test_verl_lora_keys(tmp_path, capsys):
    """verl's run_qwen2_5-3b_gsm8k_grpo_lora.sh settings: lora_rank / lora_alpha / target_modules onto learner.lora;
    use_shm and layered_summon are how verl feeds its colocated rollout, listed as ignored."""
    script = VERL_SCRIPT.replace(
        "actor_rollout_ref.actor.optim.lr=1e-6 \\",
        "actor_rollout_ref.actor.optim.lr=3e-5 \\\n    actor_rollout_ref.model.lora_rank=64 \\\n"
        "    actor_rollout_ref.model.lora_alpha=32 \\\n    actor_rollout_ref.model.target_modules=all-linear \\\n"
        "    actor_rollout_ref.model.use_shm=True \\\n    actor_rollout_ref.rollout.layered_summon=True \\\n"
        "    actor_rollout_ref.model.layered_summon=True \\")
    rc, out, err = run(tmp_path, capsys, "verl", script, name="lora.sh")
    assert rc == 0, err
    lora = load_config(StackConfig, out).learner.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.merge_on_sync) == (64, 32.0, "all-linear", "auto")
    assert {"actor_rollout_ref.model.use_shm", "actor_rollout_ref.model.layered_summon"} <= listed(err, "ignored")


def test_trl_peft_settings(tmp_path, capsys):
    """TRL's ModelConfig PEFT arguments (use_peft, lora_r, ...); without use_peft they are ignored, as TRL does."""
    rc, out, err = run(tmp_path, capsys, "trl", "use_peft: true\nlora_r: 32\nlora_alpha: 64\n"
                       "lora_target_modules: [q_proj, k_proj, v_proj, o_proj]\nuse_dora: true\n")
    assert rc == 0, err
    lora = load_config(StackConfig, out).learner.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (32, 64.0, 0.05)  # TRL's default lora_dropout
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert "use_dora" in listed(err, "unsupported")
    rc, out, err = run(tmp_path, capsys, "trl", "use_peft: true\n", name="defaults.yaml")
    lora = load_config(StackConfig, out).learner.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32.0, ["q_proj", "v_proj"])
    rc, out, err = run(tmp_path, capsys, "trl", "lora_r: 8\n", name="off.yaml")
    assert load_config(StackConfig, out).learner.lora.rank == 0 and "lora_r" in listed(err, "ignored")
