"""The shared state of one rollout `generate`: its prompts still pending, the calls in flight, what it went through.

Kept apart from the client (learner/rollout/client.py) so that the hedging rules read on their own: which prompts an
idle
replica may duplicate, which a straggler holds (learner/rollout/stragglers.py says who is one).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from dgrpo.v1 import sampler_pb2


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
    """Prompts duplicated on another replica (idle, or faster: learner/rollout/stragglers.py) while a straggler held
    them."""
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


@dataclass
class Call:
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
class Batch:
    """The shared state of one `generate`: prompts not yet delivered, chunks to take, calls in flight."""

    pending: dict[str, sampler_pb2.Prompt]
    queue: asyncio.Queue
    out: asyncio.Queue
    stats: RolloutStats
    sampling: sampler_pb2.SamplingParams
    min_weight_version: int
    calls: list[Call] = field(default_factory=list)
    hedged: set[str] = field(default_factory=set)
    tasks: set[asyncio.Task] = field(default_factory=set)
    """Hedge calls started by the straggler watch (a replica's worker runs its own calls)."""
    started: float = field(default_factory=time.monotonic)
    replicas: list[str] = field(default_factory=list)
    delivered_by: dict[str, float] = field(default_factory=dict)
    """Replicas that delivered a group of this batch first, with the seconds from the batch's start to their last such
    group: proof their engines step, and how long a whole chunk took them (learner/rollout/stragglers.py)."""
    keeping_pace: set[str] = field(default_factory=set)
    """Replicas the straggler watch last found stepping at least `straggler_speed` of the fastest: an idle replica
    does not duplicate their prompts (`hedge_for`)."""
    done: bool = False
    """Every group is in (or the step gave up): workers stop at their next turn, even one whose cancellation a
    library swallowed (a wait_for racing its own timeout before Python 3.12, a gRPC call cancelled as it ends)."""

    def hedge_for(self, address: str) -> list[str]:
        """Prompts a straggler holds that an idle `address` may duplicate (each prompt hedged at most once). Never
        those of a replica keeping pace: a copy starts from the first token on an engine at most 1 / straggler_speed
        as fast, so it wins only where the original had barely started (or where its sample happens to be shorter),
        and it slows the original down on shared hardware meanwhile."""
        held = [c for c in self.calls if c.address != address and not c.hedge and c.address not in self.keeping_pace]
        held.sort(key=lambda c: c.last_progress)  # the quietest call first
        for call in held:
            prompts = self._unhedged(call)
            if prompts:
                self.hedged.update(prompts)
                return prompts
        return []

    def hedge_from(self, straggler: str) -> list[str]:
        """Every prompt `straggler` holds that is neither delivered nor hedged yet (now marked hedged)."""
        prompts = [pid for c in self.calls if c.address == straggler and not c.hedge for pid in self._unhedged(c)]
        self.hedged.update(prompts)
        return prompts

    def _unhedged(self, call: Call) -> list[str]:
        return [pid for pid in call.chunk if pid in self.pending and pid not in self.hedged]

    def holders(self) -> set[str]:
        """Replicas with a call holding prompts still pending."""
        return {c.address for c in self.calls if any(pid in self.pending for pid in c.chunk)}
