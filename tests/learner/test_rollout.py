"""Rollout and reward clients without services: address resolution, input checks, giving up clearly, conversions."""

from __future__ import annotations

import asyncio

import pytest
from support import free_port

from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.client import RolloutClient, RolloutError, make_prompt, resolve_addresses
from dgrpo.learner.rollout.reward_client import RewardClient, score_group
from dgrpo.v1 import rewarder_pb2, sampler_pb2


def test_resolve_addresses_expands_dns_names_and_keeps_host_ports():
    assert resolve_addresses(["a:1", "b:2", "a:1"]) == ["a:1", "b:2"]
    resolved = resolve_addresses(["dns:///localhost:50051"])
    assert "127.0.0.1:50051" in resolved
    assert all(r.endswith(":50051") for r in resolved)
    assert resolve_addresses(["dns:///no-such-host.invalid:1"]) == []  # not up yet: retried by the client
    with pytest.raises(RolloutError, match="not dns:///name:port"):
        resolve_addresses(["dns:///nameonly"])


def test_client_rejects_bad_input():
    with pytest.raises(RolloutError, match="sampler.addresses is empty"):
        RolloutClient([], RolloutConfig())

    async def duplicate_ids():
        client = RolloutClient(["127.0.0.1:1"], RolloutConfig())
        try:
            prompts = [make_prompt("p", [1]), make_prompt("p", [2])]
            async for _ in client.generate(prompts, sampler_pb2.SamplingParams(n=2, max_tokens=1)):
                pass
        finally:
            await client.close()

    with pytest.raises(RolloutError, match="unique"):
        asyncio.run(duplicate_ids())


def test_no_replica_reachable_fails_the_step_naming_what_is_missing():
    cfg = RolloutConfig(retry_backoff_s=0.05, max_backoff_s=0.1, step_timeout_s=1.5)

    async def scenario():
        client = RolloutClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], cfg)
        try:
            prompts = [make_prompt(f"p{i}", [1, 2]) for i in range(3)]
            async for _ in client.generate(prompts, sampler_pb2.SamplingParams(n=2, max_tokens=4)):
                pass
        finally:
            await client.close()

    with pytest.raises(RolloutError, match=r"3 of 3 groups still missing after rollout.step_timeout_s=1.5s"):
        asyncio.run(scenario())


def test_score_group_formats_and_failed_completions_are_masked():
    chat = [{"role": "user", "content": "1+1?"}]
    g = score_group("g", chat, ["2", "x", "3"], {"answer": "2", "level": 1})
    assert g.WhichOneof("prompt") == "chat" and g.chat.messages[0].content == "1+1?"
    assert dict(g.extra) == {"answer": "2", "level": 1.0}
    assert score_group("g", "text", ["a"], {}).text == "text"

    ok, err = rewarder_pb2.SCORE_STATUS_OK, rewarder_pb2.SCORE_STATUS_ERROR
    response = rewarder_pb2.ScoreResponse(
        groups=[rewarder_pb2.GroupScores(prompt_id="g", scores=[
            rewarder_pb2.CompletionScore(reward=1.0, status=ok, breakdown={"math_verify": 1.0}),
            rewarder_pb2.CompletionScore(reward=0.0, status=err, message="boom"),
            rewarder_pb2.CompletionScore(reward=0.0, status=ok, breakdown={"math_verify": 0.0}),
        ])],
        spec=rewarder_pb2.RewardSpecRef(name="math", version=2, content_hash="abcdef0123456789"),
    )
    reward = RewardClient._to_reward(g, response, retries=1)
    assert reward.rewards == [1.0, 0.5, 0.0]  # the failed one takes the mean of the valid ones
    assert reward.valid == [True, False, True] and reward.errors == ["boom"]
    assert reward.spec == "math@2#abcdef01" and reward.breakdown[0] == {"math_verify": 1.0}


def test_the_hedge_delay_is_a_share_of_the_batch_so_far_with_a_floor():
    """A replica idle for 2 s hedges a 4 s-old batch, but waits 10 s in a 40 s-old one: equal replicas finish within a
    fraction of each other at every batch length."""
    from dgrpo.learner.rollout.rollout_batch import Batch, RolloutStats

    client = RolloutClient(["127.0.0.1:1"], RolloutConfig(hedge_after_s=2.0, hedge_after_share=0.25))
    batch = Batch({}, asyncio.Queue(), asyncio.Queue(), RolloutStats(), sampler_pb2.SamplingParams(), 0)
    batch.started -= 4.0
    assert client._hedge_delay(batch) == pytest.approx(2.0)
    batch.started -= 36.0
    assert client._hedge_delay(batch) == pytest.approx(10.0, abs=0.05)
    fixed = RolloutClient(["127.0.0.1:1"], RolloutConfig(hedge_after_s=2.0, hedge_after_share=0.0))
    assert fixed._hedge_delay(batch) == 2.0


