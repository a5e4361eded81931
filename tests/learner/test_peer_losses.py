"""Our loss options against the formulas as verl and TRL write them.

Each peer's formula is re-implemented here in plain torch, written the way the peer's source writes it (verl:
verl/trainer/ppo/core_algos.py `compute_policy_loss_vanilla`, `agg_loss`, `kl_penalty`; TRL:
trl/trainer/grpo_trainer.py `GRPOTrainer._compute_loss`), independently of dgrpo.learner.update.grpo, and compared with
ours on random inputs: values, gradients and the clip statistics. docs/peers.md is the table these tests back.
"""

from __future__ import annotations

import pytest
import torch

from dgrpo.learner.update import grpo
from dgrpo.learner.update.config import TRL_LOSS_TYPES, AlgorithmConfig

B, T = 6, 9


def inputs(seed: int, full_rows: bool = True):
    """Random logprobs with log-ratios of std 1 (ratios up to ~e^3: both PPO clips and the dual clip act), a
    reference far enough for k3 to exceed 10 on some tokens, mixed-sign advantages, ragged masks."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + torch.randn(B, T, generator=g)
    ref = logp + torch.randn(B, T, generator=g) * 1.6
    ref[0, :2] = logp[0, :2] + 3.0  # k3 = e^3 - 4 = 16: the verl cap of 10 acts here at least
    adv = torch.randn(B, generator=g)
    lengths = torch.randint(1 if full_rows else 0, T + 1, (B,), generator=g)
    lengths[0] = T  # one full-length row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return logp, old, ref, adv, mask


# ---- verl, as verl/trainer/ppo/core_algos.py writes it ------------------------------------------------------


def verl_masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """agg_loss on one data-parallel rank without global batch info (verl main since verl-project/verl#5417:
    every seq-mean-* mode divides the sum over sequences by the batch size)."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_denominator = loss_mat.shape[0]
    if loss_agg_mode.startswith("seq-mean-token-sum"):
        seq_losses = (loss_mat * loss_mask).sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            seq_losses = seq_losses / loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        token_counts = torch.sum(loss_mask, dim=-1)
        seq_losses = (loss_mat * loss_mask).sum(dim=-1) / (token_counts + 1e-8)
    else:
        raise ValueError(loss_agg_mode)
    return torch.sum(seq_losses) / seq_denominator


def verl_agg_loss_legacy_sum_norm(loss_mat, loss_mask):
    """agg_loss's seq-mean-token-sum-norm before verl-project/verl#5417: no mean over the sequences."""
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    return torch.sum(seq_losses) / loss_mask.shape[-1]


def verl_policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                     clip_ratio_c, loss_agg_mode):
    """compute_policy_loss_vanilla: PPO clip, then the dual clip for negative advantages."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(),
                                         response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, pg_clipfrac_lower


def verl_kl_penalty_low_var_kl(logprob, ref_logprob):
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = ratio - kl - 1
    return torch.clamp(kld, min=-10, max=10)


def verl_actor_loss(old, logp, ref, adv, mask, mode, kl_loss_coef, clip=0.2, clip_high=0.28, c=3.0):
    """dp_actor's policy loss with use_kl_loss: pg_loss + agg_loss(kld) * kl_loss_coef; advantages per token."""
    adv_tok = adv[:, None].expand_as(logp)  # verl broadcasts the sequence advantage over the response
    pg_loss, clipfrac, clipfrac_lower = verl_policy_loss(old, logp, adv_tok, mask, clip, clip_high, c, mode)
    kld = verl_kl_penalty_low_var_kl(logp, ref)
    kl_loss = verl_agg_loss(kld, mask, mode)
    return pg_loss + kl_loss * kl_loss_coef, clipfrac, clipfrac_lower


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_actor_loss_dual_clip_kl_cap_and_aggregation(mode, seed):
    logp, old, ref, adv, mask = inputs(seed)
    kl_coef = 0.05
    lp_verl = logp.clone().requires_grad_(True)
    want, clipfrac, clipfrac_lower = verl_actor_loss(old, lp_verl, ref, adv, mask, mode, kl_coef)
    want.backward()

    lp = logp.clone().requires_grad_(True)
    got, stats = grpo.policy_loss(lp, old, adv, mask, ref_logp=ref, beta=kl_coef, clip_low=0.2, clip_high=0.28,
                                  agg=mode, max_response_length=T, clip_ratio_c=3.0, kl_cap=10.0)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad, lp_verl.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["clip_frac_low"] + stats["clip_frac_high"], clipfrac)
    torch.testing.assert_close(stats["clip_frac_dual"], clipfrac_lower)
    # The inputs exercise what is compared: the dual clip, the KL cap and both PPO clips act on some tokens.
    assert clipfrac_lower > 0 and clipfrac > 0
    assert ((verl_kl_penalty_low_var_kl(logp, ref) >= 10) * mask).sum() > 0


