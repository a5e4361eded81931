"""The actor on the tiny model (CPU, fp32 unless stated): logprobs, the update's invariances, learning direction."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import load_config
from dgrpo.learner.update.actor import Actor, lr_factor
from dgrpo.learner.update.batch import (
    Sequence,
    collate,
    collate_shared_prompts,
    split_by_tokens,
    split_groups_by_tokens,
)
from dgrpo.learner.update.compute_copy import ComputeCopy
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, OptimConfig
from dgrpo.weights.config import LoraConfig
from dgrpo.weights.gather import full_tensors


def make_seqs(n: int = 8, seed: int = 0, groups: bool = False) -> list[Sequence]:
    """n sequences of varied prompt and completion lengths (groups of 4), advantages +-1, sampler logprobs.
    groups: the sequences of each group of 4 share their prompt, as GRPO rollouts do."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n):
        p, c = 3 + i % 3, 2 + (i * 3) % 5
        ids = torch.randint(5, 1000, (p + c,), generator=g).tolist()
        prompt = seqs[i - i % 4].prompt_ids if groups and i % 4 else ids[:p]
        seqs.append(Sequence(prompt, ids[p:], 1.0 if i % 2 else -1.0, [-7.0] * c, truncated=i == 5))
    return seqs


def make_actor(path, **kw) -> Actor:
    actor_kw = {"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 4, "dtype": "float32"}
    actor_kw.update(kw.pop("actor", {}))
    return Actor(
        path,
        ActorConfig(**actor_kw),
        OptimConfig(**{"lr": 1e-3, **kw.pop("optim", {})}),
        AlgorithmConfig(**kw.pop("algorithm", {})),
        total_steps=10,
        max_response_length=8,
        **kw,
    )


def params(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.policy.named_parameters()}


PACKED = {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 64, "share_prompts": False}
SHARED = {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 64, "share_prompts": True}


@pytest.mark.parametrize("layout", [{}, PACKED, SHARED], ids=["padded", "packed", "shared-prompts"])
def test_logprobs_match_a_plain_forward(tiny_model, layout):
    """Only completion-predicting positions go through the LM head, and shared prompts are computed once; the
    logprobs must equal a plain full forward of each sequence alone."""
    actor = make_actor(tiny_model, temperature=0.7, actor=layout)
    seqs = make_seqs(6, groups=True)
    got = actor.compute_logprobs(seqs)
    for s, lp in zip(seqs, got, strict=True):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = actor.policy(input_ids=ids).logits[0].float() / 0.7  # [L, V]
        p = len(s.prompt_ids)
        want = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-5)


