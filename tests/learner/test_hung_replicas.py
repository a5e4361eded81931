"""A replica that hangs never stalls the rollout: two real sampler processes (tiny model), one of them frozen the way
a stuck host looks from outside (its whole process group SIGSTOPped: no error, no closed connection), or only its
engine frozen (gRPC answers, the engine never steps), or made a straggler (its engine held until a hedge of its
prompts has delivered). Every freeze is bounded and undone in `finally`.

What is claimed is read from the client's own RolloutStats and the groups it yields: every prompt's group exactly
once, while the frozen replica is still frozen (its process state is checked), the frozen replica marked unhealthy
and given no prompts, and back in the rollout once it answers again.

This is each behaviour's one case against a real engine (keepalive, the progress check, the straggler watch with its
hedge). Their timing logic in every variant (idle hedging, slow and stalled engines, dropped streams, equal replicas
never hedged) is tested in seconds against scripted replicas (test_rollout_timing.py), and a partition that drops
packets without an error between two hosts in test_hung_hosts.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from support import ServiceProcess, free_port

from dgrpo.cli.launch.procs import group_pids
from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.client import RolloutClient, RolloutStats, make_prompt
from dgrpo.v1 import sampler_pb2

pytestmark = pytest.mark.slow

PROMPT = list(range(100, 120))
# Tokens per completion of a batch during which b is frozen or cut off: enough that b still holds its prompts when
# the fault lands, however busy the machine (b's share of a 96-token batch could finish before a loaded test froze it).
LONG = 400
# Quick detection for the test: a frozen peer is dropped after 5 + 5 s of unanswered pings (2 + 2 s also dropped the
# healthy replica, busy with both shares, on a machine loaded by other work).
FAST = {"keepalive_s": 5.0, "keepalive_timeout_s": 5.0, "retry_backoff_s": 0.2, "max_backoff_s": 1.0,
        "probe_timeout_s": 2.0, "step_timeout_s": 300.0}


@pytest.fixture(scope="module")
def samplers(child_processes, tiny_model):
    started = [
        ServiceProcess("sampler", [f"model.path={tiny_model}", "model.dtype=float32", f"sampler.port={port}",
                                   "sampler.host=127.0.0.1", "sampler.enforce_eager=true", "sampler.max_model_len=512",
                                   f"sampler.replica_id=r{i}", "sampler.shutdown_grace_s=1", "weights.enabled=false"],
                       port)
        for i, port in enumerate([free_port(), free_port()])
    ]
    try:
        for svc in started:
            svc.wait_ready(timeout=400)
        yield started
    finally:
        for svc in started:
            os.killpg(svc.proc.pid, signal.SIGCONT)
            svc.stop(timeout=30)


def state(pid: int) -> str:
    """The process's state letter as /proc shows it (R, S, D, T, Z, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stopped(pid: int) -> bool:
    """The process runs none of its code: stopped (T), or a zombie (Z: a short-lived child that exited while its
    stopped parent could not reap it), or in uninterruptible sleep (D, e.g. a page fault on a loaded machine) with
    SIGSTOP pending, which stops it the moment it returns."""
    letter = state(pid)
    if letter in ("T", "t", "Z"):
        return True
    status = Path(f"/proc/{pid}/status").read_text()
    pending = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return letter == "D" and any(mask & (1 << (signal.SIGSTOP - 1)) for mask in pending)


def assert_all_stopped(pids: list[int]) -> None:
    assert all(stopped(pid) for pid in pids), f"not stopped: {[(pid, state(pid)) for pid in pids]}"


@contextmanager
def frozen(pids: list[int]):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def collect(client: RolloutClient, tag: str, n_prompts: int, max_tokens: int,
                  stats: RolloutStats | None = None) -> tuple[list, RolloutStats]:
    stats = stats if stats is not None else RolloutStats()
    prompts = [make_prompt(f"{tag}-{i}", PROMPT) for i in range(n_prompts)]
    params = sampler_pb2.SamplingParams(n=2, max_tokens=max_tokens, temperature=1.0)
    groups = [g async for g in client.generate(prompts, params, stats=stats)]
    return groups, stats


def assert_each_once(groups, tag: str, n: int) -> None:
    assert sorted(g.prompt_id for g in groups) == sorted(f"{tag}-{i}" for i in range(n))


async def wait_answering(client: RolloutClient, address: str) -> None:
    """Until the replica answers Info again (bounded): "once it answers" is when it must be used again."""
    deadline = time.monotonic() + 60
    while True:
        try:
            await client.info(address, 2.0, wait_for_ready=True)
            return
        except grpc.aio.AioRpcError:
            assert time.monotonic() < deadline, f"{address} never answered again"


async def connect(client: RolloutClient, *addresses: str) -> None:
    """Connected before the scenario starts: a connect that times out on a loaded machine (gRPC: "timed out before
    receiving SETTINGS frame") is not the case under test, and would read as a hung replica."""
    for address in addresses:
        await client.info(address, 60.0, wait_for_ready=True)


async def wait_running(client: RolloutClient, address: str, task: asyncio.Task, stats: RolloutStats) -> bool:
    """Until the replica's engine holds requests (bounded; an Info slower than 10 s on a loaded machine is asked
    again, not a failure: this only waits for the fault's moment). False when the rollout went on without it first:
    the batch finished, or the replica was marked unhealthy before any fault (e.g. its first call timed out on a
    loaded machine, so the other replica took every prompt): the fault would then prove nothing."""
    deadline = time.monotonic() + 120
    while not task.done() and address not in stats.unhealthy_replicas:
        try:
            if (await client.info(address, 10.0, wait_for_ready=True)).running_requests > 0:
                return True
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise
        assert time.monotonic() < deadline, f"{address} never received its prompts: {stats}"
        await asyncio.sleep(0.02)
    return False


