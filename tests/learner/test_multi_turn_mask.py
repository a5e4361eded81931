"""Multi-turn trajectories: the tool / template tokens between the model's turns (Sequence.tool_mask 0) are read by the
model but trained on by nothing — loss, gradient, KL, entropy, importance weights and the loss denominator count only
the tokens the model sampled. Tiny model on CPU, fp32, through the real Actor."""

from __future__ import annotations

import pytest
import torch

from dgrpo.learner.update import grpo
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence, collate, collate_shared_prompts, micro_batches
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig


def trajectories(garbage: float = -7.0, seed: int = 0) -> list[Sequence]:
    """Two groups of 4: completions of model turn / tool block / model turn, the tool blocks' sampler logprobs set to
    `garbage` (what the sampler sends there is 0; nothing may read it)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(8):
        first, tool, second = 2 + i % 3, 3 + i % 2, 1 + (i * 3) % 4
        prompt = seqs[i - i % 4].prompt_ids if i % 4 else torch.randint(5, 1000, (4,), generator=g).tolist()
        ids = torch.randint(5, 1000, (first + tool + second,), generator=g).tolist()
        mask = [1] * first + [0] * tool + [1] * second
        logp = [-1.0 - 0.1 * k if m else garbage for k, m in enumerate(mask)]
        seqs.append(Sequence(prompt, ids, 1.0 if i % 2 else -1.0, logp, tool_mask=mask))
    return seqs


def make_actor(path, layout: dict, algorithm: dict) -> Actor:
    torch.manual_seed(0)
    return Actor(path, ActorConfig(ppo_mini_batch_size=2, micro_batch_size_per_device=3, dtype="float32", **layout),
                 OptimConfig(lr=1e-3), AlgorithmConfig(**algorithm), total_steps=10, max_response_length=16)


def test_collate_ands_the_tool_mask_into_the_loss_mask():
    seqs = trajectories()
    for mb in (collate(seqs, range(8), packed=False), collate(seqs, range(8), packed=True),
               collate_shared_prompts(seqs, list(range(8)))):
        for row, s in enumerate(seqs):
            c = len(s.completion_ids)
            assert mb.mask[row, :c].tolist() == [float(m) for m in s.tool_mask]
            assert mb.mask[row, c:].sum() == 0  # padding stays 0
    with pytest.raises(ValueError, match="tool_mask has 2 values for 3 tokens"):
        Sequence([1], [2, 3, 4], 0.0, tool_mask=[1, 0])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        Sequence([1], [2, 3], 0.0, tool_mask=[1, 2])
    assert [s.model_tokens for s in seqs[:3]] == [3, 7, 7]


def test_masked_tokens_get_no_gradient():
    """d loss / d logp is exactly 0 at every mask-0 token (policy term, KL term and IS weights alike)."""
    seqs = trajectories()
    mb = collate(seqs, range(8), packed=False)
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(mb.mask.shape, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(mb.mask.shape, generator=g)
    ref = logp.detach() - 0.2
    is_w = grpo.truncated_is_weights(old, mb.sampler_logp, 2.0)
    loss, _ = grpo.policy_loss(logp, old, mb.advantages, mb.mask, ref_logp=ref, beta=0.5, is_weights=is_w)
    loss.backward()
    grad = logp.grad
    assert (grad[mb.mask == 0] == 0).all()
    assert (grad[mb.mask == 1] != 0).sum() >= int(mb.mask.sum()) - 2  # a clipped token or two may be flat


@pytest.mark.parametrize("layout", [{}, {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 40,
                                         "share_prompts": True}], ids=["padded", "packed-shared"])
def test_update_sees_only_model_tokens(tiny_model, layout):
    """On policy (first update: ratio 1), token-mean loss = -sum_b A_b n_b / sum_b n_b over MODEL tokens n_b, across
    several micro-batches (so the per-micro-batch loss weights must count model tokens too); the entropy is the mean
    over model tokens of a plain forward's; and what the sampler sent at mask-0 tokens changes nothing, with
    truncated IS and masked IS both on."""
    seqs = trajectories()
    assert len(micro_batches(seqs, packed=bool(layout), micro_batch_size=3,
                             max_tokens=layout.get("max_tokens_per_micro_batch", 0),
                             share_prompts=bool(layout))) > 1
    actor = make_actor(tiny_model, layout, {"beta": 0.0})
    # Entropy over model tokens, from a plain forward of each whole sequence.
    ents = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = actor.policy(input_ids=ids).logits[0].float()  # [L, V]
            p = len(s.prompt_ids)
            pred = logits[p - 1: p - 1 + len(s.completion_ids)]  # [C, V]
            h = -(torch.softmax(pred, -1) * torch.log_softmax(pred, -1)).sum(-1)  # [C]
            ents += [h[k].item() for k, m in enumerate(s.tool_mask) if m]
    m = actor.update(seqs, group_size=4)
    n = torch.tensor([s.model_tokens for s in seqs], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    assert m["actor/loss"] == pytest.approx((-(adv * n).sum() / n.sum()).item(), rel=1e-4, abs=1e-6)
    assert m["actor/entropy"] == pytest.approx(sum(ents) / len(ents), rel=1e-4)

    def run(garbage: float) -> list[float]:
        a = make_actor(tiny_model, layout, {"tis_cap": 2.0, "off_policy": "mask", "off_policy_band": [0.0, 1.0e6]})
        out = a.update(trajectories(garbage), group_size=4)
        return [out["actor/loss"], out["actor/grad_norm"], out["actor/is_weight_mean"],
                out["actor/off_policy_masked_frac"], out["actor/sampler_logp_diff"]]

    assert run(-7.0) == pytest.approx(run(-60.0), rel=1e-6)