def test_a_replica_stepping_slower_than_half_the_fastest_over_a_window_is_a_straggler():
    """Judged over a trailing window of at least two check periods (and 7 steps of the fastest): no verdict before
    the readings span it, then one slow window suffices."""
    from dgrpo.learner.rollout.stragglers import StepRates, steps_to_judge

    assert steps_to_judge(0.5) == 7
    rates = StepRates(0.5, check_s=1.0)
    assert rates.observe(0.0, {"a": 0, "b": 0}) == []  # no rate yet
    assert rates.observe(1.0, {"a": 20, "b": 5}) == []  # one check period: no verdict yet (a slow prefill, a pause)
    assert rates.observe(2.0, {"a": 40, "b": 10}) == ["b"]  # 5/s against 20/s over 2 s
    assert rates.rates == {"a": 20.0, "b": 5.0} and rates.judged["b"] == 5.0
    assert rates.observe(3.0, {"a": 60, "b": 30}) == []  # b keeps up again (12.5/s >= half of 20/s over 2 s)
    assert rates.keeping_pace() == {"a", "b"}
    # A replica that stops answering Info reads as not stepping since its last answer (a lower bound of its rate);
    # one that finished its prompts is forgotten but its last rate still says what a healthy engine does.
    assert rates.observe(4.0, {"a": 80, "b": None}) == []  # 10/s over 2 s: not slower than half yet
    assert rates.observe(5.0, {"b": None}, holding={"b"}) == ["b"]  # no step in 2 s
    assert rates.observe(6.0, {"a": 80, "b": 70}, holding={"a", "b"}) == []  # b caught up; a: a new window
    assert rates.rates["a"] == 20.0  # its earlier rate, not 0 steps over 2 s
    # Nothing stepping at all says nothing.
    idle = StepRates(0.5, check_s=1.0)
    assert [idle.observe(t, {"a": 7, "b": 7}) for t in range(4)] == [[]] * 4


def test_equal_replicas_whose_engine_steps_take_longer_than_a_check_are_never_stragglers():
    """Issue 47, item 3: on a loaded host one engine step (0.6 s) is longer than a check (0.25 s), so over one check a
    busy engine reads 0 steps half of the time. Judged over windows of 7 steps of the fastest, two equal replicas
    (out of phase, answers late by up to 0.2 s) never read as slow, over a whole 40 s batch; one at a third of the
    speed still does, within a few seconds."""
    from dgrpo.learner.rollout.stragglers import StepRates

    def steps(t: float, period: float, phase: float = 0.0) -> int:
        return int(max(t - phase, 0.0) / period)

    even = StepRates(0.5, check_s=0.25)
    verdicts = []
    for i in range(160):
        t = 0.1 + 0.25 * i
        lag = 0.2 * (i % 3) / 2  # b's count taken up to 0.2 s before its answer came
        verdicts.append(even.observe(t, {"a": steps(t, 0.6), "b": steps(t - lag, 0.6, phase=0.3)}))
    assert verdicts == [[]] * 160 and even.keeping_pace() == {"a", "b"}
    assert even.next_suspects() == set()
    slow = StepRates(0.5, check_s=0.25)
    found = next((0.1 + 0.25 * i for i in range(160)
                  if slow.observe(0.1 + 0.25 * i, {"a": steps(0.1 + 0.25 * i, 0.6),
                                                    "b": steps(0.1 + 0.25 * i, 1.8)})), None)
    assert found is not None and found < 6.0, found


def test_a_straggler_of_the_previous_batch_is_judged_over_one_check_and_a_recovered_one_is_cleared():
    from dgrpo.learner.rollout.stragglers import StepRates

    first = StepRates(0.5, check_s=1.0)
    first.observe(0.0, {"a": 0, "b": 0, "c": 0})
    assert first.observe(1.0, {"a": 20, "b": 2, "c": 19}) == []
    assert first.observe(2.0, {"a": 40, "b": 4, "c": 38}) == ["b"]
    assert first.next_suspects() == {"b"}
    second = StepRates(0.5, check_s=1.0, suspects=first.next_suspects())
    second.observe(0.0, {"a": 0, "b": 0})
    assert second.observe(1.0, {"a": 20, "b": 3}) == ["b"]  # over one check period
    third = StepRates(0.5, check_s=1.0, suspects={"b", "gone"})
    third.observe(0.0, {"a": 0, "b": 0})
    assert third.observe(1.0, {"a": 20, "b": 18}) == []  # b keeps up again: no longer a suspect
    assert third.next_suspects() == {"gone"}  # never judged: still suspected


def test_answers_that_come_after_their_check_are_read_at_the_time_they_came():
    """A busy replica's Info can come later than a check period: its answer, read when it came, still gives its true
    rate, so the slow one is found against it."""
    from dgrpo.learner.rollout.stragglers import StepRates

    rates = StepRates(0.5, check_s=0.5)
    assert rates.observe(0.0, {"a": None, "b": 0}) == []  # a's first answer is late: no rate to compare with yet
    assert rates.observe(0.5, {"a": 0, "b": 0}, read_at={"a": 0.3}) == []
    assert rates.observe(1.0, {"a": None, "b": 0}) == []
    assert rates.observe(1.5, {"a": 24, "b": 0}, read_at={"a": 1.1}) == ["b"]  # no step in 1 s against a's 30/s
    assert rates.rates["a"] == pytest.approx(24 / 0.8)  # 24 steps between the times its answers came, not checks
    assert rates.observe(2.0, {"a": None, "b": 0}) == ["b"]  # a late again: its rate so far is still the reference


