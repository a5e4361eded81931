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
from dgrpo.common.grpc_server import CHANNEL_OPTIONS
from dgrpo.common.retry import Backoff
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
    """First wait before a replica that failed is tried again; doubles per failure up to `max_backoff_s`."""
    max_backoff_s: float = Field(default=10.0, gt=0)
    """Longest wait between retries on one replica."""
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

    def merge(self, other: RolloutStats) -> None:
        """Add another call's counts (a batch sampled in two parts)."""
        self.calls += other.calls
        self.failed_calls += other.failed_calls
        self.retried_prompts += other.retried_prompts
        self.duplicates_dropped += other.duplicates_dropped
        self.replicas = max(self.replicas, other.replicas)
        self.groups_by_replica.update(other.groups_by_replica)

    def as_metrics(self) -> dict[str, float]:
        return {
            "rollout/calls": self.calls,
            "rollout/failed_calls": self.failed_calls,
            "rollout/retried_prompts": self.retried_prompts,
            "rollout/duplicates_dropped": self.duplicates_dropped,
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


class RolloutClient:
    """Streams groups for a batch of prompts from every sampler replica, retrying failed calls elsewhere."""

    def __init__(self, addresses: Sequence[str], cfg: RolloutConfig, credentials: auth.Credentials | None = None):
        if not addresses:
            raise RolloutError("sampler.addresses is empty: give host:port entries or dns:///name:port")
        self.addresses, self.cfg, self._credentials = list(addresses), cfg, credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.multi_turn = multi_turn_request(cfg.multi_turn)

    def _stub(self, address: str) -> sampler_pb2_grpc.SamplerStub:
        if address not in self._channels:
            self._channels[address] = auth.channel(address, self._credentials, CLIENT_OPTIONS)
        return sampler_pb2_grpc.SamplerStub(self._channels[address])

    async def replicas(self) -> list[str]:
        """Current replica addresses; waits (with backoff) while a DNS name resolves to nothing yet."""
        deadline = time.monotonic() + self.cfg.step_timeout_s
        backoff = Backoff(self.cfg.retry_backoff_s, self.cfg.max_backoff_s)
        while True:
            found = await asyncio.to_thread(resolve_addresses, self.addresses)
            if found:
                return found
            if time.monotonic() + backoff.delay > deadline:
                raise RolloutError(f"no sampler replica found at {self.addresses}")
            await backoff.wait()

    async def info(self, address: str, timeout: float = 10.0) -> sampler_pb2.SamplerInfo:
        return await self._stub(address).Info(sampler_pb2.InfoRequest(), timeout=timeout)

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
        pending = {p.id: p for p in prompts}
        replicas = await self.replicas()
        stats.replicas = len(replicas)
        size = self.cfg.prompts_per_request or math.ceil(len(prompts) / len(replicas))
        ids = [p.id for p in prompts]
        queue: asyncio.Queue[list[str]] = asyncio.Queue()
        for i in range(0, len(ids), size):
            queue.put_nowait(ids[i : i + size])
        out: asyncio.Queue[sampler_pb2.Group | BaseException] = asyncio.Queue()
        workers = [
            asyncio.create_task(self._worker(a, queue, pending, out, sampling, min_weight_version, stats))
            for a in replicas
        ]
        deadline = time.monotonic() + self.cfg.step_timeout_s
        try:
            for _ in range(len(prompts)):
                remaining = deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(out.get(), timeout=max(remaining, 0.001))
                except asyncio.TimeoutError:
                    raise RolloutError(
                        f"{len(pending)} of {len(prompts)} groups still missing after "
                        f"rollout.step_timeout_s={self.cfg.step_timeout_s:g}s (replicas {replicas})"
                    ) from None
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self, address, queue, pending, out, sampling, min_weight_version, stats) -> None:
        """One replica's loop: take a chunk, stream its groups, put unfinished prompts back on failure."""
        stub = self._stub(address)
        # Jitter keeps replicas that failed together from retrying in lockstep.
        backoff = Backoff(self.cfg.retry_backoff_s, self.cfg.max_backoff_s, jitter=0.1)
        while True:
            chunk = [pid for pid in await queue.get() if pid in pending]
            if not chunk:
                continue
            request = sampler_pb2.GenerateRequest(
                prompts=[pending[pid] for pid in chunk],
                sampling=sampling,
                min_weight_version=min_weight_version,
                weight_wait_timeout_s=self.cfg.weight_wait_timeout_s,
                multi_turn=self.multi_turn,
            )
            stats.calls += 1
            call = stub.Generate(request, timeout=self.cfg.request_timeout_s)
            try:
                async for group in call:
                    if group.prompt_id not in pending:
                        # Only possible if a retried prompt raced its first call; keep the first group.
                        stats.duplicates_dropped += 1
                        continue
                    if len(group.completions) != sampling.n:
                        out.put_nowait(RolloutError(
                            f"replica {address} sent {len(group.completions)} completions for prompt "
                            f"{group.prompt_id!r}, expected n={sampling.n}"
                        ))
                        return
                    del pending[group.prompt_id]
                    stats.groups_by_replica[group.replica_id or address] += 1
                    out.put_nowait(group)
                missing = [pid for pid in chunk if pid in pending]
                if missing:
                    raise _StreamEnded(f"stream ended with {len(missing)} groups missing")
                backoff.reset()
            except grpc.aio.AioRpcError as e:
                if e.code() in FATAL_CODES:
                    out.put_nowait(RolloutError(f"replica {address} rejected the request: {e.code().name}: "
                                                f"{e.details()}"))
                    return
                await self._requeue(address, chunk, pending, queue, stats, backoff, f"{e.code().name}: {e.details()}")
            except _StreamEnded as e:
                await self._requeue(address, chunk, pending, queue, stats, backoff, str(e))
            except Exception as e:  # noqa: BLE001 (anything else is a bug: surface it rather than hang the step)
                out.put_nowait(e)
                return
            finally:
                # A worker cancelled mid-stream (the step is over or failed) aborts its engine requests.
                call.cancel()

    async def _requeue(self, address, chunk, pending, queue, stats, backoff: Backoff, why) -> None:
        missing = [pid for pid in chunk if pid in pending]
        stats.failed_calls += 1
        stats.retried_prompts += len(missing)
        if missing:
            queue.put_nowait(missing)
        log.warning("sampler %s failed (%s); %d prompts go back to the queue, retrying this replica in %.1fs",
                    address, why, len(missing), backoff.delay)
        await backoff.wait()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
