"""Off-policy correction (`learner.algorithm.off_policy`): the proximal/behaviour ratio r = exp(learner's logprob at
the start of the step - sampler's logprob) weights (tis) or rejects (mask) tokens. Expected values are derived
here in plain torch / Python from the definitions, then compared with dgrpo.learner.update.grpo and with the real
Actor's
update on the tiny model."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import yaml

from dgrpo.cli.stack import StackConfig
from dgrpo.common.config import ConfigError, load_config, to_yaml
from dgrpo.learner.update import grpo
from dgrpo.learner.update.actor import Actor
from dgrpo.learner.update.batch import Sequence
from dgrpo.learner.update.config import ActorConfig, AlgorithmConfig, MaskedIS, OptimConfig, TruncatedIS
from dgrpo.learner.update.step_sums import StepSums

NEW_METRICS = {"actor/is_weight_mean", "actor/is_weight_max", "actor/off_policy_masked_frac"}

# ---- the formulas ---------------------------------------------------------------------------------------------


def test_truncated_weights_are_capped_ratios():
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    ratios = [3.0, 1.5, 0.1, 2.0]
    proximal = behaviour + torch.tensor([[math.log(r) for r in ratios]])
    w = grpo.truncated_is_weights(proximal, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.5, 0.1, 2.0]]))
    assert not w.requires_grad


def test_token_mask_keeps_the_band_edges_and_drops_beyond():
    """Band [0.5, 2]: ratios on the edges are kept (compared as log-ratios), just beyond them dropped; padding 0."""
    log_ratio = torch.tensor([[0.0, math.log(0.5), math.log(0.49), math.log(2.0), math.log(2.01), 5.0]])
    behaviour = torch.full_like(log_ratio, -2.0)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    keep = grpo.off_policy_keep(behaviour + log_ratio, behaviour, mask, (0.5, 2.0), "token")
    assert keep.tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]]
    # lower bound 0: nothing is too unlikely (AReaL's behav_imp_weight_cap only bounds from above)
    keep = grpo.off_policy_keep(behaviour + log_ratio, behaviour, mask, (0.0, 2.0), "token")
    assert keep.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
    very_unlikely = grpo.off_policy_keep(torch.tensor([[-30.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1),
                                         (0.0, 2.0))
    assert very_unlikely.tolist() == [[1.0]]


def test_sequence_mask_uses_the_geometric_mean_of_its_tokens():
    token_ratios = [
        [3.0, 1 / 3, 1.0, 1.0],  # geometric mean 1: kept, though two tokens are out of the band
        [1.9, 1.9, 4.0, 1.0],  # (1.9 * 1.9 * 4) ** (1/3) = 2.43: all dropped, though two tokens are in the band
        [3.0, 3.0, 1.0, 1.0],  # padding (ratio 1 there) would pull the mean to 1.73 if it counted: 3 -> dropped
        [2.0, 2.0, 1.0, 1.0],  # exactly on the upper edge: kept
        [0.4, 0.7, 0.8, 1.0],  # (0.224) ** (1/3) = 0.607: kept; token level drops the first
    ]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    behaviour = torch.full((5, 4), -1.5)
    log_ratio = torch.tensor([[math.log(r) for r in row] for row in token_ratios])
    keep = grpo.off_policy_keep(behaviour + log_ratio, behaviour, mask, (0.5, 2.0), "sequence")
    for b, row in enumerate(token_ratios):
        n = int(mask[b].sum())
        geo = math.prod(row[:n]) ** (1 / n)
        want = 1.0 if (0.5 <= geo <= 2.0 or b == 3) else 0.0  # b == 3: the edge, float rounding aside
        assert keep[b].tolist() == [want] * n + [0.0] * (4 - n), (b, geo)
    assert keep[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    token = grpo.off_policy_keep(behaviour + log_ratio, behaviour, mask, (0.5, 2.0), "token")
    assert token[0].tolist() == [0.0, 0.0, 1.0, 1.0] and token[1].tolist() == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="geometric"):
        grpo.off_policy_keep(behaviour, behaviour, mask, (0.5, 2.0), "geometric")


def test_policy_loss_drops_rejected_tokens_but_keeps_them_in_the_denominator():
    """keep zeroes a token's whole loss (policy gradient and KL) and its gradient; the token-mean still divides by
    every loss token (AReaL's choice). The statistics: weight mean / max over the mask, masked fraction."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.5, -0.5], [-1.0, -0.4, -3.0]])
    ref = torch.tensor([[-0.9, -2.5, -0.7], [-1.2, -0.1, -2.0]])
    adv = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = torch.tensor([[1.2, 0.5, 2.0], [0.7, 1.0, 9.0]])
    keep = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    beta = 0.3
    loss, stats = grpo.policy_loss(logp, old, adv, mask, ref_logp=ref, beta=beta, is_weights=w, keep=keep)

    r = torch.exp(logp.detach() - old)
    a = adv[:, None]
    pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    kl = torch.exp(ref - logp.detach()) - (ref - logp.detach()) - 1
    want = (keep * (pg * w + beta * kl) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert stats["pg_loss"].item() == pytest.approx(((keep * pg * w * mask).sum() / 5).item(), rel=1e-6)
    assert stats["is_weight_mean"].item() == pytest.approx((1.2 + 2.0 + 0.7 + 1.0) / 5)
    assert stats["is_weight_max"].item() == pytest.approx(2.0)  # 9.0 is on padding, 0.5 rejected
    assert stats["off_policy_masked_frac"].item() == pytest.approx(1 / 5)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 2] == 0
    assert (logp.grad[keep.bool()] != 0).all()
    # keep all ones is the plain loss
    plain, plain_stats = grpo.policy_loss(logp.detach(), old, adv, mask, ref_logp=ref, beta=beta, is_weights=w)
    ones, _ = grpo.policy_loss(logp.detach(), old, adv, mask, ref_logp=ref, beta=beta, is_weights=w,
                               keep=torch.ones_like(mask))
    assert ones.item() == pytest.approx(plain.item(), rel=1e-7)
    assert "off_policy_masked_frac" not in plain_stats
    assert "is_weight_mean" not in grpo.policy_loss(logp.detach(), old, adv, mask)[1]


# ---- the configuration ------------------------------------------------------------------------------------------


def test_tis_cap_alone_still_means_tis_and_tis_defaults_its_cap():
    assert AlgorithmConfig().off_policy == "none" and AlgorithmConfig().tis_cap is None
    assert AlgorithmConfig(tis_cap=3.0) == AlgorithmConfig(off_policy="tis", tis_cap=3.0)
    assert AlgorithmConfig(off_policy="tis").tis_cap == 2.0
    assert AlgorithmConfig(off_policy="mask").tis_cap is None  # mask: kept tokens unweighted unless a cap is set
    # what show-config writes loads back to the same config
    cfg = load_config(StackConfig, None, ["learner.algorithm.tis_cap=1.5"])
    assert cfg.learner.algorithm.off_policy == "tis"
    again = StackConfig.model_validate(yaml.safe_load(to_yaml(cfg)))
    assert again.learner.algorithm == cfg.learner.algorithm


def test_the_keys_make_one_typed_correction_and_the_loss_takes_it():
    """The flat keys users write become one variant (`AlgorithmConfig.correction`); the loss's inputs derived from it
    are the separate helpers' results."""
    assert AlgorithmConfig().correction is None
    assert AlgorithmConfig(tis_cap=3.0).correction == TruncatedIS(3.0)
    assert AlgorithmConfig(off_policy="mask", off_policy_band=(0.25, 4.0), off_policy_level="sequence").correction \
        == MaskedIS((0.25, 4.0), "sequence", None)
    g = torch.Generator().manual_seed(0)
    prox, behav = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)  # [B, T]
    mask = torch.ones(3, 5)
    assert grpo.off_policy_weights(None, prox, behav, mask) == (None, None)
    w, keep = grpo.off_policy_weights(TruncatedIS(2.0), prox, behav, mask)
    assert torch.equal(w, grpo.truncated_is_weights(prox, behav, 2.0)) and keep is None
    w, keep = grpo.off_policy_weights(MaskedIS((0.5, 2.0), "token", 3.0), prox, behav, mask)
    assert torch.equal(w, grpo.truncated_is_weights(prox, behav, 3.0))
    assert torch.equal(keep, grpo.off_policy_keep(prox, behav, mask, (0.5, 2.0), "token"))
    w, keep = grpo.off_policy_weights(MaskedIS((0.5, 2.0), "sequence"), prox, behav, mask)
    assert w is None and torch.equal(keep, grpo.off_policy_keep(prox, behav, mask, (0.5, 2.0), "sequence"))


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["off_policy=none", "tis_cap=2"], ["tis_cap=2.0", "off_policy='none'"]),
        (["off_policy=mask", "old_logprobs=sampler"], ["off_policy='mask'", "old_logprobs='recompute'"]),
        (["tis_cap=2", "old_logprobs=sampler"], ["tis_cap", "old_logprobs='recompute'"]),
        (["off_policy=tis", "off_policy_level=sequence"], ["off_policy_level='sequence'", "off_policy='mask'"]),
        (["off_policy=mask", "off_policy_band=[2.0, 0.5]"], ["off_policy_band=[2.0, 0.5]"]),
        (["off_policy=mask", "off_policy_band=[1.1, 2.0]"], ["off_policy_band=[1.1, 2.0]"]),
        (["off_policy=mask", "off_policy_band=[-0.1, 2.0]"], ["off_policy_band=[-0.1, 2.0]"]),
        (["off_policy=clip"], ["learner.algorithm.off_policy", "'clip'"]),
    ],
)
def test_config_errors_name_the_keys(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(StackConfig, None, [f"learner.algorithm.{o}" for o in overrides])
    for text in expected:
        assert text in str(err.value)
    assert "learner.algorithm" in str(err.value)


# ---- through the Actor ------------------------------------------------------------------------------------------


def make_actor(path, algorithm: dict, **actor) -> Actor:
    return Actor(
        path,
        ActorConfig(**{"ppo_mini_batch_size": 2, "micro_batch_size_per_device": 4, "dtype": "float32", **actor}),
        OptimConfig(lr=1e-3),
        AlgorithmConfig(**algorithm),
        total_steps=10,
        max_response_length=8,
    )


def token_logprobs(model, s: Sequence) -> torch.Tensor:
    """Completion-token logprobs of one sequence from a plain full forward (temperature 1), with grad."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]


def base_seqs(n: int = 8) -> list[Sequence]:
    """n sequences (groups of 4) of 2-6 completion tokens, advantages of four different sizes."""
    g = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(n):
        p, c = 3 + i % 3, 2 + (i * 3) % 5
        ids = torch.randint(5, 1000, (p + c,), generator=g).tolist()
        seqs.append(Sequence(ids[:p], ids[p:], (1.0, -0.5, 2.0, -1.5)[i % 4]))
    return seqs


# per-token log-ratio proximal - behaviour: in the band [0.5, 2] (|x| < 0.69), above, below, near 0
SHIFTS = (0.3, 1.2, -0.4, 0.0, -1.1, 0.6, 0.9, -0.2)
SEQ_BASE = (0.1, 1.0, -0.9, -0.3)  # per sequence, so that sequence-level decisions differ from token-level ones

CASES = {
    "tis_cap only (tis)": ({"tis_cap": 2.0}, "tis"),
    "mask, token, KL": ({"off_policy": "mask", "beta": 0.4}, "token"),
    "mask, sequence, cap": ({"off_policy": "mask", "off_policy_level": "sequence", "tis_cap": 1.5}, "sequence"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_weights_and_masks_as_derived_here(tiny_model, case):
    """One update (the proximal policy is the policy itself, so the PPO ratio is 1 and every token's policy
    gradient term is -A x its weight); the sampler's logprobs are the policy's shifted per token. Loss, gradient
    norm and every off-policy metric against plain per-sequence forwards, over two padded micro-batches."""
    algorithm, level = CASES[case]
    actor = make_actor(tiny_model, algorithm)
    cfg = actor.algo
    if actor.reference is not None:
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in actor.reference.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    band_low, band_high = math.log(0.5), math.log(2.0)
    seqs, terms, kls, weights, keeps, diffs = [], [], [], [], [], []
    for i, s in enumerate(base_seqs()):
        logp = token_logprobs(actor.policy, s)  # [C] with grad
        shift = torch.tensor([SEQ_BASE[i % 4] + SHIFTS[(t + i) % len(SHIFTS)] for t in range(len(logp))])
        if level == "sequence":
            shift = SEQ_BASE[i % 4] * 2 + (shift - shift.mean()) * 2  # spread tokens, keep a chosen mean
        seqs.append(Sequence(s.prompt_ids, s.completion_ids, s.advantage, (logp.detach() - shift).tolist()))
        if level == "tis":
            keep = torch.ones_like(shift)
        elif level == "token":
            keep = ((shift >= band_low) & (shift <= band_high)).float()
        else:
            geo = math.exp(shift.mean().item())
            assert min(abs(geo - 0.5), abs(geo - 2.0)) > 0.02  # no decision on float noise
            keep = torch.full_like(shift, float(0.5 <= geo <= 2.0))
        w = shift.exp().clamp(max=cfg.tis_cap) if cfg.tis_cap else torch.ones_like(shift)
        ratio = torch.exp(logp - logp.detach())  # 1, with the policy's gradient
        terms.append(keep * w * -s.advantage * ratio)
        if actor.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(actor.reference, s)
            kls.append(keep * (torch.exp(ref - logp) - (ref - logp) - 1))
        weights.append(keep * w)
        keeps.append(keep)
        diffs.append(shift.abs())
    pg = torch.cat(terms)
    loss = (pg + cfg.beta * torch.cat(kls)).mean() if kls else pg.mean()  # token-mean, rejected tokens counted
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in actor.policy.parameters())).item()
    actor.optimizer.zero_grad(set_to_none=True)
    weights, keeps = torch.cat(weights), torch.cat(keeps)
    want = {
        "actor/loss": loss.item(),
        "actor/pg_loss": pg.mean().item(),
        "actor/grad_norm": grad_norm,
        "actor/is_weight_mean": weights.mean().item(),
        "actor/is_weight_max": weights.max().item(),
        "actor/sampler_logp_diff": torch.cat(diffs).mean().item(),
    }
    if level != "tis":
        want["actor/off_policy_masked_frac"] = 1 - keeps.mean().item()
        assert 0.1 < want["actor/off_policy_masked_frac"] < 0.9  # some dropped, some kept
    if level == "sequence":  # the sequence decision is not the token one
        assert not torch.equal(keeps, (torch.cat(diffs) <= band_high).float())  # |log r| <= log 2: token level
    if cfg.tis_cap:
        assert want["actor/is_weight_max"] == pytest.approx(cfg.tis_cap)  # some ratio exceeds the cap
    got = actor.update(seqs, group_size=4)
    assert NEW_METRICS & set(got) == set(want) & NEW_METRICS
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_proximal_policy_is_the_policy_at_the_start_of_the_step(tiny_model):
    """Two updates in one step: the second mini-batch's policy has moved (ratio != 1), but its importance weights
    are still proximal (the recomputed start-of-step logprobs) / behaviour."""
    probe = make_actor(tiny_model, {})
    seqs, weights = [], []
    for i, s in enumerate(base_seqs()):
        with torch.no_grad():
            logp = token_logprobs(probe.policy, s)
        shift = torch.tensor([SHIFTS[(t + i) % len(SHIFTS)] for t in range(len(logp))])
        seqs.append(Sequence(s.prompt_ids, s.completion_ids, s.advantage, (logp - shift).tolist()))
        weights.append(shift.exp().clamp(max=2.0))
    actor = make_actor(tiny_model, {"off_policy": "tis"}, ppo_mini_batch_size=1)
    got = actor.update(seqs, group_size=4)
    assert got["actor/updates"] == 2
    assert abs(got["actor/ratio"] - 1.0) > 1e-3  # the policy of the second update differs from the proximal one
    assert got["actor/is_weight_mean"] == pytest.approx(torch.cat(weights).mean().item(), rel=1e-5)
    assert got["actor/is_weight_max"] == pytest.approx(2.0)


def test_default_reports_no_off_policy_metrics_and_mask_needs_sampler_logprobs(tiny_model):
    seqs = [Sequence(s.prompt_ids, s.completion_ids, s.advantage, [-7.0] * len(s.completion_ids))
            for s in base_seqs()]
    assert not NEW_METRICS & set(make_actor(tiny_model, {}).update(seqs, group_size=4))
    bare = [Sequence(s.prompt_ids, s.completion_ids, s.advantage) for s in seqs]
    for algorithm in ({"off_policy": "mask"}, {"tis_cap": 2.0}):
        with pytest.raises(ValueError, match="sampler's logprobs on every sequence"):
            make_actor(tiny_model, algorithm).update(bare, group_size=4)


def _rank_sums(rank: int, port: int, out: str) -> None:
    from dgrpo.learner.update.distributed import init_distributed, shutdown_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ctx = init_distributed("cpu", timeout_s=60)
    try:
        mine = StepSums(loss_tokens=rank + 1.0, is_weight_mean=0.5, is_weight_max=(0.37, 1.75)[rank])
        both = mine.all_reduced(ctx, maxima=True)
        torch.save({"both": both, "local": mine.all_reduced(ctx)}, f"{out}/{rank}.pt")
    finally:
        shutdown_distributed()


def test_is_weight_max_is_the_maximum_over_ranks(child_processes, tmp_path):
    """Two gloo ranks: the sums add up in the one all-reduce, is_weight_max takes the other rank's larger value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_sums, args=(port, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert (got["both"].loss_tokens, got["both"].is_weight_mean, got["both"].is_weight_max) == (3.0, 1.0, 1.75)
        assert got["local"].is_weight_max == (0.37, 1.75)[rank]  # maxima=False: no second collective
