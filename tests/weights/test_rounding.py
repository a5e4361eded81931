"""Stochastic rounding of published weights (weights/rounding.py): unbiased, and only ever a bf16 neighbour."""

import pytest
import torch

from dgrpo.weights import rounding
from dgrpo.weights.rounding import publish_cast, stochastic_bf16


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each |x| (truncation and one step up), with x's sign."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    return low, high


def test_small_updates_survive_on_average():
    """A weight moved by 3e-5 (a fraction of bf16's step at 0.05): nearest rounding drops the move, stochastic
    rounding keeps it in the mean, for positive and negative weights alike."""
    g = torch.Generator().manual_seed(0)
    x = torch.tensor([0.05, -0.05]).repeat_interleave(50_000) + torch.tensor([3e-5, -3e-5]).repeat_interleave(50_000)
    assert torch.equal(x.to(torch.bfloat16), torch.tensor([0.05, -0.05]).repeat_interleave(50_000).to(torch.bfloat16))
    draws = torch.stack([stochastic_bf16(x, g).float() for _ in range(20)])  # [20, 100k]
    pos, neg = draws[:, :50_000].mean(), draws[:, 50_000:].mean()
    assert abs(pos - x[0]) < 2e-6 and abs(neg - x[-1]) < 2e-6  # nearest is 1.9e-5 off
    low, high = neighbours(x)
    assert ((draws == low) | (draws == high)).all()


def test_exact_values_and_shapes_are_kept(monkeypatch):
    """bf16-representable weights come back unchanged; tensors longer than the random pool (it is reused
    cyclically) and of any shape round correctly."""
    monkeypatch.setattr(rounding, "_POOL", 1000)
    g = torch.Generator().manual_seed(1)
    exact = torch.randn(7, 333).to(torch.bfloat16)
    assert torch.equal(stochastic_bf16(exact.float(), g), exact)
    x = torch.randn(3, 1001, 7)
    y = stochastic_bf16(x, g)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    low, high = neighbours(x)
    assert ((y.float() == low) | (y.float() == high)).all()
    with pytest.raises(ValueError, match="fp32"):
        stochastic_bf16(exact, g)


def test_publish_cast():
    x = torch.full((10_000,), 0.05 + 3e-5)

    def published(dtype, rounding, seed):
        gather_dtype, cast = publish_cast(dtype, rounding, seed)
        return cast(x.to(gather_dtype))  # what Actor.named_weights(dtype=gather_dtype) then the cast give

    assert torch.equal(published(torch.bfloat16, "nearest", 0), x.to(torch.bfloat16))
    assert published(torch.float16, "stochastic", 0).dtype == torch.float16  # fp16: nearest
    a, b = published(torch.bfloat16, "stochastic", 5), published(torch.bfloat16, "stochastic", 5)
    assert torch.equal(a, b)  # seeded: a rerun publishes the same bits
    assert len(torch.unique(a)) == 2
