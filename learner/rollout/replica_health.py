"""Which sampler replicas the rollout may give prompts to, and how a stuck one is told from a slow one.

A replica that dies is easy: its calls fail at once. One that hangs gives no error at all — a frozen process (a
stopped container, a GC-paused or swapping host), a host whose packets are dropped, an engine that stopped
stepping. Two signals catch it without waiting for a call's deadline:

- the channel's HTTP/2 keepalive (`rollout.keepalive_s`): a peer that does not answer a ping within
  `keepalive_timeout_s` has its connection closed, so its calls fail UNAVAILABLE in seconds;
- progress: a call that has delivered no group for `progress_timeout_s / 2` asks the replica's Info, and again every
  half period; the same `engine_steps` at two answers, or no answer twice in a row, means stuck (a replica generating
  long completions answers and its engine steps advance, so it is never mistaken for a stuck one).

A replica whose call failed or was declared stuck is unhealthy: it is given no prompts until it answers Info
again with at least the weight version the rollout asks for (a frozen process that is resumed, a link that comes
back, a restarted replica that caught up). Until then it is probed with backoff, and reported while it stays
away. The state outlives a step: a replica still away at the next step is probed, not handed a chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from dgrpo.common.retry import Backoff
from dgrpo.v1 import sampler_pb2

log = logging.getLogger(__name__)

REPORT_EVERY_S = 60.0  # how often a replica that stays away is reported again

InfoCall = Callable[[str, float], Awaitable[sampler_pb2.SamplerInfo]]


@dataclass
class Progress:
    """What the progress checks of one quiet call have seen since its last group."""

    steps: int | None = None
    """Info's engine_steps at the previous answered check."""
    unanswered: int = 0
    """Checks in a row that Info did not answer."""


@dataclass
class Away:
    """A replica given no prompts, since when, and why."""

    since: float
    why: str
    reported: float


class ReplicaHealth:
    """Unhealthy replicas of one rollout client, their probing, and the stuck check of a quiet call."""

    def __init__(self, info: InfoCall, probe_timeout_s: float, backoff_s: float, max_backoff_s: float):
        self._info, self.probe_timeout_s = info, probe_timeout_s
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self.away: dict[str, Away] = {}

    def is_healthy(self, address: str) -> bool:
        return address not in self.away

    def mark_unhealthy(self, address: str, why: str) -> None:
        if address not in self.away:
            now = time.monotonic()
            self.away[address] = Away(now, why, now)
            log.warning("sampler %s is unhealthy (%s): its prompts go to the others until it answers again",
                        address, why)

    def forget(self, addresses: set[str]) -> None:
        """Replicas no longer resolved (scaled down) are not waited for."""
        for address in set(self.away) - addresses:
            del self.away[address]

    async def until_healthy(self, address: str, min_weight_version: int,
                            give_up: Callable[[], bool] = lambda: False) -> None:
        """Return once an unhealthy replica answers Info with at least `min_weight_version` (at once if healthy),
        or once `give_up()` says the caller no longer needs it."""
        backoff = Backoff(self._backoff_s, self._max_backoff_s, jitter=0.1)
        while address in self.away and not give_up():
            try:
                info = await self._info(address, self.probe_timeout_s)
            except grpc.aio.AioRpcError as e:
                problem = f"Info: {e.code().name}"
            else:
                if info.weight_version >= min_weight_version:
                    away = self.away.pop(address, None)  # (another probe of it may have won the race)
                    if away is not None:
                        log.warning("sampler %s answers again after %.0fs (weight version %d): back in the rollout",
                                    address, time.monotonic() - away.since, info.weight_version)
                    return
                problem = f"weight version {info.weight_version} < {min_weight_version}"
            away = self.away.get(address)
            if away is not None and time.monotonic() - away.reported >= REPORT_EVERY_S:
                away.reported = time.monotonic()
                log.warning("sampler %s still away after %.0fs (%s; first: %s)", address,
                            away.reported - away.since, problem, away.why)
            await backoff.wait()

    async def recheck(self, addresses: list[str], min_weight_version: int, timeout_s: float = 0.5) -> None:
        """One quick probe of the unhealthy ones among `addresses` at the start of a step, all at once: a replica
        that is back gets its share of the step's prompts instead of waiting for its next probe."""
        away = [a for a in addresses if a in self.away]
        if away:
            await asyncio.gather(*(asyncio.wait_for(self.until_healthy(a, min_weight_version), timeout_s)
                                   for a in away), return_exceptions=True)

    async def stuck(self, address: str, seen: Progress) -> str | None:
        """One progress check of a quiet call: why it is stuck, or None while it may still be working. Stuck: two
        answers with the same engine_steps, or no answer to Info at two checks in a row (a replica busy on a loaded
        host may miss one probe; a frozen one has usually lost its connection to keepalive already)."""
        try:
            info = await self._info(address, self.probe_timeout_s)
        except grpc.aio.AioRpcError as e:
            seen.unanswered += 1
            if seen.unanswered >= 2:
                return f"no answer to Info ({e.code().name}) at {seen.unanswered} checks in a row while holding prompts"
            return None
        seen.unanswered = 0
        if seen.steps is not None and info.engine_steps == seen.steps:
            return f"engine stopped stepping at {info.engine_steps} with no group"
        seen.steps = info.engine_steps
        return None
