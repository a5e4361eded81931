"""`dgrpo import-config` on verl's own example and recipe scripts and on an open-r1 recipe, as upstream writes them
(tests/fixtures/, sources in verl_scripts/SOURCES.md): what their shell variables hold reaches the config as values,
DAPO's dynamic sampling and overlong shaping map onto learner.algorithm, and every dropped key is classified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from dgrpo.cli.main import main as dgrpo_main
from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config

FIXTURES = Path(__file__).parent / "fixtures"
VERL = FIXTURES / "verl_scripts"
OPEN_R1 = FIXTURES / "trl_recipes" / "openr1_Qwen2.5-1.5B-Instruct_grpo_config_demo.yaml"
ENV = {"HOME": "/home/u", "PWD": "/work/run"}


def run(capsys, tmp_path, source: str, path: Path, *extra: str, monkeypatch, env: dict | None = None):
    """import-config with exactly `env` (default ENV) and PATH as the process environment."""
    for k in list(os.environ):
        if k != "PATH":
            monkeypatch.delenv(k, raising=False)
    for k, v in (ENV if env is None else env).items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "stack.yaml"
    rc = dgrpo_main(["import-config", "--from", source, str(path), "-o", str(out), *extra])
    return rc, out, capsys.readouterr().err


def listed(err: str, kind: str) -> dict[str, str]:
    rows = [line.split(": ", 1)[1] for line in err.splitlines() if line.startswith(kind + ": ")]
    return {row.split("=", 1)[0]: row for row in rows}


@pytest.mark.parametrize("name", sorted(p.name for p in VERL.glob("*.sh")))
def test_every_verl_script_imports_without_shell_text(name, capsys, tmp_path, monkeypatch):
    rc, out, err = run(capsys, tmp_path, "verl", VERL / name, monkeypatch=monkeypatch)
    assert rc == 0, err
    text = out.read_text()
    config_part = text.split("\n# Imported by", 1)[0]
    assert "$" not in config_part, config_part  # never a `$name` written into a config
    load_config(StackConfig, out).check_whole_stack()
    # the script's own variables are not keys: nothing listed is a bare shell name
    assert all("." in k or k.startswith("model_engine") for kind in ("ignored", "unsupported")
               for k in listed(err, kind)), err


def test_dapo_recipe_with_overlong_buffer(capsys, tmp_path, monkeypatch):
    """recipe/dapo/test_dapo_7b_math.sh: $((1024 * 2)) arrives as 2048 (the issue's TypeError), the overlong
    buffer of reward_manager=dapo is DAPO's length penalty, not 'ignored'."""
    rc, out, err = run(capsys, tmp_path, "verl", VERL / "test_dapo_7b_math.sh", monkeypatch=monkeypatch)
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    lr, alg = cfg.learner, cfg.learner.algorithm
    assert (lr.data.max_prompt_length, lr.rollout.max_response_length) == (2048, 8192)
    assert cfg.sampler.max_model_len == 2048 + 8192 and cfg.sampler.max_num_batched_tokens == 10240
    assert (lr.actor.max_tokens_per_micro_batch, lr.actor.logprob_max_tokens_per_micro_batch) == (20480, 30720)
    buffer = alg.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 4096, 1.0)
    assert alg.overlong_buffer.max_response_length is None  # max_resp_len == max_response_length
    assert not alg.filter_groups.enable
    assert cfg.model.path == "/home/u/verl/models/Qwen2.5-Math-7B"
    assert lr.data.train_files == ["/home/u/verl/data/dapo-math-17k.parquet"]
    assert lr.checkpoint.dir == "/home/u/verl/ckpts/DAPO/DAPO-Qwen2.5-7b-MATH-0527a1"
    ignored, unsupported = listed(err, "ignored"), listed(err, "unsupported")
    assert "reward_model.reward_manager" in ignored and "overlong_buffer" in ignored["reward_model.reward_manager"]
    assert not any(k.startswith("reward_model.reward_kwargs.overlong_buffer_cfg.") and not k.endswith(".log")
                   for k in ignored)
    assert {"actor_rollout_ref.actor.fsdp_config.param_offload",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "actor_rollout_ref.actor.fsdp_config.fsdp_size", "actor_rollout_ref.rollout.val_kwargs.top_p",
            "actor_rollout_ref.model.override_config.max_position_embeddings",
            "custom_reward_function.path"} <= set(unsupported)


def test_dapo_recipe_with_dynamic_sampling(capsys, tmp_path, monkeypatch):
    """recipe/dapo/run_dapo_qwen2.5_32b.sh (behind `ray job submit ... --`): filter_groups with acc and a cap of
    10 generation batches of gen_prompt_bsz=$((train_prompt_bsz * 3)), the older custom_reward_function spelling
    of the overlong buffer."""
    rc, out, err = run(capsys, tmp_path, "verl", VERL / "run_dapo_qwen2.5_32b.sh", monkeypatch=monkeypatch)
    assert rc == 0, err
    alg = load_config(StackConfig, out).learner.algorithm
    fg = alg.filter_groups
    assert (fg.enable, fg.metric, fg.max_num_gen_batches, fg.gen_batch_size) == (True, "acc", 10, 1536)
    assert (alg.overlong_buffer.enable, alg.overlong_buffer.len) == (True, 4096)
    assert "actor_rollout_ref.actor.use_token_level_loss" in listed(err, "ignored")  # token-mean, as dgrpo