def test_dual_clip_and_kl_cap_change_the_loss():
    """Without clip_ratio_c / kl_cap ours is not verl's on these inputs: the comparison above is not vacuous."""
    logp, old, ref, adv, mask = inputs(0)
    want, _, _ = verl_actor_loss(old, logp, ref, adv, mask, "token-mean", 0.05)
    plain, stats = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, beta=0.05, clip_high=0.28)
    assert "clip_frac_dual" not in stats
    assert abs(plain.item() - want.item()) > 1e-3


def test_verl_loss_scale_factor():
    logp, old, _, adv, mask = inputs(3)
    adv_tok = adv[:, None].expand_as(logp)
    pg = torch.maximum(-adv_tok * torch.exp(logp - old), -adv_tok * torch.exp(logp - old).clamp(0.8, 1.2))
    want = verl_agg_loss(pg, mask, "seq-mean-token-sum-norm", loss_scale_factor=4096)
    got, _ = grpo.policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", max_response_length=4096)
    torch.testing.assert_close(got, want)


def test_legacy_verl_sum_norm_is_batch_size_times_ours():
    """The difference docs/peers.md states for verl before #5417 (issue verl-project/verl#3741)."""
    mask = inputs(4)[-1]
    pg = torch.randn(B, T)
    ours = grpo.aggregate(pg, mask, "seq-mean-token-sum-norm", max_response_length=T)
    torch.testing.assert_close(verl_agg_loss_legacy_sum_norm(pg, mask), ours * B)


def test_fully_masked_rows_leave_our_seq_means_but_stay_in_the_peers_denominator():
    """The one aggregation difference left (docs/peers.md): a completion dropped whole by mask_truncated."""
    pg = torch.randn(B, T)
    mask = torch.ones(B, T)
    mask[1] = 0
    live = mask.sum(1) > 0
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        ours = grpo.aggregate(pg, mask, mode, max_response_length=T)
        peer = verl_agg_loss(pg, mask, mode)
        torch.testing.assert_close(ours, peer * B / live.sum())


# ---- TRL, as trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss writes it ----------------------------------


def trl_compute_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, completion_mask,
                     loss_type, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, delta=None, max_completion_length=T,
                     num_items_in_batch=None, importance_sampling_ratio=None):
    per_token_kl = (
        torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    )
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if importance_sampling_ratio is not None:
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    mask = completion_mask
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "dapo":
        normalizer = mask.sum() if num_items_in_batch is None else num_items_in_batch  # one process
        loss = (per_token_loss * mask).sum() / normalizer
    else:
        raise ValueError(loss_type)
    is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages.unsqueeze(1) < 0)
    is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages.unsqueeze(1) > 0)
    low_clip = (is_low_clipped * mask).sum() / mask.sum()
    high_clip = (is_high_clipped * mask).sum() / mask.sum()
    return loss, low_clip, high_clip


@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_trl_loss_types_through_our_config_names(loss_type, seed):
    """loss_agg accepts TRL's loss_type name; the mode it resolves to gives TRL's loss (one process, one local
    batch: where bnpo and dapo coincide), with beta, clip-higher and TRL's vLLM importance weights."""
    logp, old, ref, adv, mask = inputs(seed)
    is_ratio = torch.exp(torch.randn(B, T) * 0.3).clamp(max=2.0)
    lp_trl = logp.clone().requires_grad_(True)
    want, low, high = trl_compute_loss(lp_trl, old, ref, adv, mask, loss_type, beta=0.04, epsilon_high=0.28,
                                       importance_sampling_ratio=is_ratio)
    want.backward()

    agg = AlgorithmConfig(loss_agg=loss_type).loss_agg
    lp = logp.clone().requires_grad_(True)
    got, stats = grpo.policy_loss(lp, old, adv, mask, ref_logp=ref, beta=0.04, clip_high=0.28, agg=agg,
                                  max_response_length=T, is_weights=is_ratio)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp.grad, lp_trl.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["clip_frac_low"], low)
    torch.testing.assert_close(stats["clip_frac_high"], high)


