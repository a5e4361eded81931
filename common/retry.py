"""Exponential backoff for every retry loop in dgrpo (sampler calls, reward calls, reward worker respawns).

Only the waiting is shared: each loop keeps its own decision of what to retry and when to give up, because those
differ (a rejected request is final, a replica that went away is not). The waits grow `initial`, `initial *
factor`, ... and never exceed `cap`; `jitter` stretches each wait by up to that fraction, so clients that failed
together do not retry in lockstep.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """The waits of one retry loop; `reset()` after a success starts the next failure from `initial` again."""

    initial: float
    """First wait, in seconds."""
    cap: float
    """Longest wait (before jitter), in seconds."""
    factor: float = 2.0
    """Growth of the wait per failure."""
    jitter: float = 0.0
    """Each wait is stretched by a random fraction in [0, jitter) of itself."""
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep
    """How to wait (tests pass a recorder)."""
    rng: Callable[[], float] = random.random
    """Uniform draws in [0, 1) for the jitter."""
    delay: float = field(init=False, default=0.0)
    """The next wait before jitter: what a log line announces."""

    def __post_init__(self) -> None:
        if self.initial <= 0 or self.cap <= 0 or self.factor < 1 or self.jitter < 0:
            raise ValueError(f"backoff needs initial > 0, cap > 0, factor >= 1, jitter >= 0; got "
                             f"initial={self.initial}, cap={self.cap}, factor={self.factor}, jitter={self.jitter}")
        self.reset()

    def reset(self) -> None:
        self.delay = min(self.initial, self.cap)

    async def wait(self, limit: float | None = None) -> float:
        """Sleep the next wait (at most `limit` seconds, e.g. what is left before a deadline), then grow it.
        Returns the seconds slept."""
        seconds = self.delay * (1 + self.jitter * self.rng()) if self.jitter else self.delay
        if limit is not None:
            seconds = min(seconds, max(limit, 0.0))
        self.delay = min(self.delay * self.factor, self.cap)
        await self.sleep(seconds)
        return seconds
