"""The reward model on an accelerator scores like on the CPU (skipped where the device is missing)."""

from __future__ import annotations

import importlib.util

import pytest

TEXTS = ["short", "a much longer completion " * 5, "mid length text here", "x"]


def _score(path, device: str) -> list[float]:
    from dgrpo.rewarder.config import ModelFunction
    from dgrpo.rewarder.reward_model import RewardModel

    rm = RewardModel(ModelFunction(type="model", path=str(path), device=device, dtype="float32"))
    return rm(["Q: "] * len(TEXTS), TEXTS)


# Session-scoped so they run before (and skip without building) the session-scoped tiny_reward_model.
@pytest.fixture(scope="session")
def cuda_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(scope="session")
def ascend_npu():
    if importlib.util.find_spec("torch_npu") is None:
        pytest.skip("no torch_npu")
    import torch
    import torch_npu  # noqa: F401

    if not torch.npu.is_available():
        pytest.skip("no Ascend NPU")


@pytest.mark.cuda
def test_reward_model_on_cuda_matches_cpu(cuda_gpu, tiny_reward_model):
    assert _score(tiny_reward_model, "cuda") == pytest.approx(_score(tiny_reward_model, "cpu"), abs=1e-3)


@pytest.mark.npu
def test_reward_model_on_npu_matches_cpu(ascend_npu, tiny_reward_model):
    assert _score(tiny_reward_model, "npu") == pytest.approx(_score(tiny_reward_model, "cpu"), abs=1e-3)
