"""A replica that hangs never stalls the rollout: two real sampler processes (tiny model), one of them frozen the way
a stuck host looks from outside (its whole process group SIGSTOPped: no error, no closed connection), or only its
engine frozen (gRPC answers, the engine never steps), or made a straggler (stopped most of the time). Every freeze
is bounded and undone in `finally`.

What is claimed is read from the client's own RolloutStats and the groups it yields: every prompt's group exactly
once, while the frozen replica is still frozen (its process state is checked), the frozen replica marked unhealthy
and given no prompts, and back in the rollout once it answers again. A partition (a replica's loopback port
dropped with iptables: no reset, no error) is found the same way.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from support import ServiceProcess, free_port

from dgrpo.learner.rollout import RolloutClient, RolloutConfig, RolloutStats, make_prompt
from dgrpo.v1 import sampler_pb2

pytestmark = pytest.mark.slow

PROMPT = list(range(100, 120))
# Quick detection for the test: a frozen peer is dropped after 2 + 2 s of unanswered pings.
FAST = {"keepalive_s": 2.0, "keepalive_timeout_s": 2.0, "retry_backoff_s": 0.2, "max_backoff_s": 1.0,
        "probe_timeout_s": 2.0, "step_timeout_s": 300.0}


@pytest.fixture(scope="module")
def samplers(tiny_model):
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


def group_pids(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except ProcessLookupError:
                pass
    return out


def stopped(pid: int) -> bool:
    """The process is in state T (stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@contextmanager
def frozen(pids: list[int]):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def collect(client: RolloutClient, tag: str, n_prompts: int, max_tokens: int) -> tuple[list, RolloutStats]:
    stats = RolloutStats()
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


async def wait_running(client: RolloutClient, address: str) -> None:
    """Until the replica's engine holds requests (bounded)."""
    deadline = time.monotonic() + 60
    while (await client.info(address, 5.0)).running_requests == 0:
        assert time.monotonic() < deadline, f"{address} never received its prompts"
        await asyncio.sleep(0.02)


def test_a_frozen_replica_gives_its_prompts_to_the_other_and_comes_back(samplers):
    a, b = samplers
    cfg = RolloutConfig(**FAST, progress_timeout_s=30.0, hedge_after_s=None)

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            # 1. b's whole process group frozen while it holds half of the step's prompts.
            task = asyncio.create_task(collect(client, "one", 8, 96))
            await wait_running(client, b.address)
            with frozen(group_pids(b.proc.pid)):
                groups, stats = await task
                assert stopped(b.proc.pid), "b was resumed before the rollout finished: it proved nothing"
                assert_each_once(groups, "one", 8)
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


@contextmanager
def partitioned(port: int):
    """Every packet to and from a loopback port dropped (no reset, no error: a host cut off), undone on exit."""
    rules = [["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
             ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]
    for rule in rules:
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        yield
    finally:
        for rule in rules:
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)


def test_a_partitioned_replica_is_found_by_keepalive_and_used_again_once_reachable(samplers):
    """b's port silently dropped on loopback while it holds prompts; the link restored, b serves again."""
    if os.geteuid() != 0 or shutil.which("iptables") is None or subprocess.run(
            ["iptables", "-L", "INPUT", "-n"], capture_output=True, check=False).returncode:
        pytest.skip("needs root and a working iptables to drop a port's packets")
    a, b = samplers
    cfg = RolloutConfig(**FAST, progress_timeout_s=120.0, hedge_after_s=None)

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            task = asyncio.create_task(collect(client, "cut", 8, 96))
            await wait_running(client, b.address)
            with partitioned(b.port):
                groups, stats = await task
                assert_each_once(groups, "cut", 8)
                assert stats.unhealthy_replicas == {b.address} and stats.failed_calls >= 1 and stats.stuck_calls == 0
            await wait_answering(client, b.address)
            groups, stats = await collect(client, "healed", 8, 16)
            assert_each_once(groups, "healed", 8)
            assert set(stats.groups_by_replica) == {"r0", "r1"}
        finally:
            await client.close()

    asyncio.run(scenario())


def test_an_engine_that_stops_stepping_is_found_by_the_progress_check(samplers):
    """Only b's engine core and workers frozen: its gRPC server answers pings and Info, so no keepalive fires;
    Info's engine_steps standing still while b holds prompts does."""
    a, b = samplers
    cfg = RolloutConfig(**FAST, progress_timeout_s=6.0, hedge_after_s=None)
    engine = [pid for pid in group_pids(b.proc.pid) if pid != b.proc.pid]
    assert engine, "the sampler has no engine processes of its own"

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        try:
            task = asyncio.create_task(collect(client, "eng", 8, 96))
            await wait_running(client, b.address)
            with frozen(engine):
                groups, stats = await task
                assert all(stopped(pid) for pid in engine)
                assert (await client.info(b.address, 5.0)).replica_id == "r1"  # b's server itself answers
            assert_each_once(groups, "eng", 8)
            assert stats.stuck_calls >= 1 and stats.unhealthy_replicas == {b.address}
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_straggler_is_hedged_on_the_idle_replica(samplers):
    """b runs a tenth of the time (stopped 0.45 s, running 0.05 s, bounded by the call): it still answers every
    ping, so it is slow, not hung. After 1 s of having nothing to do, a takes b's prompts too; first group wins."""
    a, b = samplers
    cfg = RolloutConfig(**{**FAST, "keepalive_s": 10.0, "keepalive_timeout_s": 5.0}, progress_timeout_s=120.0,
                        hedge_after_s=1.0)
    done = threading.Event()

    def throttle(pids: list[int]) -> None:
        deadline = time.monotonic() + 120
        try:
            while not done.is_set() and time.monotonic() < deadline:
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                done.wait(0.45)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                done.wait(0.05)
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)

    async def scenario():
        client = RolloutClient([a.address, b.address], cfg)
        throttler = threading.Thread(target=throttle, args=(group_pids(b.proc.pid),), daemon=True)
        try:
            throttler.start()
            groups, stats = await collect(client, "hedge", 8, 64)
        finally:
            done.set()
            throttler.join(10)
            await client.close()
        assert_each_once(groups, "hedge", 8)
        assert stats.hedged_prompts >= 1, stats
        assert stats.groups_by_replica["r0"] > 4, stats.groups_by_replica  # a delivered some of b's share
        assert not stats.unhealthy_replicas, "a slow replica was taken for a hung one"

    asyncio.run(scenario())
