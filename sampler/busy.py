"""How long a replica has been busy: the seconds with at least one group in flight since it started, which
`Sampler.Info` reports as `busy_seconds` (asynchronous training keeps it close to the wall time;
benchmarks/bench_async.py reads it). The engine and the tests' scripted engine both keep one."""

from __future__ import annotations

import time


class BusyClock:
    """Call `note(busy)` whenever the set of work in flight changes; `seconds` counts the time it was non-empty."""

    def __init__(self):
        self._since: float | None = None
        self._total = 0.0

    def note(self, busy: bool) -> None:
        now = time.monotonic()
        if busy and self._since is None:
            self._since = now
        elif not busy and self._since is not None:
            self._total += now - self._since
            self._since = None

    @property
    def seconds(self) -> float:
        return self._total + (time.monotonic() - self._since if self._since is not None else 0.0)
