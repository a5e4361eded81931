"""DAPO's overlong shaping and dynamic sampling (learner/rollout/dapo.py) against verl's code re-implemented as verl
writes
it: DAPORewardManager.__call__ (verl/workers/reward_manager/dapo.py) and the filter of RayDAPOTrainer.fit
(recipe/dapo/dapo_ray_trainer.py); and the replacement loop that keeps a step at train_batch_size informative groups.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dgrpo.learner.rollout import dapo
from dgrpo.learner.rollout.client import RolloutStats
from dgrpo.learner.rollout.reward_client import GroupReward
from dgrpo.learner.update.config import FilterGroupsConfig, OverlongBufferConfig


def verl_dapo_rewards(scores, response_lengths, max_resp_len, buffer_len, factor, enable=True, pad_to=None):
    """verl's DAPORewardManager.__call__, its reward arithmetic as verl writes it: per item the valid response
    length from the attention mask, the penalty added to the score, placed at the last valid token; returns the
    sequence rewards (token_level_scores.sum(-1), verl's `seq_reward`)."""
    overlong_buffer_cfg = SimpleNamespace(enable=enable, len=buffer_len, penalty_factor=factor)
    width = pad_to or max(response_lengths)
    attention = torch.zeros(len(scores), width, dtype=torch.long)
    for i, n in enumerate(response_lengths):
        attention[i, :n] = 1
    reward_tensor = torch.zeros(len(scores), width, dtype=torch.float32)
    for i in range(len(scores)):
        valid_response_length = attention[i].sum()
        reward = scores[i]
        if overlong_buffer_cfg.enable:
            overlong_buffer_len = overlong_buffer_cfg.len
            expected_len = max_resp_len - overlong_buffer_len
            exceed_len = valid_response_length - expected_len
            overlong_penalty_factor = overlong_buffer_cfg.penalty_factor
            overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
            reward += overlong_reward
        reward_tensor[i, valid_response_length - 1] = reward
    return reward_tensor.sum(dim=-1).tolist()


def group_reward(rewards, valid=None, breakdown=None) -> GroupReward:
    n = len(rewards)
    return GroupReward(rewards=list(rewards), valid=list(valid or [True] * n),
                       breakdown=breakdown or [{} for _ in range(n)], spec="test@1#0")


@pytest.mark.parametrize("max_len,buffer_len,factor", [(8192, 4096, 1.0), (64, 16, 0.5), (20, 20, 2.0), (100, 1, 1.0)])
def test_overlong_penalty_is_verls(max_len, buffer_len, factor):
    rng = random.Random(max_len + buffer_len)
    lengths = sorted({1, max_len - buffer_len, max_len - buffer_len + 1, max_len, *(rng.randint(1, max_len)
                                                                                 for _ in range(40))})
    scores = [rng.choice([0.0, 1.0, 0.5]) for _ in lengths]
    expected = verl_dapo_rewards(scores, lengths, max_len, buffer_len, factor, pad_to=max_len)
    reward = group_reward(scores)
    dapo.apply_overlong(reward, lengths, OverlongBufferConfig(enable=True, len=buffer_len, penalty_factor=factor),
                        max_len)
    assert reward.rewards == pytest.approx(expected, abs=1e-6)
    assert reward.breakdown[lengths.index(max_len)]["overlong_reward"] == pytest.approx(-factor)
    assert all(b["overlong_reward"] == 0
               for n, b in zip(lengths, reward.breakdown, strict=True) if n <= max_len - buffer_len)


def test_overlong_buffer_off_and_invalid_completions():
    reward = group_reward([1.0, 0.5])
    dapo.apply_overlong(reward, [64, 64], OverlongBufferConfig(), 64)
    assert reward.rewards == [1.0, 0.5] and reward.breakdown == [{}, {}]
    cfg = OverlongBufferConfig(enable=True, len=8, penalty_factor=1.0, max_response_length=32)  # verl's max_resp_len
    reward = group_reward([1.0, 0.7], valid=[True, False])
    dapo.apply_overlong(reward, [32, 32], cfg, 64)
    assert reward.rewards == [0.0, 0.7]  # a completion without a reward keeps its placeholder (out of the loss)
    with pytest.raises(ValueError, match="overlong_buffer.len must be positive"):
        OverlongBufferConfig(enable=True, len=0)


def verl_kept_uids(uids, values):
    """RayDAPOTrainer.fit's filter, as verl writes it."""
    prompt_uid2metric_vals = defaultdict(list)
    for uid, metric_val in zip(uids, values, strict=True):
        prompt_uid2metric_vals[uid].append(metric_val)
    prompt_uid2metric_std = {}
    for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
        prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
    return [uid for uid, std in prompt_uid2metric_std.items() if std > 0 or len(prompt_uid2metric_vals[uid]) == 1]


@pytest.mark.parametrize("metric", ["acc", "score", "seq_reward", "seq_final_reward"])
def test_filter_keeps_what_verl_keeps(metric):
    """Random groups of verl-style results ({"score", "acc"} from compute_score, the overlong penalty on top):
    dgrpo keeps a group exactly when verl's filter keeps its uid."""
    rng = random.Random(7)
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    uids, verl_vals, ours = [], [], {}
    for g in range(200):
        n = 4
        acc = [float(rng.random() < 0.3) if g % 3 else 1.0 for _ in range(n)]  # every third group all right
        lengths = [rng.choice([5, 10, 15, 16]) for _ in range(n)] if g % 2 else [8] * n
        score = [a - 0.5 for a in acc]
        reward = group_reward(score, breakdown=[{"compute_score/acc": a, "compute_score/score": s}
                                                for a, s in zip(acc, score, strict=True)])
        dapo.apply_overlong(reward, lengths, cfg, 16)
        final = verl_dapo_rewards(score, lengths, 16, 4, 1.0)
        values = {"acc": acc, "score": score, "seq_reward": final, "seq_final_reward": final}[metric]
        uids += [f"u{g}"] * n
        verl_vals += values
        ours[f"u{g}"] = dapo.informative(dapo.group_metric(reward, metric))
    kept = set(verl_kept_uids(uids, verl_vals))
    assert {u for u, keep in ours.items() if keep} == kept
    assert 0 < len(kept) < 200


def test_metric_resolution():
    plain = group_reward([1.0, 0.0], breakdown=[{"math_verify": 1.0}, {"math_verify": 0.0}])
    assert dapo.group_metric(plain, "acc") == [1.0, 0.0]  # a built-in 0/1 check
    scalar = group_reward([0.5, 0.5])
    assert dapo.group_metric(scalar, "acc") == [0.5, 0.5]  # verl: a scalar score is recorded as acc
    assert not dapo.informative(dapo.group_metric(group_reward([1.0, 1.0, 0.3], valid=[True, True, False]), "reward"))
    with pytest.raises(ValueError, match="learner.algorithm.filter_groups.metric='pred'.*known: .*math_verify"):
        dapo.group_metric(plain, "pred")
    assert FilterGroupsConfig().metric == "acc" and FilterGroupsConfig().max_num_gen_batches == 0


def scripted_wave(informative_by_prompt, log, delay=0.01):
    """sample_wave over records that are prompt numbers: a group is informative when the table says so; each
    group is 'scored' after `delay` x its position, so replacements can start before the wave ends."""

    async def sample_wave(records, wave, on_scored):
        log.append(("start", wave, list(records)))
        scored = []
        for i, rec in enumerate(records):
            await asyncio.sleep(delay)
            value = [1.0, 0.0] if informative_by_prompt[rec] else [1.0, 1.0]
            sg = SimpleNamespace(record=rec, reward=group_reward(value))
            scored.append(sg)
            on_scored(i, sg)
        log.append(("end", wave))
        stats = RolloutStats(calls=1)
        return scored, stats, 0.5, (delay * len(records), 0.0)

    return sample_wave


def keep(sg):
    return dapo.informative(dapo.group_metric(sg.reward, "reward"))


def test_dropped_groups_are_replaced_while_the_batch_is_still_sampled():
    table = {i: i % 3 != 0 for i in range(100)}  # prompts 0, 3, 6, ... carry no signal
    stream = iter(range(8, 100))
    log: list = []
    kept, stats, busy, fstats, _ = asyncio.run(dapo.fill_informative(
        list(range(8)), lambda k: [next(stream) for _ in range(k)], scripted_wave(table, log), keep, None))
    assert [sg.record for sg in kept] == [1, 2, 4, 5, 7, 8, 10, 11]  # the batch's own first, then replacements
    assert fstats.filtered == 3 + 1 and fstats.requested == 8 + 4 and fstats.kept == 8  # 0, 3, 6 and then 9
    assert stats.calls == fstats.waves and busy == 0.5 * fstats.waves
    first_end = log.index(("end", 0))
    assert any(e[0] == "start" and e[1] > 0 for e in log[:first_end]), log  # replacement before the batch ended
    m = fstats.as_metrics(8, 8)
    assert (m["filter_groups/filtered_groups"], m["filter_groups/extra_prompts"], m["filter_groups/kept_groups"]) == \
        (4.0, 4.0, 8.0)
    assert m["filter_groups/num_gen_batches"] == 2.0


def test_cap_stops_with_verls_advice():
    table = defaultdict(lambda: False)  # nothing ever differs
    stream = iter(range(4, 1000))
    with pytest.raises(dapo.TooFewInformativeGroups, match="max_num_gen_batches x gen_batch_size = 12"):
        asyncio.run(dapo.fill_informative(list(range(4)), lambda k: [next(stream) for _ in range(k)],
                                          scripted_wave(table, []), keep, 12))
    assert next(stream) == 12  # exactly the cap was drawn: 4 + 8 replacements


def test_a_failed_wave_fails_the_step():
    async def broken(records, wave, on_scored):
        raise RuntimeError("sampler gone")

    with pytest.raises(RuntimeError, match="sampler gone"):
        asyncio.run(dapo.fill_informative([1, 2], lambda k: [0] * k, broken, keep, None))


def test_overlong_buffer_longer_than_the_response_is_refused_by_key():
    from dgrpo.cli.stack import StackConfig
    from dgrpo.common.config import ConfigError, load_config

    cfg = load_config(StackConfig, None, ["learner.algorithm.overlong_buffer.enable=true",
                                          "learner.algorithm.overlong_buffer.len=300",
                                          "learner.rollout.max_response_length=256"])
    with pytest.raises(ConfigError, match="learner.algorithm.overlong_buffer.len=300 exceeds .* 256"):
        cfg.check_whole_stack()