def test_packing_removes_padding_and_keeps_the_update(tiny_model):
    """padded x1, padded x4 (grad accumulation), packed by tokens, and packed with each group's prompt computed
    once give the same update and metrics."""
    seqs = make_seqs(8, groups=True)
    results = []
    for actor_kw in (
        {"micro_batch_size_per_device": 1},
        {"micro_batch_size_per_device": 4},
        {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 20, "share_prompts": False},
        {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 20, "share_prompts": True},
    ):
        # Adam's step is lr * g / (|g| + eps): with the default eps (1e-8) the float noise of a layout's summation
        # order flips near-zero gradients into steps of +-lr (CI once saw 3.6e-5 at one element of 16384).
        # eps = 1e-5 keeps such steps linear in g (noise x lr/eps, ~2e-6 here) while most still reach lr.
        actor = make_actor(tiny_model, actor=actor_kw, optim={"eps": 1e-5})
        before = params(actor)
        metrics = actor.update(seqs, group_size=4)
        results.append((params(actor), metrics))
    assert any(not torch.equal(before[k], results[0][0][k]) for k in before)

    def flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([weights[k].flatten() for k in before])

    step = flat(results[0][0]) - flat(before)
    for j, (p, m) in enumerate(results[1:], 1):
        for k in p:
            torch.testing.assert_close(p[k], results[0][0][k], atol=3e-5, rtol=1e-4,
                                       msg=lambda e, j=j, k=k: f"layout {j}, {k}: {e}")
        # The whole update agrees, not only each element within tolerance: half the batch weighted 1% off moves
        # this by 1.7e-2; float noise gives ~2e-5.
        gap = (flat(p) - flat(results[0][0])).norm() / step.norm()
        assert gap < 1e-3, f"layout {j}: update differs by {gap:.2e} of its norm"
        assert m["actor/loss"] == pytest.approx(results[0][1]["actor/loss"], abs=1e-6)
        # |learner - sampler| logprob per token (the sampler's are -7 here): a property of the batch, not the layout
        assert m["actor/sampler_logp_diff"] == pytest.approx(results[0][1]["actor/sampler_logp_diff"], rel=1e-5)
    assert results[0][1]["actor/sampler_logp_diff"] > 0.1
    assert results[0][1]["actor/padding_frac"] == 0.0  # one sequence per row: no padding
    assert results[1][1]["actor/padding_frac"] > 0.1
    assert results[2][1]["actor/padding_frac"] == 0.0
    assert results[2][1]["actor/computed_tokens_ratio"] == 1.0
    assert results[3][1]["actor/padding_frac"] == 0.0
    assert results[3][1]["actor/computed_tokens_ratio"] < 0.9  # 8 prompts of 3-5 tokens computed as 2-3 copies


def test_first_update_is_on_policy(tiny_model):
    actor = make_actor(tiny_model, actor={"ppo_mini_batch_size": 2}, algorithm={"beta": 0.05})
    m = actor.update(make_seqs(8), group_size=4)
    assert m["actor/updates"] == 1
    assert m["actor/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert m["actor/clip_frac_low"] == m["actor/clip_frac_high"] == 0.0
    assert m["actor/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert math.isfinite(m["actor/entropy"]) and m["actor/entropy"] > 0
    m2 = actor.update(make_seqs(8, seed=1), group_size=4)
    assert m2["actor/kl"] > 0  # the policy has moved away from the frozen reference


def test_every_metric_equals_an_independent_computation(tiny_model):
    """Each metric of one update against the same quantity computed here from plain per-sequence forwards, with
    inputs chosen so that all of them differ: a metric read from another's slot cannot pass.

    Sampler logprobs are the policy's shifted per token by -0.5 / 0 / +0.5 (ratios e^0.5, 1, e^-0.5: both clips
    active), the reference is perturbed (KL > 0), two padded micro-batches of 4 (loss weighting, padding)."""
    temperature, beta = 0.7, 0.5
    actor = make_actor(tiny_model, temperature=temperature, algorithm={"beta": beta, "old_logprobs": "sampler"})
    cfg = actor.algo
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in actor.reference.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def plain(model, s):  # [C, V] log-probabilities of the positions predicting completion tokens
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1)

    seqs, pg, kl, ratio, low, high, ent, diff = [], [], [], [], [], [], [], []
    for s in make_seqs(8):
        log_probs = plain(actor.policy, s)  # with grad: the gradient norm below
        logp = log_probs.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]  # [C]
        with torch.no_grad():
            ref = plain(actor.reference, s).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        shift = torch.tensor([(0.5, 0.0, -0.5, 0.5)[(t + len(seqs)) % 4] for t in range(len(logp))])
        sampler = logp.detach() - shift
        seqs.append(Sequence(s.prompt_ids, s.completion_ids, s.advantage, sampler.tolist()))
        r = torch.exp(logp - sampler)  # PPO ratio against the behaviour (sampler) policy
        a = s.advantage
        pg.append(torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)))
        kl.append(torch.exp(ref - logp) - (ref - logp) - 1)  # k3
        ratio.append(r.detach())
        low.append(((r < 1 - cfg.clip_low) & (a < 0)).float())
        high.append(((r > 1 + cfg.clip_high) & (a > 0)).float())
        ent.append(-(log_probs.exp() * log_probs).sum(-1).detach())
        diff.append(shift.abs())
    pg, kl = torch.cat(pg), torch.cat(kl)
    loss = (pg + beta * kl).mean()  # token-mean over the one mini-batch
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in actor.policy.parameters())).item()
    actor.optimizer.zero_grad(set_to_none=True)
    lengths = [len(s) for s in seqs]
    padded = sum(len(chunk) * max(chunk) for chunk in (lengths[:4], lengths[4:]))
    want = {
        "actor/clip_frac_low": torch.cat(low).mean().item(),
        "actor/clip_frac_high": torch.cat(high).mean().item(),
        "actor/ratio": torch.cat(ratio).mean().item(),
        "actor/kl": kl.mean().item(),
        "actor/entropy": torch.cat(ent).mean().item(),
        "actor/sampler_logp_diff": torch.cat(diff).mean().item(),
        "actor/loss": loss.item(),
        "actor/pg_loss": pg.mean().item(),
        "actor/grad_norm": grad_norm,
        "actor/lr": 1e-3,
        "actor/updates": 1.0,
        "actor/tokens": float(sum(lengths)),
        "actor/padding_frac": 1 - sum(lengths) / padded,
        "actor/computed_tokens_ratio": padded / sum(lengths),
    }
    values = [round(v, 6) for v in want.values()]
    assert len(set(values)) == len(values), want  # all distinct: a swap of any two would show
    got = actor.update(seqs, group_size=4)
    assert set(got) == set(want) | {"timing/logprob_s", "timing/update_s", "actor/skipped_frac"}
    assert got["actor/skipped_frac"] == 0.0  # every sequence has an advantage and a KL
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_later_mini_batches_are_off_policy(tiny_model):
    actor = make_actor(tiny_model, actor={"ppo_mini_batch_size": 1, "ppo_epochs": 2})
    m = actor.update(make_seqs(8), group_size=4)
    assert m["actor/updates"] == 4
    assert m["actor/ratio"] != pytest.approx(1.0, abs=1e-6)


