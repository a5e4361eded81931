"""Completions without a reward (the rewarder's ERROR, or NO_REWARD when every function returned None) stay out of
their group's baseline: mean and std over the valid rewards only, as TRL's nanmean / nanstd do over NaN rewards, and
advantage 0 for them. Expected values computed independently, in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from dgrpo.learner.update.grpo import group_advantages


def _expected(rewards: list[float | None], g: int, scale: str, eps: float = 1e-6) -> list[float]:
    """NaN-aware GRPO advantages, the slow and obvious way."""
    def std(xs):  # Bessel-corrected
        m = sum(xs) / len(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))

    everything = [r for r in rewards if r is not None]
    out = []
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        valid = [r for r in group if r is not None]
        if len(valid) < 2 or len(set(valid)) == 1:
            out += [0.0] * g
            continue
        mean = sum(valid) / len(valid)
        denom = {"group": std(valid) + eps, "batch": std(everything) + eps, "none": 1.0}[scale]
        out += [0.0 if r is None else (r - mean) / denom for r in group]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_invalid_completions_leave_the_baseline(scale):
    rewards = [1.0, 0.0, None, 0.5, 2.0, None, None, None, 3.0, 3.0,
               None, 3.0, 0.0, 1.0, 2.0, 4.0, 7.0, None, None, 1.0]
    valid = torch.tensor([r is not None for r in rewards])
    # What the learner holds for an invalid completion: the mean of its group's valid rewards (any value would do).
    filled = torch.tensor([9.9 if r is None else r for r in rewards])
    got = group_advantages(filled, 4, scale, valid=valid)
    assert got.tolist() == pytest.approx(_expected(rewards, 4, scale), abs=1e-5)
    assert (got[~valid] == 0).all()


def test_all_valid_is_the_plain_formula():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0])
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(r, 4, scale, valid=torch.ones(8, dtype=torch.bool)),
                           group_advantages(r, 4, scale))
    with pytest.raises(ValueError, match="valid has shape"):
        group_advantages(r, 4, valid=torch.tensor([True, False]))
