"""Rewarder test fixtures: reward files with good and bad functions, a tiny random reward model, a config helper."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REWARD_FILE = '''
"""Test reward functions: TRL signature, good and bad."""
import asyncio
import math
import os
import time


def answer_in_completion(prompts, completions, answer, **kwargs):
    # TRL style: `answer` is an extra column, one value per completion.
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


_LOOPS = set()


async def async_length(prompts, completions, **kwargs):
    # Like a judge client kept across calls: the worker must await every call on the same event loop.
    _LOOPS.add(asyncio.get_running_loop())  # kept alive, so two loops never share an identity
    assert len(_LOOPS) == 1, "a new event loop per call"
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def only_long(prompts, completions, **kwargs):
    return [1.0 if len(c) > 5 else None for c in completions]


def conversational(prompts, completions, **kwargs):
    # TRL conversational format: prompts are message lists, completions [{"role": "assistant", ...}].
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]


def raises(prompts, completions, **kwargs):
    raise ValueError("no reward today")


def hangs(prompts, completions, **kwargs):
    if any("hang" in c for c in completions):
        time.sleep(600)
    return [0.5] * len(completions)


def crashes(prompts, completions, **kwargs):
    if any("crash" in c for c in completions):
        os._exit(7)
    return [0.25] * len(completions)


def wrong_count(prompts, completions, **kwargs):
    return [1.0]


def bad_values(prompts, completions, **kwargs):
    return [math.nan, math.inf, "high"][: len(completions)] + [1.0] * max(0, len(completions) - 3)
'''


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "test_rewards.py"
    path.write_text(REWARD_FILE)
    return path


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    """A 2-layer random LlamaForSequenceClassification (1 label) with the bundled tokenizer, saved as a folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from dgrpo.common.models import prepare_bundled_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_bundled_model())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        num_labels=1, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-rm")
    LlamaForSequenceClassification(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def file_fn(path: Path, function: str, **kw) -> dict:
    return {"type": "file", "path": str(path), "function": function, **kw}


@pytest.fixture
def no_hf_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return os.environ
