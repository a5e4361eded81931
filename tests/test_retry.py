"""The shared backoff: waits double up to the cap, reset, deadline limits, jitter on top; sleeps are recorded."""

from __future__ import annotations

import asyncio
import time

import pytest

from dgrpo.common.retry import Backoff


def recorder() -> tuple[list[float], object]:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    return slept, sleep


def waits(backoff: Backoff, count: int, **kw) -> list[float]:
    async def run() -> list[float]:
        return [await backoff.wait(**kw) for _ in range(count)]

    return asyncio.run(run())


def test_waits_double_up_to_the_cap_and_reset_starts_over():
    slept, sleep = recorder()
    backoff = Backoff(0.5, 3.0, sleep=sleep)
    announced = []
    for _ in range(5):
        announced.append(backoff.delay)  # what a log line says before the wait
        waits(backoff, 1)
    assert slept == announced == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert waits(backoff, 2) == [0.5, 1.0]


def test_limit_shortens_a_wait_to_the_deadline_and_the_next_wait_still_grows():
    slept, sleep = recorder()
    backoff = Backoff(1.0, 10.0, sleep=sleep)
    assert waits(backoff, 1, limit=0.25) == [0.25]
    assert waits(backoff, 1, limit=-3.0) == [0.0]  # a deadline already past: no wait, never a negative sleep
    assert waits(backoff, 1) == [4.0]
    assert slept == [0.25, 0.0, 4.0]


def test_jitter_stretches_each_wait_without_compounding():
    slept, sleep = recorder()
    draws = iter([0.5, 0.0, 0.999])
    backoff = Backoff(1.0, 3.0, jitter=0.1, sleep=sleep, rng=lambda: next(draws))
    waits(backoff, 3)
    assert slept == pytest.approx([1.05, 2.0, 3.0 * 1.0999])


def test_factor_and_a_first_wait_above_the_cap():
    slept, sleep = recorder()
    waits(Backoff(0.1, 1.0, factor=3.0, sleep=sleep), 4)
    assert slept == pytest.approx([0.1, 0.3, 0.9, 1.0])
    assert waits(Backoff(5.0, 2.0, sleep=recorder()[1]), 2) == [2.0, 2.0]  # never longer than the cap


@pytest.mark.parametrize("kw", [{"initial": 0, "cap": 1}, {"initial": 1, "cap": 0}, {"initial": 1, "cap": 2,
                                "factor": 0.5}, {"initial": 1, "cap": 2, "jitter": -0.1}])
def test_nonsense_bounds_are_refused(kw):
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**kw)


def test_default_sleep_really_waits():
    start = time.perf_counter()
    assert waits(Backoff(0.02, 0.05), 2) == [0.02, 0.04]
    assert time.perf_counter() - start >= 0.06
