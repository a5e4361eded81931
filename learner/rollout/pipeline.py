"""Asynchronous rollout with bounded staleness: batches are sampled and scored ahead of the update.

With `rollout.max_staleness` k >= 1, the batch of step j is trained on by the policy of version V_j (the version
before step j's update) and may be sampled by any version >= V_j - k. It is therefore started as soon as the
learner reaches version V_j - k, i.e. while steps j-k ... j-1 are still training: while the learner trains batch
t, batches t+1 ... t+k are already being sampled and scored, and the samplers never wait for an update (k = 1 is
one-step off-policy, as AReaL / verl's fully-async trainer with staleness 1). Each batch asks the samplers for
`min_weight_version` V_j - k, so no token can be older than k versions; `take` still checks every group against
its first weight version and drops (and samples again) any group older than that, counting it.

The data position a checkpoint records is the one before the oldest batch still in flight: on resume, what was
in flight is sampled again and the trained batches follow the same order as an uninterrupted run. k = 0 keeps
the lockstep loop (learner/loop.py), which does not use this module.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dgrpo.learner.rollout.data import PromptRecord, PromptStream

# collect(batch, step, min_version) -> (scored groups in batch order, RolloutStats, reward busy seconds)
Collect = Callable[[list[PromptRecord], int, int], Awaitable[tuple[list[Any], Any, float]]]


def first_version(completion) -> int:
    """The oldest weight version that may have produced a completion's tokens (Completion.first_weight_version;
    unset, only the version at completion is known)."""
    return completion.first_weight_version if completion.HasField("first_weight_version") else \
        completion.weight_version


@dataclass
class InFlight:
    """One batch being sampled and scored for step `step`."""

    step: int
    batch: list[PromptRecord]
    data_before: dict
    """The data position before this batch was drawn: where a resume continues if it is not trained."""
    min_version: int
    task: asyncio.Task
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Taken:
    """What `take` hands the step: its scored groups (batch order), the rollout's stats, and timings."""

    scored: list[Any]
    stats: Any
    reward_busy_s: float
    data_before: dict
    latency_s: float
    """From the batch's start to its last group scored (overlapping earlier steps' updates)."""
    dropped_groups: int = 0
    """Groups older than `max_staleness` versions, dropped and sampled again."""


class RolloutPipeline:
    """Keeps the next `max_staleness` batches in flight ahead of the update."""

    def __init__(self, data: PromptStream, collect: Collect, max_staleness: int):
        if max_staleness < 1:
            raise ValueError("the pipeline is for max_staleness >= 1 (0 is the lockstep loop)")
        self.data, self.collect, self.k = data, collect, max_staleness
        self.in_flight: deque[InFlight] = deque()
        self._abandoned: list[asyncio.Task] = []

    def fill(self, next_step: int, version: int, last_step: int) -> None:
        """Start every batch that may be sampled now: steps next_step ... next_step + k (none after `last_step`),
        where the learner is at `version` (the version step `next_step` trains from). A batch for step j trains
        from version version + (j - next_step) and accepts samples of that minus k."""
        last_started = self.in_flight[-1].step if self.in_flight else next_step - 1
        for step in range(last_started + 1, min(next_step + self.k, last_step) + 1):
            min_version = max(0, version + (step - next_step) - self.k)
            data_before = self.data.state_dict()
            batch = self.data.next_batch()
            task = asyncio.create_task(self.collect(batch, step, min_version), name=f"rollout-step-{step}")
            self.in_flight.append(InFlight(step, batch, data_before, min_version, task))

    async def take(self, step: int, version: int) -> Taken:
        """The scored batch of `step`, every group sampled by version >= version - k (older groups are dropped
        and their prompts sampled again at once)."""
        head = self.in_flight[0]
        if head.step != step:
            raise RuntimeError(f"the pipeline holds step {head.step} next, the loop asked for {step}")
        scored, stats, busy = await head.task
        self.in_flight.popleft()
        floor = version - self.k
        stale = [i for i, sg in enumerate(scored) if min(map(first_version, sg.group.completions)) < floor]
        if stale:  # by min_weight_version this cannot happen; a replica that lost its weights would be caught here
            # the stale groups' own prompts (with dynamic sampling a group may come from a replacement prompt)
            again, stats_again, busy_again = await self.collect([scored[i].record for i in stale], step, version)
            for i, sg in zip(stale, again, strict=True):
                scored[i] = sg
            busy += busy_again
            stats.merge(stats_again)
        return Taken(scored, stats, busy, head.data_before, time.perf_counter() - head.started, len(stale))

    def data_position(self) -> dict | None:
        """Where a resume continues: before the oldest batch not yet trained (None: nothing in flight)."""
        return self.in_flight[0].data_before if self.in_flight else None

    def abandon(self) -> None:
        """Cancel every batch in flight (their sampler requests are aborted; a resume samples them again)."""
        for f in self.in_flight:
            f.task.cancel()
            self._abandoned.append(f.task)
        self.in_flight.clear()

    async def cancel(self) -> None:
        """`abandon`, and wait until every cancelled batch has let go of its calls."""
        self.abandon()
        tasks, self._abandoned = self._abandoned, []
        await asyncio.gather(*tasks, return_exceptions=True)


def staleness_metrics(scored: Sequence[Any], version: int) -> dict[str, float]:
    """Version lag of the trained tokens (by each completion's first version: an upper bound when an update
    landed mid-completion), and how many completions spanned versions."""
    tokens = lag_sum = 0
    lag_max = spanning = 0
    oldest = version
    for sg in scored:
        for c in sg.group.completions:
            lag = max(version - first_version(c), 0)
            n = len(c.token_ids)
            tokens, lag_sum = tokens + n, lag_sum + lag * n
            if n:
                lag_max, oldest = max(lag_max, lag), min(oldest, first_version(c))
            spanning += first_version(c) != c.weight_version
    return {"staleness/mean": lag_sum / max(tokens, 1), "staleness/max": float(lag_max),
            "staleness/oldest_version": float(oldest), "staleness/trained_version": float(version),
            "staleness/spanning_completions": float(spanning)}
