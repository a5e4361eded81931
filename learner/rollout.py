"""Rollout: the learner's gRPC client of the sampler replicas.

A step's prompts are split into chunks, one per replica by default, and a worker per replica pulls chunks from a
shared queue, so a fast replica takes more work. Groups stream back one per prompt as soon as they are complete and
are handed to the caller at once (scoring overlaps generation). When a call fails — a replica killed, restarting,
or not reaching `min_weight_version` in time — the prompts of that call that have not arrived yet go back on the
queue and another replica (or the same one, after an exponential backoff) samples them. A prompt is considered
done when its group arrives, and a group is accepted only for a prompt still pending, so no group is ever lost
or duplicated.

Replicas: `sampler.addresses` holds host:port entries, or `dns:///name:port` entries that resolve to every replica
(`docker compose --scale sampler=3` gives one A record per container). Names are re-resolved every step, so
replicas that are added or come back are used from the next step on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from pydantic import Field

from dgrpo.common import auth
from dgrpo.common.config import StrictConfig
from dgrpo.common.grpc_server import CHANNEL_OPTIONS, keepalive_options
from dgrpo.common.retry import Backoff
from dgrpo.learner.replica_health import Progress, ReplicaHealth
from dgrpo.tools.config import MultiTurnConfig
from dgrpo.v1 import sampler_pb2, sampler_pb2_grpc

log = logging.getLogger(__name__)

# Reconnect quickly to a replica that comes back (gRPC's default backoff grows to 2 minutes).
CLIENT_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]
# Errors that say the request itself is wrong: retrying on another replica cannot help.
FATAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}


class RolloutConfig(StrictConfig):
    """Sampling: group size, sampling parameters, and how the learner talks to the replicas and the rewarder."""

    n: int = Field(default=4, ge=2)
    """Group size: completions sampled per prompt. GRPO's advantage compares them, so at least 2."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (> 0: GRPO needs diverse groups; validation is always greedy)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass (1: off)."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens (0: off)."""
    min_p: float = Field(default=0.0, ge=0, le=1)
    """Drop tokens below min_p times the top probability (0: off)."""
    max_response_length: int = Field(default=256, ge=1)
    """New tokens per completion."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (the model's EOS always stops)."""
    seed: int | None = None
    """Base seed of the sampler requests (the step number is added, so steps differ). Unset: unseeded."""
    prompts_per_request: int | None = Field(default=None, ge=1)
    """Prompts per Generate call. Unset: the step's batch split evenly over the replicas (one call each, so every
    engine batches its whole share)."""
    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Bound on one Generate call; a call past it is retried elsewhere."""
    weight_wait_timeout_s: float = Field(default=0.0, ge=0)
    """How long a replica may wait to load `min_weight_version` before the call is retried elsewhere
    (0: the replica's `sampler.weight_wait_timeout_s`)."""
    retry_backoff_s: float = Field(default=0.5, gt=0)
    """First wait before a replica that failed is probed again; doubles per failure up to `max_backoff_s`."""
    max_backoff_s: float = Field(default=10.0, gt=0)
    """Longest wait between probes of one replica."""
    keepalive_s: float = Field(default=10.0, gt=0)
    """HTTP/2 keepalive ping interval on the sampler and rewarder channels. A peer that does not answer a ping
    within `keepalive_timeout_s` (a frozen process, a host whose packets are dropped) has its connection closed and
    its calls fail, instead of hanging until `request_timeout_s`."""
    keepalive_timeout_s: float = Field(default=5.0, gt=0)
    """How long a keepalive ping may go unanswered."""
    progress_timeout_s: float = Field(default=60.0, gt=0)
    """A replica that holds prompts and has neither delivered a group nor advanced its engine (Info's
    engine_steps, checked every half of this) for this long, or has not answered two such checks, is declared
    stuck: its call is cancelled and its prompts go to the other replicas. Replicas generating long completions
    keep stepping, so they are not."""
    probe_timeout_s: float = Field(default=5.0, gt=0)
    """Bound on one Info probe: of a quiet call's replica, and of an unhealthy replica before it gets prompts
    again (it must answer with the weight version asked for)."""
    hedge_after_s: float | None = Field(default=10.0, gt=0)
    """Hedged requests ("The Tail at Scale", Dean & Barroso 2013): a replica left with nothing to do for this long
    while another still holds prompts of the step duplicates those prompts; the first complete group wins, the
    late one is dropped (rollout/duplicates_dropped) and a call whose prompts are all done elsewhere is cancelled.
    A straggler then no longer sets every step's pace. null: never hedge."""
    max_staleness: int = Field(default=0, ge=0, le=16)
    """Asynchronous GRPO (learner/pipeline.py): how many versions behind the policy being updated a sample may
    be. 0: lockstep, on-policy (sample, then train, then publish). k >= 1: batches t+1 ... t+k are sampled and
    scored while batch t trains, so the samplers never wait for the update; a group sampled by weights older than
    (current version - k) is never trained on. Pair it with weights.pause_mode=keep (updates land between engine
    steps without draining the requests in flight) and the algorithm.off_policy correction (docs/learner.md)."""
    step_timeout_s: float = Field(default=3600.0, gt=0)
    """Give up (and stop training with an error) when a step's groups are not all in after this long."""
    rewarder_address: str = "localhost:50052"
    """The reward service: host:port (or any gRPC target, e.g. dns:///rewarder:50052)."""
    reward_timeout_s: float = Field(default=600.0, gt=0)
    """Bound on scoring one group, waits for a restarting rewarder included."""
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tool calls (verl's rollout.multi_turn; docs/multi_turn.md). The samplers read this
    same section of their stack config to load the tools; the learner sends the limits and the tool set's digest."""


def multi_turn_request(cfg: MultiTurnConfig) -> sampler_pb2.MultiTurn | None:
    """The GenerateRequest.multi_turn for this config (None when off). The digest is computed from the tool config
    the learner reads: a replica whose tools differ answers FAILED_PRECONDITION instead of sampling with them."""
    if not cfg.enable:
        return None
    from dgrpo.tools.spec import load_tool_config

    return sampler_pb2.MultiTurn(
        enable=True, max_assistant_turns=cfg.max_assistant_turns, max_tool_calls=cfg.max_tool_calls,
        max_response_length=cfg.max_response_length or 0, max_tool_response_length=cfg.max_tool_response_length,
        tool_config_digest=load_tool_config(cfg.tool_config_path).digest,
    )


class RolloutError(RuntimeError):
    """Sampling cannot complete: a request the replicas reject, or no replica answered in time."""


class _StreamEnded(Exception):
    """A Generate stream ended cleanly but without every group it owed (retryable)."""


@dataclass
class RolloutStats:
    """What one `generate` call went through (logged under rollout/ in the metrics)."""

    calls: int = 0
    failed_calls: int = 0
    retried_prompts: int = 0
    duplicates_dropped: int = 0
    replicas: int = 0
    groups_by_replica: Counter = field(default_factory=Counter)
    hedged_prompts: int = 0
    """Prompts duplicated on an idle replica while a straggler held them."""
    stuck_calls: int = 0
    """Calls given up because their replica stopped making progress (no group, no engine step, no Info answer)."""
    unhealthy_replicas: set[str] = field(default_factory=set)
    """Replicas that were given no prompts for a while during this call (failed, stuck, or still away)."""
    lost_wait_s: float = 0.0
    """Seconds calls waited on replicas that then failed or were declared stuck (from their last group on)."""

    def merge(self, other: RolloutStats) -> None:
        """Add another call's counts (a batch sampled in two parts)."""
        self.calls += other.calls
        self.failed_calls += other.failed_calls
        self.retried_prompts += other.retried_prompts
        self.duplicates_dropped += other.duplicates_dropped
        self.replicas = max(self.replicas, other.replicas)
        self.groups_by_replica.update(other.groups_by_replica)
        self.hedged_prompts += other.hedged_prompts
        self.stuck_calls += other.stuck_calls
        self.unhealthy_replicas |= other.unhealthy_replicas
        self.lost_wait_s += other.lost_wait_s

    def as_metrics(self) -> dict[str, float]:
        return {
            "rollout/calls": self.calls,
            "rollout/failed_calls": self.failed_calls,
            "rollout/retried_prompts": self.retried_prompts,
            "rollout/duplicates_dropped": self.duplicates_dropped,
            "rollout/hedged_prompts": self.hedged_prompts,
            "rollout/stuck_calls": self.stuck_calls,
            "rollout/unhealthy_replicas": len(self.unhealthy_replicas),
            "rollout/lost_wait_s": self.lost_wait_s,
            "rollout/replicas": self.replicas,
            # How the load balanced out: groups each replica delivered this step.
            **{f"rollout/groups_by_replica/{rid}": float(n) for rid, n in sorted(self.groups_by_replica.items())},
        }


def resolve_addresses(addresses: Sequence[str]) -> list[str]:
    """host:port entries as they are; `dns:///name:port` (or `dns://server/name:port`) -> every address it holds."""
    out: list[str] = []
    for entry in addresses:
        if not entry.startswith("dns:"):
            out.append(entry)
            continue
        target = entry.split("/", 3)[-1]
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            raise RolloutError(f"sampler.addresses entry {entry!r} is not dns:///name:port")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            log.warning("cannot resolve %s yet: %s", entry, e)
            continue
        for ip in sorted({info[4][0] for info in infos}):
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))


