"""Rollout and reward clients without services: address resolution, input checks, giving up clearly, conversions."""

from __future__ import annotations

import asyncio

import pytest
from support import free_port

from dgrpo.learner.reward_client import RewardClient, score_group
from dgrpo.learner.rollout import RolloutClient, RolloutConfig, RolloutError, make_prompt, resolve_addresses
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
