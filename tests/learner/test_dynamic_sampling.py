"""DAPO's dynamic sampling and overlong shaping in real runs on the demo task (arithmetic prompts, dgrpo.cli.tasks):
the session's shared sampler replicas (tests/shared_services.py: vLLM on CPU, the tiny model, max_model_len 512,
pause_mode=keep), a rewarder of this module's, and learners with learner.algorithm.filter_groups on,
lockstep and asynchronous (rollout.max_staleness). The reward is a coin toss per completion (character-count parity)
plus DAPO's length penalty, so about half the groups of two carry no signal: the metrics must show them dropped and
replaced, every trained step holding train_batch_size groups, none of them flat.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from loop_support import REWARD_FNS, read_jsonl
from support import ServiceProcess, free_port

from dgrpo.cli.tasks import write_task

pytestmark = pytest.mark.slow
BATCH, STEPS = 4, 2
SPEC = (f"rewarder.spec={{name: parity, functions: [{{type: file, path: {REWARD_FNS}, function: char_parity}}, "
        "{type: length, name: always_one, max_length: 100000, weight: 0.0}]}")


@pytest.fixture(scope="module")
def _config(_shared_replicas_session, tmp_path_factory):
    """This module's rewarder (the parity reward) and learner config for the shared replicas."""
    root = tmp_path_factory.mktemp("dapo")
    shared = _shared_replicas_session
    rport = free_port()
    rewarder = ServiceProcess("rewarder", [f"rewarder.port={rport}", "rewarder.host=127.0.0.1", "rewarder.workers=1",
                                           SPEC], rport)
    try:
        rewarder.wait_ready(timeout=400)
        train, _ = write_task(root / "task", n_train=64, n_val=4, seed=1, fmt="jsonl")
        config = {
            "model": {"path": shared.model_path, "dtype": "float32"},
            "sampler": {"addresses": shared.addresses, "max_model_len": shared.max_model_len},
            "weights": shared.weights,
            "learner": {
                "data": {"train_files": [str(train)], "train_batch_size": BATCH, "max_prompt_length": 128, "seed": 2},
                # unseeded: the tiny random model's samples hardly depend on the prompt, so a fixed seed would give
                # every group of a call the same pair of completions
                "rollout": {"n": 2, "max_response_length": 16, "rewarder_address": rewarder.address},
                "actor": {"ppo_mini_batch_size": BATCH, "micro_batch_size_per_device": 8, "dtype": "float32",
                          "compute_entropy": False},
                "algorithm": {
                    # verl's seq_reward: the final reward, DAPO's length penalty included
                    "filter_groups": {"enable": True, "metric": "seq_reward", "max_num_gen_batches": 8},
                    "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 0.5},
                },
                "optim": {"lr": 1e-3},
                "checkpoint": {"save_freq": 0, "keep_last": None},
                "trainer": {"total_training_steps": STEPS, "control_port": 0, "log_dir": str(root / "runs")},
            },
        }
        (root / "stack.yaml").write_text(yaml.safe_dump(config))
        yield {"root": root, "config": root / "stack.yaml"}
    finally:
        rewarder.stop(timeout=30)


@pytest.fixture
def stack(shared_replicas, _config):
    """The shared replicas (whole) and this module's rewarder and config."""
    assert shared_replicas.weights["pause_mode"] == "keep"  # the asynchronous run's in-flight updates
    return {**_config, "shared": shared_replicas}


def learner(stack, name: str, *overrides: str) -> subprocess.CompletedProcess:
    root = stack["root"]
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(stack["config"]),
           f"learner.checkpoint.dir={root / ('ckpt_' + name)}", f"learner.trainer.run_name={name}", *overrides]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)