def test_a_replica_that_finished_its_prompts_between_two_checks_still_gives_its_rate():
    """A fast replica can finish its chunk before its first window: the rate of its whole time holding prompts still
    shows what a healthy engine does, so the one still holding prompts without stepping is found."""
    from dgrpo.learner.rollout.stragglers import StepRates

    rates = StepRates(0.5, check_s=0.25)
    assert rates.observe(0.0, {"a": 0, "b": 0}) == []
    assert rates.watched() == {"a", "b"}
    assert rates.observe(0.25, {"a": 10, "b": 0}, holding={"b"}) == []  # a is done: read once more, then forgotten
    assert rates.rates["a"] == 40.0 and rates.watched() == {"b"}
    assert rates.observe(0.5, {"b": 0}, holding={"b"}) == ["b"]
    # A replica whose engine finished stepping before a check at which it still held prompts (its groups on their
    # way) reads 0 steps in its last window: that idle window does not erase the rate it showed.
    late = StepRates(0.5, check_s=1.0)
    late.observe(0.0, {"a": 0, "b": 0})
    assert late.observe(1.0, {"a": 70, "b": 0}) == []  # one check period: no verdict yet
    assert late.observe(1.5, {"a": 70, "b": 0}, holding={"b"}) == [] and late.rates["a"] == 70.0
    assert late.observe(2.0, {"b": 0}, holding={"b"}) == ["b"]  # still the reference while b holds prompts


def test_a_replica_that_finished_its_chunk_unmeasured_still_shows_a_frozen_one_is_slow():
    """On a small model the fast replica can deliver its whole chunk before it could be measured: no rate to compare
    with (the CI failure of the straggler test). Its delivered groups prove a healthy engine steps, so a holder that
    does not step at all over as long as that chunk took (and a window) is a straggler; one stepping at any rate is
    not (its speed has no reference)."""
    from dgrpo.learner.rollout.stragglers import StepRates

    rates = StepRates(0.5, check_s=0.5)
    assert rates.observe(0.0, {"a": None, "b": 3}) == []  # a busy: its only answer never comes while it holds prompts
    assert rates.observe(0.5, {"b": 3}, holding={"b"}, finished={"a": 0.4}) == []  # no verdict before a 1 s window
    assert rates.observe(1.0, {"b": 3}, holding={"b"}, finished={"a": 0.4}) == ["b"]  # no step in 1 s
    assert rates.observe(2.0, {"b": None}, holding={"b"}, finished={"a": 0.4}) == ["b"]  # nor an answer in 1 s
    assert rates.rates == {} and rates.judged == {"b": 0.0}
    # Not before as long as the finished replica took for its whole chunk.
    patient = StepRates(0.5, check_s=0.5)
    assert [patient.observe(t, {"b": 3}, holding={"b"}, finished={"a": 2.0}) for t in (0.0, 1.0, 1.5)] == [[]] * 3
    assert patient.observe(2.0, {"b": 3}, holding={"b"}, finished={"a": 2.0}) == ["b"]
    stepping = StepRates(0.5, check_s=1.0)
    stepping.observe(0.0, {"b": 3}, holding={"b"})
    assert [stepping.observe(t, {"b": 3 + 4 * t}, holding={"b"}, finished={"a": 0.4})
            for t in (1.0, 2.0, 3.0)] == [[]] * 3
    # Without a replica that finished, b's standstill says nothing (all replicas may be waiting for weights).
    alone = StepRates(0.5, check_s=1.0)
    assert [alone.observe(t, {"b": 3}, holding={"b"}) for t in (0.0, 1.0, 2.0)] == [[]] * 3
    # A replica that finished but still holds another chunk is no reference of its own.
    busy = StepRates(0.5, check_s=1.0)
    assert [busy.observe(t, {"b": 3}, holding={"a", "b"}, finished={"a": 0.1}) for t in (0.0, 1.0, 2.0)] == [[]] * 3


def test_an_idle_replica_does_not_duplicate_the_prompts_of_one_keeping_pace():
    """The idle hedge takes prompts only from a holder the straggler watch has not found keeping pace: a copy of a
    prompt another engine of about the same speed already runs starts from its first token, so it cannot win and
    slows the original meanwhile."""
    from dgrpo.learner.rollout.rollout_batch import Batch, Call, RolloutStats

    prompts = {f"p{i}": make_prompt(f"p{i}", [1]) for i in range(4)}
    batch = Batch(dict(prompts), asyncio.Queue(), asyncio.Queue(), RolloutStats(), sampler_pb2.SamplingParams(), 0)
    batch.calls.append(Call("b", ["p2", "p3"], 0.0))
    batch.keeping_pace = {"b"}
    assert batch.hedge_for("a") == []
    batch.keeping_pace = set()  # no verdict, or a slow one
    assert batch.hedge_for("a") == ["p2", "p3"]
