"""The GRPO math against numbers computed by hand (the working is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from dgrpo.learner.update import grpo

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # two groups of 4


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected, dtype=torch.float32),
                          atol=tol), actual


def test_group_scale():
    # group 1: mean .25, Bessel std sqrt((.75^2 + 3 * .25^2) / 3) = .5 -> [1.5, -.5, -.5, -.5]
    # group 2: mean .5, std sqrt(4 * .25 / 3) = .57735 -> +-.5 / .57735 = +-.866025
    a = grpo.group_advantages(REWARDS, 4, "group", eps=0.0)
    close(a, [1.5, -0.5, -0.5, -0.5, 0.866025, 0.866025, -0.866025, -0.866025])


def test_batch_scale_keeps_group_mean():
    # batch std: mean .375, sum of squares 3 * .625^2 + 5 * .375^2 = 1.875, / 7 -> std .517549
    a = grpo.group_advantages(REWARDS, 4, "batch", eps=0.0)
    s = math.sqrt(1.875 / 7)
    close(a, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])


def test_none_scale_is_dr_grpo():
    close(grpo.group_advantages(REWARDS, 4, "none"), [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_group_gets_zero_advantage(scale):
    # 0.1 * 3 / 3 is not exactly 0.1 in floating point: the zero must not come from the subtraction.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5])
    a = grpo.group_advantages(rewards, 3, scale)
    assert torch.equal(a[:3], torch.zeros(3))
    assert a[3] > 0 and a[4] < 0
    assert grpo.zero_std_fraction(rewards, 3) == 0.5


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.group_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="group size must be >= 2"):
        grpo.group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="1-D"):
        grpo.group_advantages(torch.zeros(2, 2), 2)


def test_kl_k3():
    # d = log .25 - log .5 = log .5: exp(d) - d - 1 = .5 + .693147 - 1 = .193147
    kl = grpo.kl_k3(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    close(kl, [0.193147, 0.0])


# Two sequences, three tokens; old_logp = 0 so ratio = exp(logp).
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])
LOGP = torch.log(RATIOS)
OLD = torch.zeros(2, 3)
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# pg = max(-A r, -A clamp(r, .8, 1.2)):
#   A = +1: r=1 -> -1;  r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high);  r=.5 -> max(-.5, -.8) = -.5
#   A = -1: r=1 ->  1;  r=1.5 -> max(1.5, 1.2) = 1.5;                    r=.5 -> max(.5, .8) = .8 (clipped low; masked)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("token-mean", (-1 - 1.2 - 0.5 + 1 + 1.5) / 5),  # -0.04
        ("seq-mean-token-mean", ((-2.7 / 3) + (2.5 / 2)) / 2),  # 0.175
        ("seq-mean-token-sum", (-2.7 + 2.5) / 2),  # -0.1
        ("seq-mean-token-sum-norm", ((-2.7 / 4) + (2.5 / 4)) / 2),  # -0.025, max_response_length 4
    ],
)
def test_policy_loss_aggregations(agg, expected):
    loss, stats = grpo.policy_loss(LOGP, OLD, ADV, MASK, agg=agg, max_response_length=4)
    close(loss, expected)
    close(stats["pg_loss"], expected)
    close(stats["clip_frac_high"], 1 / 5)  # only (seq 0, token 1): r > 1.2 with A > 0
    close(stats["clip_frac_low"], 0.0)  # (seq 1, token 2) is clipped low but masked
    close(stats["ratio"], (1 + 1.5 + 0.5 + 1 + 1.5) / 5)
    close(stats["kl"], 0.0)


def test_clip_low_counted_and_clip_higher():
    loss, stats = grpo.policy_loss(LOGP, OLD, ADV, torch.ones(2, 3), clip_high=0.28)
    # clip-higher: r = 1.5 with A = +1 now gives -1.28; the low clip of seq 1 counts (unmasked): .8
    close(loss, (-1 - 1.28 - 0.5 + 1 + 1.5 + 0.8) / 6)
    close(stats["clip_frac_low"], 1 / 6)
    close(stats["clip_frac_high"], 1 / 6)


def test_dual_clip_bounds_negative_advantages_only():
    # c = 1.4: seq 1 (A = -1) token 1 has r = 1.5 > c -> pg = min(1.5, 1.4) = 1.4; seq 0 (A = +1) is untouched
    logp = LOGP.clone().requires_grad_(True)
    loss, stats = grpo.policy_loss(logp, OLD, ADV, MASK, clip_ratio_c=1.4)
    close(loss, (-1 - 1.2 - 0.5 + 1 + 1.4) / 5)  # -0.06
    close(stats["clip_frac_dual"], 1 / 5)
    loss.backward()
    close(logp.grad, [[-0.2, 0.0, -0.1], [0.2, 0.0, 0.0]])  # the dual-clipped token is constant: no gradient
    with pytest.raises(ValueError, match="clip_ratio_c"):
        grpo.policy_loss(LOGP, OLD, ADV, MASK, clip_ratio_c=1.0)


def test_kl_cap():
    ref = LOGP + math.log(0.5)  # k3 = .193147 on every token, capped at .1
    loss, stats = grpo.policy_loss(LOGP, OLD, ADV, MASK, ref_logp=ref, beta=0.1, kl_cap=0.1)
    close(loss, -0.04 + 0.1 * 0.1)
    close(stats["kl"], 0.1)
    close(grpo.kl_k3(LOGP, ref, cap=1.0), [[0.193147] * 3] * 2)  # below the cap: unchanged


def test_gradient_is_zero_where_clipped_or_masked():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, OLD, ADV, MASK)
    loss.backward()
    # d(-A r)/d logp = -A r, divided by the 5 tokens: seq 0 token 0 -> -1/5, token 2 -> -.5/5; seq 1 token 1 -> 1.5/5
    close(logp.grad, [[-0.2, 0.0, -0.1], [0.2, 0.3, 0.0]])


def test_kl_term_in_loss():
    ref = LOGP + math.log(0.5)  # ref - logp = log .5 on every token -> k3 = .193147
    loss, stats = grpo.policy_loss(LOGP, OLD, ADV, MASK, ref_logp=ref, beta=0.1)
    close(loss, -0.04 + 0.1 * 0.193147)
    close(stats["kl"], 0.193147)
    close(stats["pg_loss"], -0.04)
    loss0, stats0 = grpo.policy_loss(LOGP, OLD, ADV, MASK, ref_logp=ref, beta=0.0)
    close(loss0, -0.04)  # beta 0: KL measured, not in the loss
    close(stats0["kl"], 0.193147)


def test_truncated_importance_weights():
    old = torch.log(torch.tensor([[0.6, 0.2, 0.4]]))
    sampler = torch.log(torch.tensor([[0.2, 0.4, 0.4]]))
    w = grpo.truncated_is_weights(old, sampler, cap=2.0)
    close(w, [[2.0, 0.5, 1.0]])  # .6/.2 = 3 capped at 2
    loss, _ = grpo.policy_loss(LOGP, OLD, ADV, MASK, is_weights=torch.full((2, 3), 0.5))
    close(loss, -0.02)


def test_mask_truncated_drops_whole_sequences():
    masked = grpo.mask_truncated(MASK, torch.tensor([False, True]))
    close(masked, [[1, 1, 1], [0, 0, 0]])
    loss, _ = grpo.policy_loss(LOGP, OLD, ADV, masked, agg="seq-mean-token-mean")
    close(loss, -2.7 / 3)  # the dropped sequence leaves the seq mean, not just its tokens


def test_all_masked_is_zero_not_nan():
    for agg in grpo.AGGS:
        loss, stats = grpo.policy_loss(LOGP, OLD, ADV, torch.zeros(2, 3), agg=agg, max_response_length=3)
        assert loss.item() == 0.0 and not any(torch.isnan(v) for v in stats.values())


def test_sum_norm_needs_max_length():
    with pytest.raises(ValueError, match="max_response_length"):
        grpo.policy_loss(LOGP, OLD, ADV, MASK, agg="seq-mean-token-sum-norm")