def test_updates_move_logprobs_in_the_advantage_direction(tiny_model):
    actor = make_actor(tiny_model, optim={"lr": 1e-2})
    seqs = make_seqs(8)
    before = actor.compute_logprobs(seqs)
    for _ in range(3):
        actor.update(seqs, group_size=4)
    after = actor.compute_logprobs(seqs)
    for s, b, a in zip(seqs, before, after, strict=True):
        assert (a.sum() - b.sum()).item() * s.advantage > 0


def test_sampler_old_logprobs_and_tis(tiny_model):
    seqs = make_seqs(8)  # sampler logprob -7 per token, the policy's is about -log(vocab) = -10.8
    m = make_actor(tiny_model, algorithm={"old_logprobs": "sampler"}).update(seqs, group_size=4)
    assert m["actor/ratio"] < 0.1  # exp(-10.8 + 7)
    m = make_actor(tiny_model, algorithm={"tis_cap": 2.0, "mask_truncated": True}).update(seqs, group_size=4)
    assert math.isfinite(m["actor/loss"])
    # tis_cap alone is off_policy=tis: weights min(exp(-10.8 + 7), 2) ~ 0.02 (tests/learner/test_off_policy.py)
    assert 0 < m["actor/is_weight_mean"] <= m["actor/is_weight_max"] < 0.1
    assert "actor/off_policy_masked_frac" not in m


def test_bf16_autocast_and_gradient_checkpointing(tiny_model):
    seqs = make_seqs(8)
    plain = make_actor(tiny_model)
    plain.update(seqs, group_size=4)
    ckpt = make_actor(tiny_model, actor={"gradient_checkpointing": True})
    ckpt.update(seqs, group_size=4)
    for (n, a), b in zip(params(plain).items(), params(ckpt).values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=n)
    m = make_actor(tiny_model, actor={"dtype": "bfloat16"}).update(seqs, group_size=4)
    assert math.isfinite(m["actor/loss"]) and math.isfinite(m["actor/grad_norm"])


