"""The rollout's timing logic against scripted replicas (tests/scripted_services.py): real grpc.aio Sampler servers
in processes of their own whose speed and faults are a script, driven by the real RolloutClient with its timeouts
set short. What test_hung_replicas.py checks through real engines under minutes of wall-clock slack is checked here
in seconds, each behaviour in isolation: hedging an idle-detected straggler, the straggler watch from engine step
rates (a slow engine, a stalled one), keepalive finding a frozen process, the progress check finding an engine that
stopped stepping, retries after a dropped stream or a killed replica, and no hedge at all between equal replicas
(also when their engine steps take longer than a check, as on a loaded host).

Every claim is read from what the client yields (each prompt's group exactly once, valid), its RolloutStats, and the
replicas' journals (what each one was asked to generate, and when a call was cancelled).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from scripted_services import ScriptedService, start_all

from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.client import RolloutClient, RolloutStats, make_prompt, sampling_params
from dgrpo.v1 import sampler_pb2

PROMPT = list(range(100, 116))
# Short bounds for every test; each test sets what it is about. Keepalive at 1 s + 1 s: a frozen replica is found in
# about 2 s, while a healthy one (a cheap process) answers pings well within 1 s even on a loaded machine.
BASE = {"n": 2, "keepalive_s": 1.0, "keepalive_timeout_s": 1.0, "probe_timeout_s": 1.0, "retry_backoff_s": 0.1,
        "max_backoff_s": 0.5, "progress_timeout_s": 30.0, "step_timeout_s": 25.0}


def config(**overrides) -> RolloutConfig:
    return RolloutConfig(**{**BASE, **overrides})


@pytest.fixture
def replicas(child_processes):
    """Start scripted replicas for one test (`replicas(script, ...)`); stopped (resumed first) at teardown."""
    started: list[ScriptedService] = []

    def start(*scripts: dict) -> list[ScriptedService]:
        services = start_all("sampler", list(scripts))
        started.extend(services)
        return services

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def equal_pair(child_processes):
    """Two healthy replicas of equal speed, shared by the tests that do not harm them."""
    services = start_all("sampler", [{"replica_id": "r0", "rate": 100}, {"replica_id": "r1", "rate": 100}])
    yield services
    for s in services:
        s.stop()


async def rollout(client: RolloutClient, cfg: RolloutConfig, tag: str, stats: RolloutStats,
                  prompts: int = 8) -> list[sampler_pb2.Group]:
    batch = [make_prompt(f"{tag}-{i}", PROMPT) for i in range(prompts)]
    return [g async for g in client.generate(batch, sampling_params(cfg), stats=stats)]


def timed_rollout(services: list[ScriptedService], cfg: RolloutConfig, tag: str,
                  stats: RolloutStats) -> tuple[list[sampler_pb2.Group], float]:
    """One batch through a fresh client over `services`; its groups and the seconds it took."""

    async def scenario():
        client = RolloutClient([s.address for s in services], cfg)
        try:
            start = time.monotonic()
            groups = await rollout(client, cfg, tag, stats)
            return groups, time.monotonic() - start
        finally:
            await client.close()

    return asyncio.run(scenario())


def check_groups(groups: list[sampler_pb2.Group], tag: str, cfg: RolloutConfig, prompts: int = 8) -> None:
    """Each prompt's group exactly once, and each a group as the real sampler streams it."""
    assert sorted(g.prompt_id for g in groups) == sorted(f"{tag}-{i}" for i in range(prompts))
    for g in groups:
        assert g.replica_id and list(g.prompt_token_ids) == PROMPT and len(g.completions) == cfg.n
        for c in g.completions:
            assert 0 < len(c.token_ids) == len(c.logprobs) <= cfg.max_response_length
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in (sampler_pb2.FINISH_REASON_STOP, sampler_pb2.FINISH_REASON_LENGTH)


