"""The GRPO math as small pure tensor functions: advantages, KL, the clipped policy loss, aggregation.

Notation (DeepSeekMath, Shao et al. 2024, "GRPO"): a prompt q has a group of G completions o_1..o_G with
scalar rewards r_1..r_G. Token t of o_i has the policy's logprob `logp`, the clip's anchor `old_logp`
(the policy before this step's updates, or the sampler's), and the frozen reference's `ref_logp`. The sampler's
logprob `sampler_logp` is the behaviour policy's; with `old_logp` the learner's own, `old_logp` is the proximal
policy of decoupled PPO (Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning system for
language reasoning"): the clip keeps each update near it, and the proximal/behaviour ratio corrects for the tokens
having been drawn by another policy (stale weights, other numerics) by weighting (`truncated_is_weights`) or
rejecting (`off_policy_keep`) them.
Shapes: B sequences, T completion tokens (right-padded; `mask` is 1 on real tokens).

Everything here is device-agnostic and free of model code, so reviewers can check it against the papers
and tests/learner/test_grpo_math.py checks it against hand-computed numbers.
"""

from __future__ import annotations

import math
import typing
from typing import Literal

import torch

from dgrpo.learner.update.config import AdvantageScale, LossAgg, MaskedIS, OffPolicyCorrection

AGGS: tuple[str, ...] = typing.get_args(LossAgg)