async def start_while_running(client: RolloutClient, address: str, tag: str) -> tuple[asyncio.Task, RolloutStats, str]:
    """A LONG batch started and `address` holding part of it, the moment a fault can land. A batch the rollout
    finished without that replica (see wait_running) is cancelled and started again under a new tag, three times at
    most; returns the running task, its stats and its tag."""
    for attempt in range(3):
        stats, attempt_tag = RolloutStats(), f"{tag}{attempt}"
        task = asyncio.create_task(collect(client, attempt_tag, 8, LONG, stats))
        if await wait_running(client, address, task, stats):
            return task, stats, attempt_tag
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a failure of the rollout itself, not a batch that went on without the replica
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    pytest.fail(f"{address} was never given prompts in 3 batches (last: {stats})")


def test_a_frozen_replica_gives_its_prompts_to_the_other_and_comes_back(samplers):
    a, b = samplers
    cfg = RolloutConfig(**FAST, progress_timeout_s=30.0, hedge_after_s=None)

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            # 1. b's whole process group frozen while it holds half of the step's prompts.
            pids = group_pids(b.proc.pid)
            await connect(client, a.address, b.address)
            task, stats, tag = await start_while_running(client, b.address, "one")
            with frozen(pids):
                groups, stats = await task
                assert stopped(b.proc.pid), "b was resumed before the rollout finished: it proved nothing"
                assert_each_once(groups, tag, 8)
                assert stats.unhealthy_replicas == {b.address} and stats.failed_calls + stats.stuck_calls >= 1
                assert stats.retried_prompts >= 1 and stats.lost_wait_s > 0
                assert stats.groups_by_replica["r1"] < 4 < stats.groups_by_replica["r0"]  # a took over b's share
                # 2. The next step while b is still frozen: b gets nothing, nothing fails.
                groups, stats = await collect(client, "two", 8, 16)
                assert_each_once(groups, "two", 8)
                assert stats.groups_by_replica == {"r0": 8} and stats.failed_calls == 0
                assert stats.unhealthy_replicas == {b.address}
            # 3. b answers again: the next step uses it.
            await wait_answering(client, b.address)
            groups, stats = await collect(client, "three", 8, 16)
            assert_each_once(groups, "three", 8)
            assert set(stats.groups_by_replica) == {"r0", "r1"} and not stats.unhealthy_replicas
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_engine_that_stops_stepping_is_found_by_the_progress_check(samplers):
    """Only b's engine core and workers frozen: its gRPC server answers pings and Info, so no keepalive fires;
    Info's engine_steps standing still while b holds prompts does."""
    a, b = samplers
    # Keepalive as by default (10 s, 5 s): this is the progress check's case, which must fire before any keepalive.
    cfg = RolloutConfig(**{**FAST, "keepalive_s": 10.0, "keepalive_timeout_s": 5.0}, progress_timeout_s=6.0,
                        hedge_after_s=None)
    engine = [pid for pid in group_pids(b.proc.pid) if pid != b.proc.pid]
    assert engine, "the sampler has no engine processes of its own"

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            await connect(client, a.address, b.address)
            task, stats, tag = await start_while_running(client, b.address, "eng")
            with frozen(engine):
                groups, stats = await task
                assert_all_stopped(engine)
                assert (await client.info(b.address, 5.0)).replica_id == "r1"  # b's server itself answers
            assert_each_once(groups, tag, 8)
            assert stats.stuck_calls >= 1 and stats.unhealthy_replicas == {b.address}
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_straggler_is_hedged_on_the_busy_replica_from_its_engine_step_rate(samplers):
    """The straggler watch: b's engine does not step (held until a has delivered one of b's prompts, bounded) while
    a is still busy with its own chunk. Idle hedging would wait a minute; the watch sees b stepping slower than half
    of a over a window of two checks (and 7 of a's steps) and duplicates b's prompts on a at once, so the batch ends
    long before that."""
    a, b = samplers
    cfg = RolloutConfig(**{**FAST, "keepalive_s": 10.0, "keepalive_timeout_s": 5.0}, progress_timeout_s=120.0,
                        hedge_after_s=60.0, hedge_after_share=0.0, straggler_speed=0.5, straggler_check_s=0.5)
    engine = [pid for pid in group_pids(b.proc.pid) if pid != b.proc.pid]
    assert engine, "the sampler has no engine processes of its own"
    stats = RolloutStats()

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            await connect(client, a.address, b.address)
            start = time.monotonic()
            with frozen(engine):
                task = asyncio.create_task(collect(client, "watch", 8, 64, stats))
                while not (stats.hedged_prompts and stats.groups_by_replica["r0"] > 4) and not task.done():
                    assert time.monotonic() - start < 50, f"no hedge delivered in 50 s: {stats}"
                    await asyncio.sleep(0.05)
            groups, _ = await task
            took = time.monotonic() - start
        finally:
            await client.close()
        assert_each_once(groups, "watch", 8)
        assert stats.hedged_prompts == 4, stats  # all of b's chunk, in one hedge
        assert stats.groups_by_replica["r0"] > 4, stats.groups_by_replica
        assert took < cfg.hedge_after_s, f"{took:.0f} s: the hedge waited for a to go idle"
        assert not stats.unhealthy_replicas, "a slow replica was taken for a hung one"

    asyncio.run(scenario())