def test_named_weights_are_the_checkpoint_names(tiny_model):
    actor = make_actor(tiny_model)
    weights = dict(actor.named_weights(torch.bfloat16))
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        assert set(weights) == set(f.keys()) - {"lm_head.weight"}  # tied to embed_tokens: published once
        name = "model.layers.0.self_attn.q_proj.weight"
        assert weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(weights[name], f.get_tensor(name).to(torch.bfloat16))


def test_bad_batches_are_named(tiny_model):
    actor = make_actor(tiny_model)
    with pytest.raises(ValueError, match="ppo_mini_batch_size=2"):
        actor.update(make_seqs(4), group_size=4)
    seqs = [Sequence(s.prompt_ids, s.completion_ids, s.advantage) for s in make_seqs(8)]
    with pytest.raises(ValueError, match="sampler's logprobs"):
        make_actor(tiny_model, algorithm={"old_logprobs": "sampler"}).update(seqs, group_size=4)
    with pytest.raises(ValueError, match="sampler_logprobs has 1 values for 2 tokens"):
        Sequence([1], [2, 3], 0.0, [-1.0])


def test_lr_schedule():
    warm = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, warm, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, warm, 14) == pytest.approx(1.0)
    assert lr_factor(9, warm, 14) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_factor(14, warm, 14) == pytest.approx(0.1)
    lin = OptimConfig(schedule="linear")
    assert lr_factor(5, lin, 10) == pytest.approx(0.5)
    assert lr_factor(7, OptimConfig(), 10) == 1.0


def test_packing_layout():
    seqs = [Sequence([1, 2], [3, 4, 5], 1.0), Sequence([6], [7], -1.0)]
    mb = collate(seqs, [0, 1], packed=True)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert mb.token_index.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert mb.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    padded = collate(seqs, [0, 1], packed=False, pad_id=0)
    assert padded.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert padded.token_index.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert padded.padded_tokens == 10 and padded.real_tokens == 7
    assert mb.logit_index.tolist() == [[1, 2, 3], [5, 5, 5]]  # pads repeat the row's first prediction
    assert mb.sequence_tokens == mb.real_tokens == 7
    # first-fit decreasing, budget 10: 12 alone, then 6+4 and 5+3
    assert sorted(map(sorted, split_by_tokens([6, 5, 4, 3, 12], 10))) == [[0, 2], [1, 3], [4]]


def test_shared_prompt_layout():
    """Two completions of prompt [1, 2] after one copy of it, then another prompt's completion."""
    seqs = [Sequence([1, 2], [3, 4], 1.0), Sequence([1, 2], [5, 6, 7], -1.0), Sequence([8], [9], 0.5)]
    mb = collate_shared_prompts(seqs, [0, 1, 2])
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4, 0, 1]]  # as if each followed its prompt alone
    assert mb.token_index.tolist() == [[2, 3, 0], [4, 5, 6], [8, 0, 0]]
    assert mb.logit_index.tolist() == [[1, 2, 1], [1, 4, 5], [7, 7, 7]]  # first token: the prompt's last position
    assert mb.attention_mask is None
    first, second = mb.attention_blocks  # a prompt copy and its completions, attending only among themselves
    assert (first.start, first.end, second.start, second.end) == (0, 7, 7, 9)
    attend = first.mask.int().tolist()  # [query, key]
    assert attend[2] == [1, 1, 1, 0, 0, 0, 0]
    assert attend[5] == [1, 1, 0, 0, 1, 1, 0]  # the second completion sees the prompt and itself only
    assert second.mask.int().tolist() == [[1, 0], [1, 1]]
    assert (mb.padded_tokens, mb.real_tokens, mb.sequence_tokens) == (9, 9, 11)
    # a group stays in one micro-batch unless its prompt + completions exceed the budget
    assert split_groups_by_tokens(seqs, 9) == [[0, 1, 2]]  # 2 + 2 + 3 and 1 + 1
    assert split_groups_by_tokens(seqs, 8) == [[0, 1], [2]]
    assert split_groups_by_tokens(seqs, 6) == [[1], [0, 2]]  # [1, 2] + [5, 6, 7] = 5, [1, 2] + [3, 4] = 4 with 2