def test_array_of_overrides(capsys, tmp_path, monkeypatch):
    """verl's TPU example passes "${common_params[@]}": every element is an override, $((...)) included."""
    rc, out, err = run(capsys, tmp_path, "verl", VERL / "run_qwen3_0_6b_torchtitan.sh",
                       env={**ENV, "ROLLOUT_N": "8"}, monkeypatch=monkeypatch)
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    assert (cfg.learner.data.train_batch_size, cfg.learner.actor.ppo_mini_batch_size) == (8 * 4 * 4, 8 * 4)
    assert cfg.learner.rollout.n == 8 and cfg.learner.data.seed == 42  # ROLLOUT_N from the environment
    assert cfg.learner.trainer.loggers == ["console", "jsonl"]  # verl's `file` logger writes jsonl
    assert "trainer.device" in listed(err, "unsupported")  # tpu


def test_unset_environment_variable_stops_the_import_naming_key_and_variable(capsys, tmp_path, monkeypatch):
    """run_qwen2-7b_math.sh reads $HOME: without it the import stops (the issue's `train_files: ['$train_files']`)
    and --env gives it."""
    rc, out, err = run(capsys, tmp_path, "verl", VERL / "run_qwen2-7b_math.sh", env={}, monkeypatch=monkeypatch)
    assert rc == 2 and not out.exists()
    assert "data.train_files" in err and "$HOME" in err and "--env HOME=VALUE" in err
    rc, out, err = run(capsys, tmp_path, "verl", VERL / "run_qwen2-7b_math.sh", "--env", "HOME=/h", env={},
                       monkeypatch=monkeypatch)
    assert rc == 0, err
    files = load_config(StackConfig, out).learner.data.train_files
    assert files == ["/h/data/gsm8k/train.parquet", "/h/data/math/train.parquet"]
    assert not any(k.endswith("_path") or k.endswith("_files") and "." not in k for k in listed(err, "ignored"))


def test_run_time_values_of_keys_dgrpo_ignores_anyway_are_listed(capsys, tmp_path, monkeypatch):
    script = tmp_path / "run.sh"
    script.write_text("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo trainer.nnodes=$(hostname) "
                      "actor_rollout_ref.rollout.n=$N\n")
    rc, _, err = run(capsys, tmp_path, "verl", script, monkeypatch=monkeypatch)
    assert rc == 2 and "actor_rollout_ref.rollout.n" in err and "$N" in err
    script.write_text("python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo trainer.nnodes=$(hostname)\n")
    rc, _, err = run(capsys, tmp_path, "verl", script, monkeypatch=monkeypatch)
    assert rc == 0 and "command substitution" in listed(err, "ignored")["trainer.nnodes"]


def test_open_r1_recipe(capsys, tmp_path, monkeypatch):
    """open-r1's Qwen2.5-1.5B GRPO demo: its reward_funcs become open-r1's own functions, its script arguments are
    classified."""
    rc, out, err = run(capsys, tmp_path, "trl", OPEN_R1, "--num-processes", "7", monkeypatch=monkeypatch)
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    cfg.check_whole_stack()
    lr = cfg.learner
    # 16 completions x 7 processes x 4 accumulation steps = 448 = 28 groups of 16 per update
    assert (lr.data.train_batch_size, lr.actor.ppo_mini_batch_size, lr.rollout.n) == (28, 28, 16)
    assert (lr.optim.lr, lr.optim.schedule, lr.trainer.total_epochs) == (2e-5, "cosine", 1)
    fns = cfg.rewarder.spec.functions
    assert [(f.name, f.module, f.function, f.weight) for f in fns] == [
        ("accuracy", "open_r1.rewards", "accuracy_reward", 1.0),
        ("format", "open_r1.rewards", "format_reward", 1.0)]
    unsupported = listed(err, "unsupported")
    assert {"dataset_name", "system_prompt", "push_to_hub", "warmup_ratio"} == set(unsupported)
    assert {"attn_implementation", "hub_model_id", "model_revision", "log_level"} <= set(listed(err, "ignored"))
    assert yaml.safe_load(out.read_text())["learner"]["trainer"]["loggers"] == ["console", "jsonl", "wandb"]


def test_yaml_env_interpolations(capsys, tmp_path, monkeypatch):
    """A ppo_trainer YAML's ${oc.env:NAME[,default]} resolves from the environment as hydra would; one left unknown
    (unset, or a resolver dgrpo does not run) stops the import by key."""
    src = tmp_path / "ppo.yaml"
    src.write_text("data:\n  train_files: ${oc.env:DATA_DIR}/train.parquet\n"
                   "  val_files: ${oc.env:NOPE,/d}/val.parquet\n"
                   "actor_rollout_ref:\n  model:\n    path: ${oc.env:MODEL}\nalgorithm:\n  adv_estimator: grpo\n")
    rc, out, err = run(capsys, tmp_path, "verl", src, monkeypatch=monkeypatch, env={"DATA_DIR": "/data"})
    assert rc == 2 and "actor_rollout_ref.model.path" in err and "$MODEL" in err
    rc, out, err = run(capsys, tmp_path, "verl", src, monkeypatch=monkeypatch, env={"DATA_DIR": "/data", "MODEL": "/m"})
    assert rc == 0, err
    cfg = load_config(StackConfig, out)
    assert cfg.learner.data.train_files == ["/data/train.parquet"] and cfg.learner.data.val_files == ["/d/val.parquet"]
    assert cfg.model.path == "/m"
    src.write_text("trainer:\n  default_local_dir: ${oc.select:x,y}\nalgorithm:\n  adv_estimator: grpo\n")
    rc, _, err = run(capsys, tmp_path, "verl", src, monkeypatch=monkeypatch)
    assert rc == 2 and "trainer.default_local_dir" in err and "does not resolve" in err