def make_prompt(prompt_id: str, token_ids: Sequence[int]) -> sampler_pb2.Prompt:
    return sampler_pb2.Prompt(id=prompt_id, token_ids=sampler_pb2.TokenIds(ids=list(token_ids)))


@dataclass
class _Call:
    """One Generate call in flight: what it was given, and when it last made progress."""

    address: str
    chunk: list[str]
    last_progress: float
    hedge: bool = False
    """A duplicate of prompts another replica holds."""
    delivered: int = 0
    """Groups of the chunk this call delivered first."""
    last_checked: float = 0.0
    """When its replica's progress was last checked (time.monotonic())."""


@dataclass
class _Batch:
    """The shared state of one `generate`: prompts not yet delivered, chunks to take, calls in flight."""

    pending: dict[str, sampler_pb2.Prompt]
    queue: asyncio.Queue
    out: asyncio.Queue
    stats: RolloutStats
    sampling: sampler_pb2.SamplingParams
    min_weight_version: int
    calls: list[_Call] = field(default_factory=list)
    hedged: set[str] = field(default_factory=set)
    done: bool = False
    """Every group is in (or the step gave up): workers stop at their next turn, even one whose cancellation a
    library swallowed (a wait_for racing its own timeout before Python 3.12, a gRPC call cancelled as it ends)."""

    def hedge_for(self, address: str) -> list[str]:
        """Prompts a straggler holds that an idle `address` may duplicate (each prompt hedged at most once)."""
        held = [c for c in self.calls if c.address != address and not c.hedge]
        held.sort(key=lambda c: c.last_progress)  # the quietest call first
        for call in held:
            prompts = [pid for pid in call.chunk if pid in self.pending and pid not in self.hedged]
            if prompts:
                self.hedged.update(prompts)
                return prompts
        return []