@pytest.mark.parametrize("layout", [{}, PACKED], ids=["padded", "packed"])
@pytest.mark.parametrize("algorithm", [{"beta": 0.1}, {"beta": 0.1, "loss_agg": "seq-mean-token-mean"}],
                         ids=["token-mean", "seq-mean"])
def test_a_completion_without_a_reward_leaves_no_trace_in_the_update(tiny_model, algorithm, layout):
    """A completion the rewarder gave no reward (in_loss=False) keeps its group's shape but adds nothing: not to
    the policy gradient, the KL or the denominator. Whatever its tokens, the loss, KL and gradient are the same;
    counted in (in_loss True with advantage 0), it changes them through the denominator."""
    def update(excluded_ids: list[int], in_loss: bool) -> list[float]:
        torch.manual_seed(0)
        actor = make_actor(tiny_model, algorithm=algorithm, actor=layout)
        seqs = make_seqs(8, groups=True)
        seqs[3] = Sequence(seqs[3].prompt_ids, excluded_ids, 0.0, [-7.0] * len(excluded_ids), in_loss=in_loss)
        m = actor.update(seqs, group_size=4)
        return [m["actor/loss"], m["actor/kl"], m["actor/grad_norm"]]

    short, long = [11, 12], [500, 600, 700, 800, 900]
    assert update(short, in_loss=False) == pytest.approx(update(long, in_loss=False), rel=1e-5)
    # Counted in, it is in the denominator (its tokens for token-mean, one more sequence for the seq-means).
    assert update(long, in_loss=True) != pytest.approx(update(long, in_loss=False), rel=1e-3)


def test_sequences_without_gradient_are_left_out_and_the_update_is_the_same(tiny_model):
    """With no KL in the loss, a group whose completions all scored alike (advantage 0) and a completion without a
    reward have exactly zero gradient: leaving them out of the forwards (the default) gives the update computing
    them gives, on fewer tokens. A batch with no gradient at all still takes AdamW's step (one filler computed)."""
    seqs = make_seqs(8, groups=True)
    seqs[:4] = [replace(s, advantage=0.0) for s in seqs[:4]]
    seqs[6] = replace(seqs[6], in_loss=False)

    def update(batch: list[Sequence], skip: bool, **kw) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        actor = make_actor(tiny_model, actor={**SHARED, "skip_zero_advantage": skip}, optim={"eps": 1e-5}, **kw)
        metrics = actor.update(batch, group_size=4)
        return params(actor), metrics

    initial = params(make_actor(tiny_model))
    (computed, m_all), (skipped, m_skip) = update(seqs, False), update(seqs, True)
    step = torch.cat([(computed[k] - initial[k]).flatten() for k in initial])
    gap = torch.cat([(skipped[k] - computed[k]).flatten() for k in initial]).norm() / step.norm()
    assert step.norm() > 0 and gap < 1e-3, f"update differs by {gap:.2e} of its norm"
    for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm"):
        assert m_skip[key] == pytest.approx(m_all[key], rel=1e-4, abs=1e-7), key
    assert m_all["actor/skipped_frac"] == 0.0 and m_skip["actor/skipped_frac"] == 5 / 8
    assert m_skip["actor/tokens"] < 0.6 * m_all["actor/tokens"]

    # A KL in the loss moves zero-advantage sequences too: only the completion without a reward is left out.
    _, m_kl = update(seqs, True, algorithm={"beta": 0.1})
    assert m_kl["actor/skipped_frac"] == 1 / 8 and m_kl["actor/kl"] >= 0

    # Nothing to learn from: AdamW still steps on the zero gradient, as computing every sequence would.
    flat = [replace(s, advantage=0.0) for s in seqs]
    (none_computed, m_none), (none_skipped, m_none_skip) = update(flat, False), update(flat, True)
    assert m_none["actor/grad_norm"] == m_none_skip["actor/grad_norm"] == 0.0
    assert m_none_skip["actor/skipped_frac"] == 1.0 and m_none_skip["actor/tokens"] < m_none["actor/tokens"] / 4
    for k in initial:
        torch.testing.assert_close(none_skipped[k], none_computed[k], atol=0, rtol=0, msg=k)