# exp() of a log-ratio beyond this overflows or dominates the batch; verl clamps the same way.
_LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: AdvantageScale = "group", eps: float = 1e-6,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Group-relative advantages; `rewards` is [N*G] with each group's G rewards contiguous.

    group (DeepSeekMath GRPO):  A_i = (r_i - mean(r_group)) / (std(r_group) + eps)
    batch (as verl/TRL "batch"): A_i = (r_i - mean(r_group)) / (std(r_all) + eps)
    none  (Dr. GRPO, Liu et al. 2025): A_i = r_i - mean(r_group)
    std is Bessel-corrected (torch.std's default, as TRL and verl). A group whose rewards are all equal gets
    exactly A = 0 whatever the scale (no signal; counted by `zero_std_fraction`).
    `valid` ([N*G] bool): completions without a reward (the rewarder's ERROR or NO_REWARD) are left out of the
    means and stds (TRL's nanmean / nanstd over NaN rewards) and get A = 0; a group with fewer than two valid
    rewards has no baseline and gets A = 0 throughout.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (group size must be >= 2)")
    if valid is not None and not bool(valid.all()):
        return _masked_group_advantages(rewards, group_size, scale, eps, valid)
    r = rewards.float().view(-1, group_size)  # [N, G]
    mean = r.mean(dim=1, keepdim=True)  # [N, 1]
    centered = r - mean  # [N, G]
    if scale == "group":
        adv = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        adv = centered / (r.std() + eps)
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"scale {scale!r} is not one of group, batch, none")
    flat = (r == r[:, :1]).all(dim=1, keepdim=True)  # [N, 1] all rewards equal
    return torch.where(flat, torch.zeros_like(adv), adv).view(-1)  # [N*G]


def _masked_group_advantages(rewards: torch.Tensor, group_size: int, scale: AdvantageScale, eps: float,
                             valid: torch.Tensor) -> torch.Tensor:
    """group_advantages over the valid rewards only (see there)."""
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    w = valid.bool().view(-1, group_size)  # [N, G]
    r = torch.where(w, rewards.float().view(-1, group_size), torch.zeros(()))  # [N, G] invalid -> 0
    k = w.sum(dim=1, keepdim=True)  # [N, 1] valid rewards per group
    mean = r.sum(dim=1, keepdim=True) / k.clamp(min=1)  # [N, 1]
    centered = torch.where(w, r - mean, torch.zeros(()))  # [N, G]
    if scale == "group":
        std = ((centered**2).sum(dim=1, keepdim=True) / (k - 1).clamp(min=1)).sqrt()  # [N, 1] Bessel over valid
        adv = centered / (std + eps)
    elif scale == "batch":
        adv = centered / (rewards.float()[valid.bool()].std() + eps)
    elif scale == "none":
        adv = centered
    else:
        raise ValueError(f"scale {scale!r} is not one of group, batch, none")
    first = r.gather(1, w.int().argmax(dim=1, keepdim=True))  # [N, 1] a valid reward of each group
    flat = (k < 2) | (w & (r != first)).sum(dim=1, keepdim=True).eq(0)  # [N, 1] no baseline, or all valid equal
    return torch.where(flat | ~w, torch.zeros_like(adv), adv).view(-1)  # [N*G]


def zero_std_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (advantage 0: no learning signal)."""
    r = rewards.view(-1, group_size)  # [N, G]
    return (r == r[:, :1]).all(dim=1).float().mean().item()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """Per-token KL(policy || reference), k3 estimator (Schulman, "Approximating KL Divergence", 2020):

    kl = exp(ref_logp - logp) - (ref_logp - logp) - 1    (>= 0, unbiased, low variance; as in GRPO and TRL)
    kl = min(kl, cap), when cap is given: verl's kl_penalty("low_var_kl") clamps the value to [-10, 10]; since
         k3 >= 0 only the upper bound acts, and a capped token passes no gradient through its KL term.
    """
    d = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    kl = torch.exp(d) - d - 1
    return kl if cap is None else kl.clamp(max=cap)


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Zero the mask of completions that hit max_tokens (DAPO's overlong filtering); `truncated` is [B] bool."""
    return mask * (~truncated.bool()).unsqueeze(1).to(mask.dtype)  # [B, T]


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Token-level truncated importance weights for the sampler/learner mismatch (TIS):

    w_t = min(exp(old_logp_t - sampler_logp_t), cap)
    Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training" (verl's
    tis_imp_ratio_cap): tokens were drawn by the sampler's numerics, the gradient is taken under the
    learner's; w corrects for that and the cap bounds its variance. No gradient flows through w. With stale
    samples (asynchronous GRPO) old_logp is decoupled PPO's proximal policy and w the truncated behaviour weight.
    """
    d = (old_logp - sampler_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    return torch.exp(d).clamp(max=cap).detach()


def off_policy_keep(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    band: tuple[float, float],
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """Masked importance sampling: 1 where the proximal/behaviour ratio lies in the band, else 0 (no gradient).

    token:    keep_t = 1[low <= exp(prox_t - behav_t) <= high]                       (IcePop, Ling Team 2025;
              verl's rollout_rs token_k1; AReaL's behav_imp_weight_cap is the band [0, cap])
    sequence: keep_t = 1[low <= exp(mean_{s in seq} (prox_s - behav_s)) <= high]     (the geometric mean of the
              sequence's token ratios decides for all its tokens: verl's Geo-RS, rollout_rs seq_mean_k1)
    The comparison runs on log-ratios against log(low), log(high) (low = 0: no lower bound), so a ratio exactly on
    an edge is kept. The mean runs over the sequence's `mask` tokens; padding gets 0. Rejecting outliers instead of
    truncating them drops the tokens whose behaviour policy the learner cannot stand in for (Liu, Li et al. 2025,
    "When Speed Kills Stability", the "MIS" estimator).
    """
    low, high = band
    m = mask.to(proximal_logp.dtype)  # [B, T]
    d = (proximal_logp - behaviour_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP) * m  # [B, T]
    if level == "sequence":
        d = (d.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(d)  # [B, T]
    elif level != "token":
        raise ValueError(f"level {level!r} is not one of token, sequence")
    log_low = math.log(low) if low > 0 else -math.inf
    keep = (d >= log_low) & (d <= math.log(high))  # [B, T]
    return (keep.to(m.dtype) * m).detach()


def off_policy_weights(correction: OffPolicyCorrection, proximal_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`policy_loss`'s (is_weights, keep) for a correction, all [B, T]: truncated importance weights where it has a
    cap, and with MaskedIS the keep mask; (None, None) without one."""
    if correction is None:
        return None, None
    is_weights = truncated_is_weights(proximal_logp, behaviour_logp, correction.cap) if correction.cap else None
    keep = None
    if isinstance(correction, MaskedIS):
        keep = off_policy_keep(proximal_logp, behaviour_logp, mask, correction.band, correction.level)
    return is_weights, keep


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg = "token-mean",
              max_response_length: int | None = None):
    """Token values [B, T] -> one scalar (verl's loss_agg_mode names; docs/peers.md maps TRL's loss_type onto them).

    token-mean:               sum_{b,t} m*v / sum_{b,t} m                  (DAPO; TRL "dapo"; every token weighs
                                                                            the same)
    seq-mean-token-mean:      mean_b [ sum_t m*v / sum_t m ]               (original GRPO; TRL "grpo")
    seq-mean-token-sum:       mean_b [ sum_t m*v ]                         (verl agg_loss; a sequence weighs its
                                                                            length)
    seq-mean-token-sum-norm:  mean_b [ sum_t m*v / max_response_length ]   (Dr. GRPO; TRL "dr_grpo": sum / (B * L);
                                                                            verl agg_loss since verl-project/verl
                                                                            #5417, L = loss_scale_factor)
    `max_response_length` is the constant L (the caller passes algorithm.loss_scale_factor or the rollout's
    max_response_length). Sequences with no unmasked token (e.g. all truncated) are left out of the seq means (TRL
    and verl count them in B); all-masked input gives 0.
    """
    m = mask.to(values.dtype)
    if agg == "token-mean":
        return (values * m).sum() / m.sum().clamp(min=1)
    per_seq_tokens = m.sum(dim=1)  # [B]
    live = (per_seq_tokens > 0).to(values.dtype)  # [B]
    if agg == "seq-mean-token-mean":
        per_seq = (values * m).sum(dim=1) / per_seq_tokens.clamp(min=1)  # [B]
    elif agg == "seq-mean-token-sum":
        per_seq = (values * m).sum(dim=1)  # [B]
    elif agg == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("agg 'seq-mean-token-sum-norm' needs max_response_length")
        per_seq = (values * m).sum(dim=1) / max_response_length  # [B]
    else:
        raise ValueError(f"agg {agg!r} is not one of {', '.join(AGGS)}")
    return (per_seq * live).sum() / live.sum().clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: LossAgg = "token-mean",
    max_response_length: int | None = None,
    is_weights: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    clip_ratio_c: float | None = None,
    kl_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate with asymmetric clipping, plus the k3 KL to the reference. All [B, T] but A [B].

    ratio = exp(logp - old_logp)
    pg    = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))   (PPO, Schulman et al. 2017;
            clip_high > clip_low is DAPO's clip-higher, Yu et al. 2025)
    pg    = min(pg, -A * clip_ratio_c) where A < 0, when clip_ratio_c is given (dual-clip PPO, Ye et al. 2020,
            arXiv:1912.09729; verl's compute_policy_loss_vanilla, clip_ratio_c = 3.0 there by default): a token
            whose ratio exceeds c with a negative advantage no longer grows the loss without bound
    pg   *= is_weights, when given (truncated IS of the sampler mismatch, `truncated_is_weights`; after the
            dual-clip, as verl applies its rollout IS weights and AReaL its behaviour weights)
    loss  = aggregate(keep * (pg + beta * kl_k3(logp, ref_logp, kl_cap)), mask, agg)  (GRPO; KL in the loss, not
            reward). `keep` (`off_policy_keep`, default 1) drops a rejected token's whole loss; it stays in the
            denominator, as in AReaL (verl also removes it from the denominator)

    stats (detached scalars, token means over the mask): clip_frac_low (ratio < 1 - clip_low with A < 0: the
    clip stops pushing the token further down), clip_frac_high (ratio > 1 + clip_high with A > 0; their sum is
    verl's pg_clipfrac), clip_frac_dual (only with clip_ratio_c: A < 0 and the dual clip is what bounds the
    loss, verl's pg_clipfrac_lower), ratio, kl (0 without a reference; capped like the loss), pg_loss (pg alone,
    aggregated like the loss), and with is_weights or keep: is_weight_mean / is_weight_max (the weight on each
    token's policy-gradient term, is_weights x keep, over the mask) and, with keep, off_policy_masked_frac.
    """
    adv = advantages.to(logp.dtype).unsqueeze(1)  # [B, 1]
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    pg = torch.maximum(unclipped, clipped)  # [B, T]
    dual = None
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (the dual clip bounds ratios above 1)")
        bound = -adv * clip_ratio_c  # [B, 1], > 0 where A < 0
        dual = (adv < 0) & (pg > bound)  # [B, T]
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
    if is_weights is not None:
        pg = pg * is_weights
    if keep is not None:
        pg = pg * keep
    token_loss = pg
    kl = None
    if ref_logp is not None:
        kl = kl_k3(logp, ref_logp, kl_cap)  # [B, T]
        if beta:
            token_loss = pg + beta * (kl if keep is None else kl * keep)
    loss = aggregate(token_loss, mask, agg, max_response_length)

    with torch.no_grad():
        m = mask.to(logp.dtype)
        stats = {
            "clip_frac_low": _token_mean((ratio < 1.0 - clip_low) & (adv < 0), m),
            "clip_frac_high": _token_mean((ratio > 1.0 + clip_high) & (adv > 0), m),
            "ratio": _token_mean(ratio, m),
            "kl": _token_mean(kl, m) if kl is not None else torch.zeros((), device=logp.device),
            "pg_loss": aggregate(pg, mask, agg, max_response_length).detach(),
        }
        if dual is not None:
            stats["clip_frac_dual"] = _token_mean(dual, m)
        stats.update(_correction_stats(is_weights, keep, m))
    return loss, stats


def _token_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens (`m` [B, T], 1 on them) of `x` [B, T]."""
    return (x.to(m.dtype) * m).sum() / m.sum().clamp(min=1)


def _correction_stats(is_weights: torch.Tensor | None, keep: torch.Tensor | None,
                      m: torch.Tensor) -> dict[str, torch.Tensor]:
    """With an off-policy correction: the weight on each token's policy-gradient term (is_weights x keep) over the
    real tokens, its mean and maximum, and with `keep` the fraction of tokens dropped."""
    stats = {}
    if is_weights is not None or keep is not None:
        w = torch.ones_like(m) if is_weights is None else is_weights.to(m.dtype)
        w = w if keep is None else w * keep  # [B, T] the weight each token's pg term carries
        stats["is_weight_mean"] = _token_mean(w, m)
        stats["is_weight_max"] = torch.where(m.bool(), w, torch.zeros_like(w)).max()
    if keep is not None:
        stats["off_policy_masked_frac"] = _token_mean(1.0 - keep, m)
    return stats