def check_steps(stack, name: str) -> list[dict]:
    steps = [r for r in read_jsonl(stack["root"] / "runs" / name / "metrics.jsonl") if "actor/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:
        assert r["rollout/trained_groups"] == r["filter_groups/kept_groups"] == BATCH  # the full count, every step
        assert r["reward/frac_zero_std"] == 0.0  # no flat group was trained
        assert r["filter_groups/extra_prompts"] == r["filter_groups/filtered_groups"]  # each dropped one replaced
        assert r["filter_groups/requested_prompts"] == BATCH + r["filter_groups/filtered_groups"]
        assert r["reward/fn/overlong_reward"] <= 0.0 and "reward/fn/char_parity" in r
    assert sum(r["filter_groups/filtered_groups"] for r in steps) > 0  # some groups were dropped
    return steps


def test_lockstep_run_trains_only_informative_groups(stack):
    proc = learner(stack, "lockstep")
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = check_steps(stack, "lockstep")
    # the length penalty is in the reward: completions of 16 tokens (the maximum) lose penalty_factor
    assert any(r["reward/fn/overlong_reward"] < 0 for r in steps)


def test_asynchronous_run_with_staleness(stack):
    proc = learner(stack, "async", "learner.rollout.max_staleness=1")
    assert proc.returncode == 0, proc.stderr[-6000:]
    steps = check_steps(stack, "async")
    assert all(r["staleness/max"] <= 1 for r in steps)


def test_cap_stops_the_run_as_verl_does(stack):
    """A metric that never differs (a constant function): after max_num_gen_batches x train_batch_size prompts the
    learner stops with verl's advice, naming the key."""
    proc = learner(stack, "capped", "learner.algorithm.filter_groups.metric=always_one",
                   "learner.algorithm.filter_groups.max_num_gen_batches=2")
    assert proc.returncode != 0
    assert "learner.algorithm.filter_groups.max_num_gen_batches" in proc.stderr and "0 of 4 groups" in proc.stderr



def test_verl_dapo_recipe_imports_and_runs(stack, tiny_model):
    """verl's recipe/dapo/run_dapo_qwen2.5_32b.sh, imported as a user would (its MODEL_PATH and TRAIN_FILE given in
    the environment), runs with only the sizes scaled down for a CPU: dynamic sampling on `acc` with verl's cap,
    the overlong buffer, clip-higher, token-mean, as the recipe sets them."""
    from dgrpo.cli.main import main as dgrpo_main

    root, recipe = stack["root"], Path(__file__).parents[1] / "fixtures" / "verl_scripts" / "run_dapo_qwen2.5_32b.sh"
    base = yaml.safe_load(stack["config"].read_text())
    imported = root / "dapo_32b.yaml"
    train = base["learner"]["data"]["train_files"][0]
    assert dgrpo_main(["import-config", "--from", "verl", str(recipe), "-o", str(imported), "--env", "HOME=/home/u",
                       "--env", f"MODEL_PATH={tiny_model}", "--env", f"TRAIN_FILE={train}",
                       "--env", f"TEST_FILE={train}"]) == 0
    alg = yaml.safe_load(imported.read_text())["learner"]["algorithm"]
    assert alg["filter_groups"] == {"enable": True, "max_num_gen_batches": 10, "metric": "acc", "gen_batch_size": 1536}
    scale = [  # the services of this module, and sizes a CPU runs in seconds
        f"sampler.addresses={base['sampler']['addresses']}", "sampler.max_model_len=256", "model.dtype=float32",
        "sampler.max_num_batched_tokens=256", "sampler.tensor_parallel_size=1", "sampler.gpu_memory_utilization=0.5",
        f"weights.announce_port={base['weights']['announce_port']}", "weights.pause_mode=keep",
        f"weights.control_port={base['weights']['control_port']}",
        f"learner.rollout.rewarder_address={base['learner']['rollout']['rewarder_address']}",
        "learner.data.train_batch_size=4", "learner.data.max_prompt_length=128", "learner.data.val_files=[]",
        "learner.rollout.n=2", "learner.rollout.max_response_length=16", "learner.actor.ppo_mini_batch_size=4",
        "learner.actor.max_tokens_per_micro_batch=512", "learner.actor.logprob_max_tokens_per_micro_batch=512",
        "learner.actor.dtype=float32", "learner.actor.gradient_checkpointing=false",
        "learner.algorithm.filter_groups.gen_batch_size=4", "learner.algorithm.overlong_buffer.len=4",
        "learner.trainer.total_training_steps=1", "learner.trainer.total_epochs=1", "learner.trainer.loggers=[jsonl]",
        "learner.trainer.val_before_train=false", "learner.trainer.test_freq=0", "learner.trainer.control_port=0",
        f"learner.trainer.log_dir={root / 'runs'}", "learner.trainer.run_name=dapo_32b",
        f"learner.checkpoint.dir={root / 'ckpt_dapo_32b'}", "learner.checkpoint.resume=never",
    ]
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(imported), *scale]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (step,) = [r for r in read_jsonl(root / "runs" / "dapo_32b" / "metrics.jsonl") if "actor/loss" in r]
    assert step["rollout/trained_groups"] == step["filter_groups/kept_groups"] == 4
    assert step["reward/frac_zero_std"] == 0.0 and step["reward/fn/overlong_reward"] < 0


def test_learner_refuses_a_replica_whose_context_cannot_hold_its_requests(stack):
    """The replicas (max_model_len 512) would refuse max_tokens past their context: the learner finds out from their
    Info before the first step, naming both sides, instead of failing mid-run (the config claims 1024)."""
    real = stack["shared"].max_model_len
    prompt = real - 10  # + max_response_length 16: past the replicas' context, within the config's claim
    proc = learner(stack, "ctx", "sampler.max_model_len=1024", f"learner.data.max_prompt_length={prompt}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"has max_model_len={real}" in proc.stderr and f"learner.data.max_prompt_length={prompt}" in proc.stderr
