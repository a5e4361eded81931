"""`dgrpo learner` refuses bad configurations at start, naming the key, before any model is loaded."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    (root / "train.jsonl").write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    config = {
        "sampler": {"max_model_len": 512},
        "learner": {
            "data": {"train_files": [str(root / "train.jsonl")], "train_batch_size": 4, "max_prompt_length": 64},
            "rollout": {"n": 4, "max_response_length": 16},
            "actor": {"ppo_mini_batch_size": 2},
        },
    }
    path = root / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("learner.data.train_batch_size=5",
         "learner.data.train_batch_size=5 is not a multiple of learner.actor.ppo_mini_batch_size=2"),
        ("learner.rollout.n=1", "learner.rollout.n=1: Input should be greater than or equal to 2"),
        ("learner.data.train_files=[/nonexistent/train.jsonl]",
         "learner.data.train_files[0]='/nonexistent/train.jsonl': no such file"),
        ("learner.data.val_files=[data.csv]", "learner.data.val_files[0]='data.csv': unknown format"),
        ("learner.rollout.max_response_length=500",
         ("learner.data.max_prompt_length=64 + learner.rollout.max_response_length=500 exceeds "
          "sampler.max_model_len=512")),
        ("learner.trainer.run_name=a/b", "learner.trainer.run_name='a/b'"),
        ("learner.rollout.temprature=0.7", "learner.rollout.temprature: unknown key"),
    ],
)
def test_bad_configs_fail_at_start_naming_the_key(child_processes, config_file, override, expected):
    cmd = [sys.executable, "-m", "dgrpo.cli", "learner", "--config", str(config_file), override]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 30  # answered before any model or engine is loaded
