"""What one training step adds up over its micro-batches, summed over ranks once, and the metrics read from it.

The actor (learner/update/actor.py) records every real micro-batch into a `StepSums`; at the step's end one all-reduce
sums the fields of all ranks and `metrics` turns them into the step's `actor/*` metrics (docs/actor.md lists them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from dgrpo.learner.update.batch import MicroBatch, Sequence
from dgrpo.learner.update.config import MaskedIS, OffPolicyCorrection
from dgrpo.learner.update.distributed import DistContext, all_reduce_max, all_reduce_sum

TOKEN_MEANS = (
    "clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio", "kl", "entropy", "sampler_logp_diff",
    "is_weight_mean", "off_policy_masked_frac",
)
"""Per-token statistics of the step, reported as means over the loss tokens of all ranks (StepSums fields)."""
MAXIMA = ("is_weight_max",)
"""StepSums fields that are maxima over the step's micro-batches and ranks, not sums."""


@dataclass
class StepSums:
    """What one training step adds up over this rank's micro-batches, by name.

    `all_reduced` stacks the fields into one float64 tensor, sums it over ranks in a single all-reduce and reads
    it back by field name: one collective per step, and no offsets for a metric to be read from the wrong slot.
    The MAXIMA fields take a second, max all-reduce, only when asked (off-policy correction on).
    """

    clip_frac_low: float = 0.0
    """This and the next eight: the micro-batch's token mean x its loss tokens (TOKEN_MEANS)."""
    clip_frac_high: float = 0.0
    clip_frac_dual: float = 0.0
    ratio: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    sampler_logp_diff: float = 0.0
    is_weight_mean: float = 0.0
    off_policy_masked_frac: float = 0.0
    loss_tokens: float = 0.0
    """Completion tokens under the loss mask: what the token means divide by."""
    loss: float = 0.0
    """Micro-batch loss x its share of the mini-batch's denominator, summed: the sum of the mini-batch losses."""
    pg_loss: float = 0.0
    """The same for the policy-gradient term alone (the loss without the KL)."""
    real_tokens: float = 0.0
    """Tokens of the forwards' inputs, padding excluded (a shared prompt counts once)."""
    padded_tokens: float = 0.0
    """Tokens the forwards computed, padding included."""
    sequence_tokens: float = 0.0
    """Prompt + completion tokens of the sequences trained on (a shared prompt counts once per sequence)."""
    is_weight_max: float = 0.0
    """The largest importance weight of any loss token (a maximum, MAXIMA; weights are >= 0)."""

    @torch.no_grad()
    def record(
        self, mb: MicroBatch, mask: torch.Tensor, logp: torch.Tensor, ent: torch.Tensor | None, loss: torch.Tensor,
        stats: dict[str, torch.Tensor], weight: float, world_size: int,
    ) -> None:
        """Add one real micro-batch: token means weighted by its loss tokens, the loss and pg_loss by its share of
        the mini-batch's (per rank: the loss weight's x world_size undone)."""
        tokens = mask.sum().clamp(min=1)
        if ent is not None:
            stats["entropy"] = (ent * mask).sum() / tokens
        if mb.sampler_logp is not None:  # how far the sampler's policy is from the learner's (sync check)
            stats["sampler_logp_diff"] = ((logp.detach() - mb.sampler_logp).abs() * mask).sum() / tokens
        means = [name for name in TOKEN_MEANS if name in stats]
        maxima = [name for name in MAXIMA if name in stats]
        # One device->host copy per micro-batch (a sync point on accelerators).
        tok, loss_v, pg_v, *values = torch.stack([
            t.double() for t in (mask.sum(), loss.detach(), stats["pg_loss"], *(stats[n] for n in means + maxima))
        ]).cpu().tolist()
        for name, value in zip(means, values[:len(means)], strict=True):
            setattr(self, name, getattr(self, name) + value * tok)
        for name, value in zip(maxima, values[len(means):], strict=True):
            setattr(self, name, max(getattr(self, name), value))
        self.loss_tokens += tok
        self.loss += loss_v * weight / world_size
        self.pg_loss += pg_v * weight / world_size
        self.real_tokens += mb.real_tokens
        self.padded_tokens += mb.padded_tokens
        self.sequence_tokens += mb.sequence_tokens

    def all_reduced(self, ctx: DistContext, maxima: bool = False) -> StepSums:
        """Sums over ranks; with `maxima` (every rank must pass the same) also the MAXIMA fields' maxima."""
        names = [f.name for f in fields(self) if f.name not in MAXIMA]
        stacked = torch.tensor([getattr(self, name) for name in names], dtype=torch.float64)
        out = StepSums(**dict(zip(names, all_reduce_sum(stacked, ctx).tolist(), strict=True)))
        for name in MAXIMA:
            value = getattr(self, name)
            setattr(out, name, _max_over_ranks(value, ctx) if maxima else value)
        return out

    def metrics(
        self, seqs: list[Sequence], grad_norms: list[float], lr: float, *, entropy: bool, dual_clip: bool,
        correction: OffPolicyCorrection,
    ) -> dict[str, float]:
        """The step's metrics from sums over all ranks; those of a feature that is off are left out."""
        tokens = max(self.loss_tokens, 1.0)
        metrics = {f"actor/{name}": getattr(self, name) / tokens for name in TOKEN_MEANS}
        if not entropy:
            del metrics["actor/entropy"]
        if not dual_clip:
            del metrics["actor/clip_frac_dual"]
        if any(s.sampler_logprobs is None for s in seqs):
            del metrics["actor/sampler_logp_diff"]
        if correction is None:
            del metrics["actor/is_weight_mean"]
        else:
            metrics["actor/is_weight_max"] = self.is_weight_max
        if not isinstance(correction, MaskedIS):
            del metrics["actor/off_policy_masked_frac"]
        updates = len(grad_norms)
        metrics.update({
            "actor/loss": self.loss / updates,
            "actor/pg_loss": self.pg_loss / updates,
            "actor/grad_norm": sum(grad_norms) / updates,
            "actor/lr": lr,
            "actor/updates": float(updates),
            "actor/tokens": self.real_tokens,
            "actor/padding_frac": 1.0 - self.real_tokens / max(self.padded_tokens, 1.0),
            # Tokens the forwards computed per token of the sequences: < 1 when prompts are shared.
            "actor/computed_tokens_ratio": self.padded_tokens / max(self.sequence_tokens, 1.0),
        })
        return metrics


def _max_over_ranks(value: float, ctx: DistContext) -> float:
    """Max of a float >= 0 over ranks through the integer all_reduce_max: the bits of non-negative IEEE floats,
    read as integers, order as the floats do."""
    bits = torch.tensor([value], dtype=torch.float64).view(torch.int64).item()
    return torch.tensor([all_reduce_max(bits, ctx)], dtype=torch.int64).view(torch.float64).item()
