"""The reward client's retries and timeout (learner/rollout/reward_client.py) against a scripted rewarder
(tests/scripted_services.py: a real grpc.aio Rewarder server in its own process, exact-match scores, scripted faults).

What the client promises: a call that fails with a transient code, or whose rewarder dies and comes back, is retried
(waiting for the rewarder) within rollout.reward_timeout_s and the group scored; a rejected request is not retried;
a frozen rewarder misses keepalive pings, so its call is retried once it answers again, and one frozen past the
timeout ends in a RewardError naming the group and the bound. The rewarder's journal shows what it actually scored.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from scripted_services import ScriptedService

from dgrpo.learner.rollout.reward_client import RewardClient, RewardError, score_group

FAST = {"retry_backoff_s": 0.05, "max_backoff_s": 0.5, "keepalive_s": 0.5, "keepalive_timeout_s": 0.5}


@pytest.fixture
def rewarders(child_processes):
    """Start scripted rewarders for one test (`rewarders(script, port=..., journal=...)`), stopped at teardown."""
    started: list[ScriptedService] = []

    def start(script: dict, **kwargs) -> ScriptedService:
        started.append(ScriptedService("rewarder", script, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def group(prompt_id: str):
    return score_group(prompt_id, "2+2?", ["4", "5"], {"answer": "4"}, completion_ids=[[52], [53]])


def scored(service: ScriptedService) -> list[str]:
    return [p for e in service.events("scored") for p in e["prompts"]]


async def until(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED"])
def test_a_failed_call_is_retried_and_the_group_scored_once(child_processes, rewarders, code):
    rewarder = rewarders({"fail_calls": 1, "fail_code": code}).wait_ready()

    async def scenario():
        client = RewardClient(rewarder.address, timeout_s=10.0, **FAST)
        try:
            return await client.score(group("p1"))
        finally:
            await client.close()

    reward = asyncio.run(scenario())
    assert reward.rewards == [1.0, 0.0] and reward.valid == [True, True] and reward.retries == 1
    assert reward.spec.startswith("scripted@1#")
    assert len(rewarder.events("call")) == 2 and scored(rewarder) == ["p1"]


def test_a_rejected_request_is_not_retried(child_processes, rewarders):
    """INVALID_ARGUMENT: the same input cannot fare better, so the client stops at once with the rewarder's words."""
    rewarder = rewarders({"fail_calls": 1, "fail_code": "INVALID_ARGUMENT"}).wait_ready()

    async def scenario():
        client = RewardClient(rewarder.address, timeout_s=10.0, **FAST)
        try:
            with pytest.raises(RewardError, match="rejected group 'p1': INVALID_ARGUMENT: scripted failure"):
                await client.score(group("p1"))
        finally:
            await client.close()

    asyncio.run(scenario())
    assert len(rewarder.events("call")) == 1 and not scored(rewarder)


def test_a_rewarder_that_dies_mid_call_is_retried_on_its_replacement(child_processes, rewarders):
    """The rewarder process exits while handling the call (no answer, connection reset); a replacement starts on the
    same port. The client's call waits for it (wait_for_ready) and the group is scored once, by the replacement."""
    first = rewarders({"exit_on_call": 1}).wait_ready()

    async def scenario():
        client = RewardClient(first.address, timeout_s=20.0, **FAST)
        try:
            task = asyncio.create_task(client.score(group("p1")))
            await until(lambda: first.proc.poll() is not None or task.done(), "exit of the first rewarder")
            assert not task.done(), "the call ended before the rewarder came back"
            second = rewarders({}, port=first.port, journal=first.journal_path)
            await asyncio.to_thread(second.wait_ready)
            return await task, second
        finally:
            await client.close()

    reward, second = asyncio.run(scenario())
    assert first.proc.returncode == 3 and reward.rewards == [1.0, 0.0] and reward.retries >= 1
    assert [e["pid"] for e in first.events("scored")] == [second.proc.pid] and scored(first) == ["p1"]


def test_a_rewarder_frozen_past_the_timeout_fails_with_a_clear_error(child_processes, rewarders):
    """SIGSTOPped for longer than reward_timeout_s: keepalive drops the call (a retry is counted), the retry waits for
    a rewarder that never answers, and the client gives up at the timeout naming the group and the bound. Resumed,
    the same client scores again."""
    rewarder = rewarders({}).wait_ready()
    timeout_s = 2.0

    async def scenario():
        client = RewardClient(rewarder.address, timeout_s=timeout_s, **FAST)
        try:
            await client.score(group("warm"))  # connected: the freeze, not a first connect, is what is timed
            with rewarder.frozen():
                start = time.monotonic()
                with pytest.raises(RewardError, match=r"did not score group 'p1' within rollout.reward_timeout_s=2s"
                                   ) as error:
                    await client.score(group("p1"))
                took = time.monotonic() - start
                assert rewarder.is_stopped()
            assert timeout_s - 0.1 <= took < timeout_s + 2.0, f"gave up after {took:.1f}s"
            retries = int(re.search(r"\((\d+) retries\)", str(error.value)).group(1))
            assert retries >= 1, "keepalive did not drop the frozen call"
            return await client.score(group("p2"))
        finally:
            await client.close()

    reward = asyncio.run(scenario())
    assert reward.rewards == [1.0, 0.0] and "p2" in scored(rewarder)


def test_a_rewarder_frozen_briefly_is_retried_once_resumed(child_processes, rewarders, caplog):
    """Frozen for less than the timeout: keepalive fails the call in flight (logged as a retry), the retry waits,
    and once the rewarder is resumed the group is scored; the caller gets one result."""
    rewarder = rewarders({}).wait_ready()

    async def scenario():
        client = RewardClient(rewarder.address, timeout_s=20.0, **FAST)
        try:
            await client.score(group("warm"))
            with rewarder.frozen():
                task = asyncio.create_task(client.score(group("p1")))
                await until(lambda: any("retrying group 'p1'" in r.getMessage() for r in caplog.records)
                            or task.done(), "retry of the frozen call")
                assert not task.done() and rewarder.is_stopped()
            return await task
        finally:
            await client.close()

    reward = asyncio.run(scenario())
    assert reward.rewards == [1.0, 0.0] and reward.retries >= 1
    # The dropped call never reached the scorer: the resumed server finds its connection closed.
    assert scored(rewarder) == ["warm", "p1"], rewarder.events()