def by_replica(groups: list[sampler_pb2.Group]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for g in groups:
        out.setdefault(g.replica_id, set()).add(g.prompt_id)
    return out


async def until(predicate, what: str, timeout: float = 15.0) -> None:
    """Poll for an event, bounded."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g}s"
        await asyncio.sleep(0.01)


def test_a_straggler_is_hedged_on_the_idle_fast_replica(child_processes, replicas):
    """r1 generates 25x slower than r0: once r0 has finished its chunk and waited hedge_after_s, it duplicates r1's
    pending prompts and wins; r1's call is then cancelled, so the step takes r0's time, not r1's (3 s)."""
    fast, slow = replicas({"replica_id": "r0", "rate": 200}, {"replica_id": "r1", "rate": 8})
    cfg = config(max_response_length=24, hedge_after_s=0.3, straggler_speed=None)  # idle hedging alone
    stats = RolloutStats()
    groups, took = timed_rollout([fast, slow], cfg, "idle", stats)
    check_groups(groups, "idle", cfg)
    assert stats.hedged_prompts >= 1 and stats.groups_by_replica["r0"] > 4, stats
    assert took < 24 / 8, f"{took:.1f}s: the step waited for the straggler"
    assert not stats.unhealthy_replicas and stats.failed_calls == 0, "a slow replica was taken for a broken one"
    # The straggler's copies of the hedged prompts were not left running: its call was cancelled.
    slow.wait_event("cancelled")


@pytest.mark.parametrize("slow_script", [{"rate": 5}, {"rate": 50, "stall_after_steps": 2}], ids=["slow", "stalled"])
def test_the_straggler_watch_hedges_on_the_busy_replica(child_processes, replicas, slow_script):
    """While r0 is still busy with its own chunk, r1's engine steps at a tenth of r0's (slow), or not at all while its
    gRPC server answers Info (stalled): the watch reads both engine_steps every check, finds r1 slower than half of
    r0 over a window of two checks and hedges all of r1's prompts on r0 at once, long before idle hedging (20 s)
    would."""
    fast, slow = replicas({"replica_id": "r0", "rate": 50}, {"replica_id": "r1", **slow_script})
    cfg = config(max_response_length=80, hedge_after_s=20.0, straggler_speed=0.5, straggler_check_s=0.2)
    stats = RolloutStats()
    groups, took = timed_rollout([fast, slow], cfg, "watch", stats)
    check_groups(groups, "watch", cfg)
    assert took < cfg.hedge_after_s, f"{took:.1f}s: the hedge waited for r0 to go idle"
    assert stats.hedged_prompts == 4 and by_replica(groups) == {"r0": {f"watch-{i}" for i in range(8)}}, stats
    assert not stats.unhealthy_replicas and stats.stuck_calls == 0, "a slow replica was taken for a hung one"
    # r0 got the hedge while still generating its own chunk (the watch does not wait for it to be idle).
    starts, own_last = fast.events("start"), max(e["t"] for e in fast.events("group") if e["call"] == 1)
    assert len(starts) == 2 and starts[1]["t"] < own_last, fast.events()
    slow.wait_event("cancelled")


def test_a_frozen_replica_is_found_by_keepalive_and_used_again_once_resumed(child_processes, replicas):
    """r1's whole process SIGSTOPped while it holds half of the step: no error, no closed connection. Keepalive
    (1 s + 1 s) closes its channel, its prompts go to r0; the next step, still frozen, gives it nothing; resumed, it
    gets its share again."""
    a, b = replicas({"replica_id": "r0", "rate": 50}, {"replica_id": "r1", "rate": 50})
    cfg = config(max_response_length=50, hedge_after_s=None)  # neither hedging nor the progress check (30 s) acts

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            stats = RolloutStats()
            task = asyncio.create_task(rollout(client, cfg, "one", stats))
            await until(lambda: b.events("start") or task.done(), "call on r1")
            with b.frozen():
                groups = await task
                assert b.is_stopped(), "r1 was resumed before the step ended: it proved nothing"
                check_groups(groups, "one", cfg)
                assert stats.unhealthy_replicas == {b.address} and stats.failed_calls >= 1, stats
                assert stats.stuck_calls == 0 and "UNAVAILABLE" in client.health.away[b.address].why
                assert stats.retried_prompts >= 1 and stats.groups_by_replica["r0"] > 4, stats
                # The next step while r1 is still frozen: it gets nothing, nothing fails.
                stats = RolloutStats()
                groups = await rollout(client, cfg, "two", stats)
                check_groups(groups, "two", cfg)
                assert stats.groups_by_replica == {"r0": 8} and stats.failed_calls == 0, stats
                assert stats.unhealthy_replicas == {b.address}
            await client.info(b.address, 10.0, wait_for_ready=True)  # answers again
            stats = RolloutStats()
            groups = await rollout(client, cfg, "three", stats)
            check_groups(groups, "three", cfg)
            assert stats.groups_by_replica == {"r0": 4, "r1": 4} and not stats.unhealthy_replicas, stats
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_engine_that_stops_stepping_is_found_by_the_progress_check(child_processes, replicas):
    """r1's engine stops after 3 steps while its gRPC server answers pings and Info, so keepalive never fires: with
    hedging off, the progress check (Info's engine_steps unchanged at two checks, progress_timeout_s / 2 apart)
    declares the call stuck and r0 takes r1's prompts."""
    a, b = replicas({"replica_id": "r0", "rate": 100}, {"replica_id": "r1", "rate": 100, "stall_after_steps": 3})
    cfg = config(max_response_length=30, hedge_after_s=None, progress_timeout_s=1.0)
    stats = RolloutStats()

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            groups = await rollout(client, cfg, "stall", stats)
            info = await client.info(b.address, 5.0)
            return groups, info
        finally:
            await client.close()

    groups, info = asyncio.run(scenario())
    check_groups(groups, "stall", cfg)
    assert stats.stuck_calls >= 1 and stats.unhealthy_replicas == {b.address}, stats
    assert stats.groups_by_replica == {"r0": 8} and stats.retried_prompts == 4, stats
    assert info.engine_steps == 3 and info.replica_id == "r1"  # its server still answers; its engine stands still
    b.wait_event("cancelled")  # the stuck call was cancelled on the replica


@pytest.mark.parametrize("fault", ["abort", "kill"])
def test_a_dropped_stream_is_retried_on_the_other_replica(child_processes, replicas, fault):
    """r1's stream ends mid-way after delivering a group: it aborts with UNAVAILABLE (abort), or its process is
    SIGKILLed (kill). The prompts it had not delivered go back on the queue and r0 (idle by then) samples them: every
    group arrives exactly once, none lost, none twice."""
    script = {"replica_id": "r1", "rate": 20, **({"abort_after_groups": 1} if fault == "abort" else {})}
    a, b = replicas({"replica_id": "r0", "rate": 200}, script)
    cfg = config(max_response_length=40, hedge_after_s=None)
    stats = RolloutStats()

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            task = asyncio.create_task(rollout(client, cfg, "drop", stats))
            if fault == "kill":
                await until(lambda: stats.groups_by_replica["r1"] >= 1 or task.done(), "group from r1")
                b.kill()
            return await task
        finally:
            await client.close()

    groups = asyncio.run(scenario())
    check_groups(groups, "drop", cfg)
    delivered = by_replica(groups)
    r1_chunk = set(b.events("start")[0]["prompts"])
    assert delivered["r1"] and delivered["r1"] < r1_chunk, delivered  # r1 delivered part of its chunk
    retried = r1_chunk - delivered["r1"]
    assert retried <= delivered["r0"] and stats.retried_prompts == len(retried), stats
    assert stats.failed_calls == 1 and stats.duplicates_dropped == 0 and b.address in stats.unhealthy_replicas, stats
    assert {p for e in a.events("start") for p in e["prompts"]} >= retried  # r0 generated them again
    if fault == "abort":
        assert b.events("drop") and b.proc.poll() is None


def never_hedged(a, b, cfg, tag: str) -> None:
    """Three batches on replicas `a` and `b` of equal speed: each takes its chunk (4 groups each) and no prompt is ever
    generated twice (no needless duplicate work, nothing dropped as a duplicate, no suspect left)."""
    totals = RolloutStats()

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            for step in range(3):
                stats = RolloutStats()
                groups = await rollout(client, cfg, f"{tag}{step}", stats)
                check_groups(groups, f"{tag}{step}", cfg)
                assert stats.calls == 2 and stats.groups_by_replica == {"r0": 4, "r1": 4}, stats
                totals.merge(stats)
            return client._straggler_suspects
        finally:
            await client.close()

    suspects = asyncio.run(scenario())
    assert totals.hedged_prompts == 0 and totals.duplicates_dropped == 0 and not totals.unhealthy_replicas, totals
    assert not suspects
    generated = Counter(p for s in (a, b) for e in s.events("start") for p in e["prompts"] if p.startswith(tag))
    assert set(generated.values()) == {1} and len(generated) == 24, generated


def test_equal_replicas_are_never_hedged(child_processes, equal_pair):
    """Healthy replicas of equal speed, the default hedging and straggler watch on: step after step, each takes its
    chunk."""
    cfg = config(max_response_length=50)  # hedge_after_s 2, hedge_after_share 0.25, straggler_speed 0.5 by default
    assert cfg.hedge_after_s and cfg.straggler_speed
    never_hedged(*equal_pair, cfg, "eq")


def test_equal_replicas_whose_engine_steps_outlast_a_check_are_never_hedged(child_processes, replicas):
    """Issue 47, item 3: on a loaded host an engine step (here 0.6 s +- 40%) is longer than a straggler check
    (0.25 s), so over one check a busy engine often reads 0 steps; the demo's two replicas then hedged each other's
    prompts at every step (8 of 8). Judged over windows of 7 engine steps of the fastest, two equal replicas are never
    stragglers, nor is the idle hedge taken from a replica keeping pace."""
    a, b = replicas({"replica_id": "r0", "rate": 1 / 0.6, "jitter": 0.4},
                    {"replica_id": "r1", "rate": 1 / 0.6, "jitter": 0.4})
    cfg = config(max_response_length=12, step_timeout_s=60.0)  # the defaults: 0.25 s checks, straggler_speed 0.5
    assert cfg.straggler_check_s == 0.25 and cfg.straggler_speed == 0.5 and cfg.hedge_after_s == 2.0
    never_hedged(a, b, cfg, "slow")


def test_a_replica_at_a_third_of_the_speed_is_still_hedged_when_steps_outlast_a_check(child_processes, replicas):
    """Both engines step slower than a check (0.33 s and 1 s per step, +- 30%): r1, at a third of r0's speed, is found
    once a window holds 7 of r0's steps and its prompts are hedged on r0 while r0 still generates its own chunk, so the
    batch ends near r0's time (its own 12 steps, then the hedged prompts' 12 from about 2.5 s on), far before r1's
    12 s; idle hedging (30 s) plays no part."""
    fast, slow = replicas({"replica_id": "r0", "rate": 3.0, "jitter": 0.3},
                          {"replica_id": "r1", "rate": 1.0, "jitter": 0.3})
    cfg = config(max_response_length=12, hedge_after_s=30.0)
    stats = RolloutStats()
    groups, took = timed_rollout([fast, slow], cfg, "third", stats)
    check_groups(groups, "third", cfg)
    # r1's first prompt (3 of its slow steps) can still come in as the hedge starts: at most that one is r1's.
    assert stats.hedged_prompts >= 3 and stats.groups_by_replica["r0"] >= 7, stats
    assert took < 0.75 * 12 / 1.0, f"{took:.1f}s: the step waited for the straggler"
    starts, own_last = fast.events("start"), max(e["t"] for e in fast.events("group") if e["call"] == 1)
    assert len(starts) == 2 and starts[1]["t"] < own_last, fast.events()
    slow.wait_event("cancelled")