# ---- bf16_weights=published (learner/update/compute_copy.py): the learner computes with the bits it publishes ----

PUBLISHED = {"dtype": "bfloat16", "bf16_weights": "published", **SHARED}


def neighbours(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 bit patterns (as int32 << 16) either side of each fp32 value: truncated toward zero, and one up."""
    low = master.reshape(-1).view(torch.int32) & ~0xFFFF
    return low, low + 0x10000


def test_the_learner_computes_with_the_bits_it_publishes(tiny_model):
    actor = make_actor(tiny_model, actor={**PUBLISHED, "ppo_mini_batch_size": 1}, seed=3)
    seqs = make_seqs(8, groups=True)
    before = params(actor)
    metrics = actor.update(seqs, group_size=4)  # 2 mini-batches: two optimizer updates, two roundings
    assert metrics["actor/updates"] == 2.0
    after = params(actor)
    assert all(p.dtype == torch.float32 for p in after.values())  # masters stay fp32
    assert any(not torch.equal(before[n], after[n]) for n in after)

    published = dict(actor.named_weights(torch.bfloat16))
    assert set(published) == {n for n in after if n != "lm_head.weight"}  # tied: once, as a full publish
    rounded_up = total = 0
    for name, bits in published.items():
        assert bits.dtype == torch.bfloat16
        got = bits.reshape(-1).view(torch.int16).to(torch.int32) << 16
        down, up = neighbours(after[name])
        assert torch.all((got == down) | (got == up)), f"{name} is not a rounding of its master"
        inexact = down != after[name].reshape(-1).view(torch.int32)
        rounded_up += int(((got == up) & inexact).sum())
        total += int(inexact.sum())
    assert 0.2 < rounded_up / total < 0.8, "stochastic rounding goes up about as often as its remainders say"

    # The learner's logprobs are a plain bf16 forward's with exactly those weights.
    copy = actor.compute.model
    for name, p in copy.named_parameters():
        assert torch.equal(p, published[name if name in published else "model.embed_tokens.weight"])
    got = actor.compute_logprobs(seqs[:4])
    for s, lp in zip(seqs[:4], got, strict=True):
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logits = copy(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        want = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp, want, atol=2e-2, rtol=0)  # bf16: packed vs plain summation order


def test_the_rounding_repeats_for_the_same_seed_step_and_update_and_follows_a_loaded_checkpoint(tiny_model):
    actor = make_actor(tiny_model, actor=PUBLISHED, seed=3)
    actor.update(make_seqs(8, groups=True), group_size=4)
    first = {n: t.clone() for n, t in actor.named_weights(torch.bfloat16)}
    again = ComputeCopy(actor.policy, seed=3)  # a resumed run: same masters, seed, step
    again.refresh(actor.step, 0)
    assert all(torch.equal(first[n], t) for n, t in full_tensors(again.model))
    other = ComputeCopy(actor.policy, seed=4)
    other.refresh(actor.step, 0)
    assert any(not torch.equal(first[n], t) for n, t in full_tensors(other.model))
    # Masters replaced from outside an update (a checkpoint): the copy follows at its next use.
    with torch.no_grad():
        for p in actor.policy.parameters():
            p.zero_()
    actor.masters_loaded()
    assert all(int(t.count_nonzero()) == 0 for _, t in actor.named_weights(torch.bfloat16))


def test_gradients_reach_the_fp32_masters_in_the_advantage_direction(tiny_model):
    seqs = make_seqs(8, groups=True)
    actor = make_actor(tiny_model, actor={**PUBLISHED, "max_tokens_per_micro_batch": 16}, optim={"lr": 1e-3})
    start = actor.compute_logprobs(seqs)
    metrics = actor.update(seqs, group_size=4)
    assert metrics["actor/grad_norm"] > 0
    end = actor.compute_logprobs(seqs)
    moved = [float((e - s).mean()) * s_.advantage for s, e, s_ in zip(start, end, seqs, strict=True)]
    assert sum(moved) > 0, "positive-advantage completions became likelier, negative ones less likely"


def test_published_bf16_weights_need_a_bf16_publish_and_full_weights(tiny_model):
    with pytest.raises(ValueError, match="model.dtype is float32"):
        load_config(StackConfig, None, ["learner.actor.dtype=bfloat16", "learner.actor.bf16_weights=published",
                                        "model.dtype=float32"]).learner_run()
    load_config(StackConfig, None, ["learner.actor.bf16_weights=published"]).learner_run()  # bf16 is the default
    # LoRA's frozen base is stored in bf16 already: the adapter computes under autocast.
    lora = make_actor(tiny_model, actor=PUBLISHED, lora=LoraConfig(rank=4, alpha=8))
    assert lora.compute is None and lora.update(make_seqs(8, groups=True), group_size=4)["actor/grad_norm"] > 0


def test_auto_compute_dtype_follows_the_cpus_bf16_instructions(tiny_model, monkeypatch):
    from dgrpo.common import devices

    native = devices.computes_bf16("cpu")  # this host's own answer, from /proc/cpuinfo
    auto = make_actor(tiny_model, actor={**PUBLISHED, "dtype": "auto"})
    assert auto.cfg.dtype == ("bfloat16" if native else "float32")
    assert (auto.compute is not None) == native  # the published bf16 copy only where bf16 is computed natively
    assert auto.update(make_seqs(8, groups=True), group_size=4)["actor/grad_norm"] > 0
    demo = ["learner.actor.dtype=auto", "learner.actor.bf16_weights=published", "model.dtype=auto", "model.device=cpu"]
    for flags, chosen in (({"avx512f", "avx512_bf16"}, "bfloat16"), ({"amx_bf16", "amx_tile"}, "bfloat16"),
                          ({"avx2", "avx512f", "avx512_vnni"}, "float32"), (set(), "float32")):
        monkeypatch.setattr(devices, "cpu_flags", lambda flags=flags: flags)
        assert ActorConfig(dtype="auto").on_device("cpu").dtype == chosen
        assert ActorConfig(dtype="float32").on_device("cpu").dtype == "float32"  # only auto is decided
        # model.dtype auto (the samplers' and the published weights') is decided alike when the config loads.
        stack = load_config(StackConfig, None, demo)
        assert stack.model.dtype == chosen and stack.learner_run().model.dtype == chosen
        if chosen == "bfloat16":  # the published copy needs bf16 weights to publish
            with pytest.raises(ValueError, match=r"\(learner.actor.dtype auto\): model.dtype is float32"):
                load_config(StackConfig, None, [*demo, "model.dtype=float32"]).learner_run()
        else:  # fp32 compute publishes fp32 weights: nothing to round
            load_config(StackConfig, None, [*demo, "model.dtype=float32"]).learner_run()
    assert ActorConfig(dtype="auto").on_device("npu").dtype == "bfloat16"
    # A named device is taken as named, so a plan for an NPU host loads on this one.
    assert load_config(StackConfig, None, ["model.dtype=auto", "model.device=npu"]).model.dtype == "bfloat16"
