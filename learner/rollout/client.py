"""Rollout: the learner's gRPC client of the sampler replicas.

A step's prompts are split into chunks, one per replica by default, and a worker per replica pulls chunks from a
shared queue, so a fast replica takes more work. Groups stream back one per prompt as soon as they are complete and
are handed to the caller at once (scoring overlaps generation). When a call fails — a replica killed, restarting,
or not reaching `min_weight_version` in time — the prompts of that call that have not arrived yet go back on the
queue and another replica (or the same one, after an exponential backoff) samples them. A prompt is considered
done when its group arrives, and a group is accepted only for a prompt still pending, so no group is ever lost
or duplicated. A replica that hangs is found by keepalive and progress checks (learner/rollout/replica_health.py); a
straggler's prompts are duplicated on a faster replica, the first complete group wins (learner/rollout/stragglers.py).

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
from collections.abc import AsyncIterator, Sequence

import grpc

from dgrpo.common import auth, tracing
from dgrpo.common.auth_config import Credentials
from dgrpo.common.grpc_server import CHANNEL_OPTIONS, keepalive_options
from dgrpo.common.retry import Backoff
from dgrpo.learner.config import RolloutConfig
from dgrpo.learner.rollout.replica_health import Progress, ReplicaHealth
from dgrpo.learner.rollout.rollout_batch import Batch, Call, RolloutStats
from dgrpo.learner.rollout.stragglers import StepRates
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


def sampling_params(cfg: RolloutConfig, *, greedy: bool = False, step: int | None = None) -> sampler_pb2.SamplingParams:
    """A rollout's SamplingParams: the config's, or greedy (one completion, temperature 0) for validation. With
    rollout.seed set, training step `step` samples with seed + step - 1: each step differently, a resume
    reproducibly."""
    params = sampler_pb2.SamplingParams(
        n=1 if greedy else cfg.n, temperature=0.0 if greedy else cfg.temperature, max_tokens=cfg.max_response_length,
        stop=cfg.stop,
    )
    if not greedy:
        params.top_p, params.top_k, params.min_p = cfg.top_p, cfg.top_k, cfg.min_p
        if cfg.seed is not None and step is not None:
            params.seed = cfg.seed + step - 1
    return params


class RolloutClient:
    """Streams groups for a batch of prompts from every sampler replica, retrying failed calls elsewhere, giving
    stuck replicas' prompts to the others and hedging stragglers (learner/rollout/replica_health.py)."""

    def __init__(self, addresses: Sequence[str], cfg: RolloutConfig, credentials: Credentials | None = None):
        if not addresses:
            raise RolloutError("sampler.addresses is empty: give host:port entries or dns:///name:port")
        self.addresses, self.cfg, self._credentials = list(addresses), cfg, credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.multi_turn = multi_turn_request(cfg.multi_turn)
        self.options = [*CLIENT_OPTIONS, *keepalive_options(cfg.keepalive_s, cfg.keepalive_timeout_s)]
        # Probes wait (within their timeout) for a channel that is reconnecting, e.g. after a partition healed.
        self.health = ReplicaHealth(lambda address, timeout: self.info(address, timeout, wait_for_ready=True),
                                    cfg.probe_timeout_s, cfg.retry_backoff_s, cfg.max_backoff_s)
        self._straggler_suspects: set[str] = set()  # learner/rollout/stragglers.py

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
        batch = Batch({p.id: p for p in prompts}, asyncio.Queue(), asyncio.Queue(), stats, sampling,
                       min_weight_version, replicas=replicas)
        ids = [p.id for p in prompts]
        for i in range(0, len(ids), size):
            batch.queue.put_nowait(ids[i : i + size])
        workers = [asyncio.create_task(self._worker(a, batch)) for a in replicas]
        if self.cfg.hedge_after_s is not None and self.cfg.straggler_speed is not None and len(replicas) > 1:
            workers.append(asyncio.create_task(self._watch_stragglers(batch)))
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
            tasks = [*workers, *batch.tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _next_chunk(self, address: str, batch: Batch) -> tuple[list[str], bool]:
        """A chunk from the queue, or, once idle for `_hedge_delay`, a straggler's prompts to duplicate.
        Returns (prompt ids, hedge?)."""
        idle_since = time.monotonic()
        while not batch.done:
            if self.cfg.hedge_after_s is None:
                return await batch.queue.get(), False
            wait = self._hedge_delay(batch) - (time.monotonic() - idle_since)
            try:
                return await asyncio.wait_for(batch.queue.get(), timeout=max(wait, 0.01)), False
            except asyncio.TimeoutError:
                if time.monotonic() - idle_since < self._hedge_delay(batch):
                    continue  # the batch grew older while this replica waited: so did the delay
                prompts = batch.hedge_for(address)
                if prompts:
                    batch.stats.hedged_prompts += len(prompts)
                    log.info("sampler %s is idle while another replica holds %d prompts: hedging them here",
                             address, len(prompts))
                    return prompts, True
                idle_since = time.monotonic()  # nothing to hedge now: wait a whole delay again
        return [], False

    def _hedge_delay(self, batch: Batch) -> float:
        return max(self.cfg.hedge_after_s or 0.0, self.cfg.hedge_after_share * (time.monotonic() - batch.started))

    async def _worker(self, address: str, batch: Batch) -> None:
        """One replica's loop: wait until it is healthy, take a chunk (or hedge one), stream its groups; on
        failure put the prompts still pending back on the queue and mark the replica unhealthy."""
        while not batch.done:
            if not self.health.is_healthy(address):
                batch.stats.unhealthy_replicas.add(address)
                await self.health.until_healthy(address, batch.min_weight_version, lambda: batch.done)
                continue
            chunk, hedge = await self._next_chunk(address, batch)
            chunk = [pid for pid in chunk if pid in batch.pending]
            if not chunk:
                continue
            if not await self._call(address, chunk, hedge, batch):
                return

    async def _call(self, address: str, chunk: list[str], hedge: bool, batch: Batch) -> bool:
        """One Generate call of `chunk` on `address`, its groups delivered as they come. On a retryable failure the
        prompts still pending go back on the queue and the replica is marked unhealthy; False when the step must
        stop (the error is handed to the caller)."""
        request = sampler_pb2.GenerateRequest(
            prompts=[batch.pending[pid] for pid in chunk],
            sampling=batch.sampling,
            min_weight_version=batch.min_weight_version,
            weight_wait_timeout_s=self.cfg.weight_wait_timeout_s,
            multi_turn=self.multi_turn,
        )
        batch.stats.calls += 1
        call = Call(address, chunk, time.monotonic(), hedge)
        batch.calls.append(call)
        span = tracing.client_span("Generate", replica=address, prompts=len(chunk), hedge=hedge,
                                   min_weight_version=batch.min_weight_version)
        grpc_call = self._stub(address).Generate(request, timeout=self.cfg.request_timeout_s, metadata=span.metadata)
        try:
            await self._stream(grpc_call, call, batch)
        except grpc.aio.AioRpcError as e:
            if e.code() in FATAL_CODES:
                batch.out.put_nowait(RolloutError(f"replica {address} rejected the request: {e.code().name}: "
                                                  f"{e.details()}"))
                return False
            self._give_back(call, batch, f"{e.code().name}: {e.details()}")
        except (_StreamEnded, _Stuck) as e:
            self._give_back(call, batch, str(e))
        except Exception as e:  # noqa: BLE001 (anything else is a bug: surface it rather than hang the step)
            batch.out.put_nowait(e)
            return False
        finally:
            batch.calls.remove(call)
            # A call cancelled mid-stream (the step is over or failed) aborts its engine requests, and so does a
            # call whose prompts were all delivered by a hedge.
            grpc_call.cancel()
            span.end(groups=call.delivered)
        return True

    async def _watch_stragglers(self, batch: Batch) -> None:
        """Every `straggler_check_s`, the engine steps of the replicas holding prompts; a straggler's pending
        prompts are hedged on the fastest healthy replica (learner/rollout/stragglers.py)."""
        rates = StepRates(self.cfg.straggler_speed, check_s=self.cfg.straggler_check_s,
                          suspects=self._straggler_suspects)
        # One Info in flight per replica: one not answered within a check counts as not stepping at that check, and
        # its answer, when it comes, is read at the time it came (learner/rollout/stragglers.py).
        readings: dict[str, asyncio.Task] = {}
        try:
            # The first reading as soon as the calls are out, so that the first rates come one period after they start.
            wait = min(0.1, self.cfg.straggler_check_s)
            while not batch.done:
                await asyncio.sleep(wait)
                wait = self.cfg.straggler_check_s
                holders = batch.holders()
                read = sorted(holders | rates.watched())
                for address in read:
                    if address not in readings:
                        readings[address] = asyncio.create_task(self._engine_steps(address))
                await asyncio.wait([readings[a] for a in read], timeout=self.cfg.straggler_check_s)
                now = time.monotonic()
                steps: dict[str, int | None] = dict.fromkeys(read)
                read_at: dict[str, float] = {}
                for address in read:
                    if readings[address].done():
                        answer = readings.pop(address).result()
                        if answer is not None:
                            read_at[address], steps[address] = answer
                finished = {a: s for a, s in batch.delivered_by.items() if a not in holders}
                stragglers = rates.observe(now, steps, holders, read_at, finished=finished)
                batch.keeping_pace = rates.keeping_pace()
                for straggler in stragglers:
                    target = self._hedge_target(batch, rates, exclude=straggler)
                    prompts = batch.hedge_from(straggler) if target else []
                    if prompts:
                        batch.stats.hedged_prompts += len(prompts)
                        log.info("sampler %s steps at %.1f/s, %s at %.1f/s: hedging its %d pending prompts there",
                                 straggler, rates.judged.get(straggler, 0.0), target, rates.rates.get(target, 0.0),
                                 len(prompts))
                        task = asyncio.create_task(self._call(target, prompts, True, batch))
                        batch.tasks.add(task)
                        task.add_done_callback(batch.tasks.discard)
        finally:
            for reading in readings.values():
                reading.cancel()
            self._straggler_suspects = rates.next_suspects()

    async def _engine_steps(self, address: str) -> tuple[float, int] | None:
        """(when it came, the replica's engine_steps), or None when Info failed or took longer than a probe."""
        try:
            info = await self.info(address, max(self.cfg.probe_timeout_s, self.cfg.straggler_check_s))
        except Exception:  # noqa: BLE001 -- any failure (deadline, channel closed, ...) reads as not stepping
            return None
        return time.monotonic(), info.engine_steps

    def _hedge_target(self, batch: Batch, rates: StepRates, exclude: str) -> str | None:
        """The healthy replica to duplicate a straggler's prompts on: one holding nothing first, then the fastest;
        never one already running a hedge, nor one slow itself."""
        running_hedge = {c.address for c in batch.calls if c.hedge}
        best = max(rates.rates.values(), default=0.0)
        candidates = [a for a in batch.replicas if a != exclude and a not in running_hedge
                      and self.health.is_healthy(a) and rates.rates.get(a, best) >= rates.slower_than * best]
        holders = batch.holders()
        candidates.sort(key=lambda a: (a in holders, -rates.rates.get(a, 0.0)))
        return candidates[0] if candidates else None

    async def _stream(self, grpc_call, call: Call, batch: Batch) -> None:
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

    def _deliver(self, group: sampler_pb2.Group, call: Call, batch: Batch) -> None:
        if group.prompt_id not in batch.pending:
            # A hedge and its straggler both finished it (or a retried prompt raced its first call): keep the first.
            batch.stats.duplicates_dropped += 1
            return
        if len(group.completions) != batch.sampling.n:
            raise RolloutError(f"replica {call.address} sent {len(group.completions)} completions for prompt "
                               f"{group.prompt_id!r}, expected n={batch.sampling.n}")
        del batch.pending[group.prompt_id]
        call.delivered += 1
        batch.delivered_by[call.address] = time.monotonic() - batch.started
        batch.stats.groups_by_replica[group.replica_id or call.address] += 1
        batch.out.put_nowait(group)

    def _give_back(self, call: Call, batch: Batch, why: str) -> None:
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