def test_trl_dapo_over_accumulated_micro_batches_is_our_token_mean():
    """dapo normalises by the tokens of the whole accumulated batch, as our token-mean over a mini-batch; bnpo
    normalises each local batch by its own tokens and then averages over the accumulation steps."""
    logp, old, ref, adv, mask = inputs(5)
    halves = (slice(0, B // 2), slice(B // 2, B))
    tokens = mask.sum()
    dapo = sum(trl_compute_loss(logp[h], old[h], ref[h], adv[h], mask[h], "dapo", num_items_in_batch=tokens)[0]
               for h in halves)
    bnpo = sum(trl_compute_loss(logp[h], old[h], ref[h], adv[h], mask[h], "bnpo")[0] for h in halves) / 2
    ours, _ = grpo.policy_loss(logp, old, adv, mask, agg="token-mean")
    torch.testing.assert_close(dapo, ours)
    assert mask[halves[0]].sum() != mask[halves[1]].sum() and abs(bnpo.item() - ours.item()) > 1e-4


def test_trl_delta_is_our_dual_clip():
    """TRL's two-sided clipping (`delta`, INTELLECT-2) caps the unclipped ratio at delta; with delta > 1 +
    epsilon_high it only acts on negative advantages and equals verl's dual clip with clip_ratio_c = delta."""
    logp, old, ref, adv, mask = inputs(6)
    lp_trl = logp.clone().requires_grad_(True)
    want, _, _ = trl_compute_loss(lp_trl, old, ref, adv, mask, "dapo", epsilon_high=0.28, delta=2.5)
    want.backward()
    lp = logp.clone().requires_grad_(True)
    got, stats = grpo.policy_loss(lp, old, adv, mask, clip_high=0.28, clip_ratio_c=2.5)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(lp.grad, lp_trl.grad)
    assert stats["clip_frac_dual"] > 0


def test_config_rejects_unknown_loss_names_naming_both_vocabularies():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm.*dr_grpo"):
        AlgorithmConfig(loss_agg="cispo")
    assert AlgorithmConfig(loss_agg="bnpo").loss_agg == "token-mean"
    with pytest.raises(ValueError, match="greater than 1"):
        AlgorithmConfig(clip_ratio_c=1.0)


# ---- through the actor: the options reach the update and its metrics ------------------------------------------


def test_actor_applies_dual_clip_and_reports_its_fraction(tiny_model):
    """Sampler logprobs 2 nats below the policy's: every ratio is e^2 > c = 3. A > 0 tokens are clipped at 1.2
    (pg = -1.2), A < 0 tokens are bounded by the dual clip (pg = 3); token-mean over the mini-batch."""
    from dgrpo.learner.update.actor import Actor
    from dgrpo.learner.update.batch import Sequence
    from dgrpo.learner.update.config import ActorConfig, OptimConfig

    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(8):
        ids = torch.randint(5, 1000, (3 + i % 3 + 2 + i % 4,), generator=g).tolist()
        seqs.append(Sequence(ids[: 3 + i % 3], ids[3 + i % 3 :], 1.0 if i % 2 else -1.0, None))

    def make(**algorithm):
        return Actor(tiny_model, ActorConfig(ppo_mini_batch_size=2, micro_batch_size_per_device=3, dtype="float32"),
                     OptimConfig(lr=1e-3), AlgorithmConfig(old_logprobs="sampler", **algorithm), total_steps=1,
                     max_response_length=8)

    actor = make(clip_ratio_c=3.0)
    logps = actor.compute_logprobs(seqs)
    seqs = [Sequence(s.prompt_ids, s.completion_ids, s.advantage, (lp - 2.0).tolist())
            for s, lp in zip(seqs, logps, strict=True)]
    neg = sum(len(s.completion_ids) for s in seqs if s.advantage < 0)
    total = sum(len(s.completion_ids) for s in seqs)
    m = actor.update(seqs, group_size=4)
    assert m["actor/clip_frac_dual"] == pytest.approx(neg / total, abs=1e-6)
    assert m["actor/loss"] == pytest.approx((neg * 3.0 - (total - neg) * 1.2) / total, rel=1e-5)
    assert "actor/clip_frac_dual" not in make().update(seqs, group_size=4)