class RolloutClient:
    """Streams groups for a batch of prompts from every sampler replica, retrying failed calls elsewhere, giving
    stuck replicas' prompts to the others and hedging stragglers (learner/replica_health.py)."""

    def __init__(self, addresses: Sequence[str], cfg: RolloutConfig, credentials: auth.Credentials | None = None):
        if not addresses:
            raise RolloutError("sampler.addresses is empty: give host:port entries or dns:///name:port")
        self.addresses, self.cfg, self._credentials = list(addresses), cfg, credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.multi_turn = multi_turn_request(cfg.multi_turn)
        self.options = [*CLIENT_OPTIONS, *keepalive_options(cfg.keepalive_s, cfg.keepalive_timeout_s)]
        # Probes wait (within their timeout) for a channel that is reconnecting, e.g. after a partition healed.
        self.health = ReplicaHealth(lambda address, timeout: self.info(address, timeout, wait_for_ready=True),
                                    cfg.probe_timeout_s, cfg.retry_backoff_s, cfg.max_backoff_s)

    def _stub(self, address: str) -> sampler_pb2_grpc.SamplerStub:
        if address not in self._channels:
            self._channels[address] = auth.channel(address, self._credentials, self.options)
        return sampler_pb2_grpc.SamplerStub(self._channels[address])

    async def replicas(self) -> list[str]:
        """Current replica addresses; waits (with backoff) while a DNS name resolves to nothing yet."""
        deadline = time.monotonic() + self.cfg.step_timeout_s
        backoff = Backoff(self.cfg.retry_backoff_s, self.cfg.max_backoff_s)
        while True:
            found = await asyncio.to_thread(resolve_addresses, self.addresses)
            if found:
                self.health.forget(set(found))
                return found
            if time.monotonic() + backoff.delay > deadline:
                raise RolloutError(f"no sampler replica found at {self.addresses}")
            await backoff.wait()

    async def info(self, address: str, timeout: float = 10.0, wait_for_ready: bool = False) -> sampler_pb2.SamplerInfo:
        return await self._stub(address).Info(sampler_pb2.InfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)

    async def generate(
        self,
        prompts: Sequence[sampler_pb2.Prompt],
        sampling: sampler_pb2.SamplingParams,
        *,
        min_weight_version: int = 0,
        stats: RolloutStats | None = None,
    ) -> AsyncIterator[sampler_pb2.Group]:
        """Yield one Group per prompt (in arrival order), each exactly once, sampled at >= `min_weight_version`."""
        stats = stats if stats is not None else RolloutStats()
        if len({p.id for p in prompts}) != len(prompts):
            raise RolloutError("prompt ids must be unique within a batch")
        replicas = await self.replicas()
        stats.replicas = len(replicas)
        await self.health.recheck(replicas, min_weight_version)
        stats.unhealthy_replicas |= set(self.health.away) & set(replicas)
        healthy = [a for a in replicas if self.health.is_healthy(a)] or replicas
        size = self.cfg.prompts_per_request or math.ceil(len(prompts) / len(healthy))
        batch = _Batch({p.id: p for p in prompts}, asyncio.Queue(), asyncio.Queue(), stats, sampling,
                       min_weight_version)
        ids = [p.id for p in prompts]
        for i in range(0, len(ids), size):
            batch.queue.put_nowait(ids[i : i + size])
        workers = [asyncio.create_task(self._worker(a, batch)) for a in replicas]
        deadline = time.monotonic() + self.cfg.step_timeout_s
        try:
            for _ in range(len(prompts)):
                remaining = deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(batch.out.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise RolloutError(
                        f"{len(batch.pending)} of {len(prompts)} groups still missing after "
                        f"rollout.step_timeout_s={self.cfg.step_timeout_s:g}s (replicas {replicas}; unhealthy: "
                        f"{sorted(self.health.away) or 'none'})"
                    ) from None
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            batch.done = True
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _next_chunk(self, address: str, batch: _Batch) -> tuple[list[str], bool]:
        """A chunk from the queue, or, after `hedge_after_s` with the queue empty, a straggler's prompts to
        duplicate. Returns (prompt ids, hedge?)."""
        while not batch.done:
            if self.cfg.hedge_after_s is None:
                return await batch.queue.get(), False
            try:
                return await asyncio.wait_for(batch.queue.get(), timeout=self.cfg.hedge_after_s), False
            except asyncio.TimeoutError:
                prompts = batch.hedge_for(address)
                if prompts:
                    batch.stats.hedged_prompts += len(prompts)
                    log.info("sampler %s is idle while another replica holds %d prompts: hedging them here",
                             address, len(prompts))
                    return prompts, True
        return [], False

    async def _worker(self, address: str, batch: _Batch) -> None:
        """One replica's loop: wait until it is healthy, take a chunk (or hedge one), stream its groups; on
        failure put the prompts still pending back on the queue and mark the replica unhealthy."""
        stub = self._stub(address)
        while not batch.done:
            if not self.health.is_healthy(address):
                batch.stats.unhealthy_replicas.add(address)
                await self.health.until_healthy(address, batch.min_weight_version, lambda: batch.done)
                continue
            chunk, hedge = await self._next_chunk(address, batch)
            chunk = [pid for pid in chunk if pid in batch.pending]
            if not chunk:
                continue
            request = sampler_pb2.GenerateRequest(
                prompts=[batch.pending[pid] for pid in chunk],
                sampling=batch.sampling,
                min_weight_version=batch.min_weight_version,
                weight_wait_timeout_s=self.cfg.weight_wait_timeout_s,
                multi_turn=self.multi_turn,
            )
            batch.stats.calls += 1
            call = _Call(address, chunk, time.monotonic(), hedge)
            batch.calls.append(call)
            grpc_call = stub.Generate(request, timeout=self.cfg.request_timeout_s)
            try:
                await self._stream(grpc_call, call, batch)
            except grpc.aio.AioRpcError as e:
                if e.code() in FATAL_CODES:
                    batch.out.put_nowait(RolloutError(f"replica {address} rejected the request: {e.code().name}: "
                                                      f"{e.details()}"))
                    return
                self._give_back(call, batch, f"{e.code().name}: {e.details()}")
            except (_StreamEnded, _Stuck) as e:
                self._give_back(call, batch, str(e))
            except Exception as e:  # noqa: BLE001 (anything else is a bug: surface it rather than hang the step)
                batch.out.put_nowait(e)
                return
            finally:
                batch.calls.remove(call)
                # A worker cancelled mid-stream (the step is over or failed) aborts its engine requests, and so
                # does a call whose prompts were all delivered by a hedge.
                grpc_call.cancel()

    async def _stream(self, grpc_call, call: _Call, batch: _Batch) -> None:
        """Deliver the call's groups as they come; return when it has nothing pending left. A reader task feeds a
        queue, so waiting for the next group can time out (for the progress check) without cancelling the RPC."""
        arrived: asyncio.Queue = asyncio.Queue()
        reader = asyncio.create_task(_read_into(grpc_call, arrived))
        check_every = self.cfg.progress_timeout_s / 2
        seen = Progress()
        try:
            while not batch.done:
                if not any(pid in batch.pending for pid in call.chunk) and call.delivered < len(call.chunk):
                    return  # another call delivered the rest (a hedge, or its straggler): stop this one
                try:
                    item = await asyncio.wait_for(arrived.get(), timeout=min(check_every, 1.0))
                except asyncio.TimeoutError:
                    if time.monotonic() - max(call.last_progress, call.last_checked) < check_every:
                        continue
                    why = await self.health.stuck(call.address, seen)
                    if why is not None:
                        batch.stats.stuck_calls += 1
                        raise _Stuck(why) from None
                    call.last_checked = time.monotonic()  # check again half a period from now
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item is None:  # the stream ended
                    missing = [pid for pid in call.chunk if pid in batch.pending]
                    if missing:
                        raise _StreamEnded(f"stream ended with {len(missing)} groups missing")
                    return
                call.last_progress, seen = time.monotonic(), Progress()
                self._deliver(item, call, batch)
        finally:
            reader.cancel()

    def _deliver(self, group: sampler_pb2.Group, call: _Call, batch: _Batch) -> None:
        if group.prompt_id not in batch.pending:
            # A hedge and its straggler both finished it (or a retried prompt raced its first call): keep the first.
            batch.stats.duplicates_dropped += 1
            return
        if len(group.completions) != batch.sampling.n:
            raise RolloutError(f"replica {call.address} sent {len(group.completions)} completions for prompt "
                               f"{group.prompt_id!r}, expected n={batch.sampling.n}")
        del batch.pending[group.prompt_id]
        call.delivered += 1
        batch.stats.groups_by_replica[group.replica_id or call.address] += 1
        batch.out.put_nowait(group)

    def _give_back(self, call: _Call, batch: _Batch, why: str) -> None:
        """A failed or stuck call: its pending prompts go back on the queue, its replica is marked unhealthy."""
        missing = [pid for pid in call.chunk if pid in batch.pending]
        batch.stats.failed_calls += 1
        batch.stats.retried_prompts += len(missing)
        batch.stats.lost_wait_s += time.monotonic() - call.last_progress
        batch.stats.unhealthy_replicas.add(call.address)
        batch.hedged.difference_update(missing)  # they may be hedged again
        if missing:
            batch.queue.put_nowait(missing)
        self.health.mark_unhealthy(call.address, f"{why}; {len(missing)} prompts back to the queue")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class _Stuck(Exception):
    """A call's replica stopped making progress (retryable elsewhere)."""


async def _read_into(grpc_call, arrived: asyncio.Queue) -> None:
    """Every group of the stream into `arrived`, then None; an error as itself."""
    try:
        async for group in grpc_call:
            arrived.put_nowait(group)
        arrived.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # noqa: BLE001 (handed to the reader of `arrived`)
        arrived.put_nowait(e)
