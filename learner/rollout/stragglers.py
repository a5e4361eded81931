"""Which replicas holding a batch's prompts are stragglers, read from how fast their engines step.

Hedging only from an idle replica (rollout.hedge_after_s) comes too late for a straggler: the fast replica first
finishes its own chunk, then starts the straggler's from scratch, and a step takes about twice as long as on the
fast replica alone. Engines batch: prompts added to a running batch cost little more than the batch itself. So the
rollout reads every busy replica's engine step counter (Info's engine_steps) every `straggler_check_s`, and a
replica whose engine steps slower than `straggler_speed` of the fastest one has its pending prompts duplicated at
once on the fastest healthy replica, busy or not (the hedged requests of "The Tail at Scale", Dean & Barroso 2013,
sent as soon as the tail is known rather than after a fixed delay).

A hedge is duplicate work on shared hardware, so a replica is judged only over a window that can tell: engine steps
are discrete, and on a loaded host one step can take longer than a check period, so a busy engine reads 0 steps in
one short window and 2 in the next. Rates are therefore read over a trailing window of at least two check periods
(one for a straggler of the previous batch: a throttled host stays slow from one step to the next, and the earlier
the hedge, the less the step waits) and long enough for the fastest replica to make `steps_to_judge` engine steps.
Counting steps, each end of a window is off by at most one, so with k steps of the fastest an engine of equal speed
reads at least (k - 1) / (k + 1) of it; k (`steps_to_judge`, 7 at 0.5) keeps that halfway between `straggler_speed`
and full speed. The fastest replica's own rate is read over the shortest trailing window holding k of its steps, and
every replica is compared with the fastest one's rate over the same window. A replica whose readings do not span
such a window yet gets no verdict; two equally fast replicas never read as stragglers, however slowly both step, and
no guess is made from one slow prefill or a pause.

A replica that does not answer Info within a check is judged from its answers so far; its answer is still awaited
and, when it comes, read at the time it came: a busy CPU replica whose gRPC server answers a little later than a
check period still shows its true rate. One that has not answered for a whole window reads as not stepping since its
last answer (a lower bound of its rate): a process stopped most of the time answers late or not at all.

A replica on a small model can deliver its whole chunk before it could be measured, leaving no rate to compare with.
Its delivered groups still prove that a healthy engine steps: while it holds nothing, a replica holding prompts
whose engine did not step at all (or did not answer) over a window as long as the finished replica needed for its
whole chunk (and at least the window above) is slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def steps_to_judge(slower_than: float) -> int:
    """The fastest replica's engine steps a window must hold before a replica is judged against it: the least k with
    (k - 1) / (k + 1) >= (1 + slower_than) / 2, so that an engine of equal speed, its count off by one step at each
    end of the window, still reads halfway between `slower_than` and full speed (7 at 0.5): uneven steps on a loaded
    host have that half as their margin."""
    return math.ceil((3 + slower_than) / (1 - slower_than) - 1e-9)


@dataclass
class StepRates:
    """Engine step rates of the replicas holding a batch's prompts, and which of them are stragglers."""

    slower_than: float
    """A replica stepping slower than this share of the fastest is slow."""
    check_s: float = 1.0
    """The check period: a verdict's window spans at least `min_checks` of them."""
    min_checks: int = 2
    suspects: set[str] = field(default_factory=set)
    """Stragglers of the previous batch: judged over one check period (a throttled host stays slow)."""
    verdicts: dict[str, bool] = field(default_factory=dict)
    """Per replica, whether it was slow at its last verdict: the next batch's suspects are the slow ones."""
    rates: dict[str, float] = field(default_factory=dict)
    """Per replica, its steps per second over its latest trailing window of `steps_to_judge` of its own steps (the
    reference a replica is compared with); a replica that no longer holds prompts keeps its last."""
    judged: dict[str, float] = field(default_factory=dict)
    """Per replica, the rate its last verdict was read from."""
    _history: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per replica holding prompts, its answers: (when, engine_steps)."""
    _since: dict[str, float] = field(default_factory=dict)
    """Per replica holding prompts, the first check at which it held them."""

    @property
    def steps_needed(self) -> int:
        return steps_to_judge(self.slower_than)

    def watched(self) -> set[str]:
        """Replicas read while holding prompts: the next check reads them again, with those holding prompts now, so
        that one which finished its prompts in between still closes its last window."""
        return set(self._history)

    def keeping_pace(self) -> set[str]:
        """Replicas whose last verdict found them stepping at least `slower_than` of the fastest."""
        return {a for a, slow in self.verdicts.items() if not slow}

    def observe(self, now: float, steps: dict[str, int | None], holding: set[str] | None = None,
                read_at: dict[str, float] | None = None, finished: dict[str, float] | None = None) -> list[str]:
        """One check: engine_steps (None when Info did not answer) of the replicas holding prompts, `holding`
        (default: all of `steps`), and of those read while holding at earlier checks; returns the holders judged
        slow at this check. `read_at`: when a count was read, where not `now` (an answer that came after its check).
        A replica that no longer holds prompts keeps the rate of its whole time holding them (a lower bound: it was
        idle for part of its last window) where that is higher, and is then forgotten, so its next window starts
        when it gets prompts again. `finished`: replicas that delivered groups of this batch and hold none now, with
        the seconds they took (the reference when no rate is known)."""
        holding = set(steps) if holding is None else holding
        read_at = read_at or {}
        answered = set()
        for address, count in steps.items():
            if count is None:
                continue
            when = read_at.get(address, now)
            history = self._history.setdefault(address, [])
            if history and count < history[-1][1]:
                history.clear()  # a restarted replica counts from 0 again
            if not history or when > history[-1][0]:
                history.append((when, count))
            answered.add(address)
        for address in set(self._history) - holding:
            history = self._history.pop(address)
            whole = _rate(history[0], history[-1]) if len(history) > 1 else None
            if whole is not None and history[-1][1] - history[0][1] >= self.steps_needed:
                self.rates[address] = max(whole, self.rates.get(address, 0.0))
        for address in set(self._since) - holding:
            del self._since[address]
        for address in holding:
            self._since.setdefault(address, now)
            own = self._own_rate(address)
            if own is not None:
                self.rates[address] = own
        fastest = max(self.rates.values(), default=0.0)
        finished = {a: s for a, s in (finished or {}).items() if a not in holding}
        if fastest <= 0 and not finished:
            return []  # nothing to compare with (all replicas may be waiting for weights)
        done_rates = [r for a, r in self.rates.items() if a not in holding]
        slow_now = []
        for address in sorted(holding):
            span = (1 if address in self.suspects else self.min_checks) * self.check_s
            if fastest > 0:
                window = max(span, self.steps_needed / fastest)
                rate = self._rate_over(address, now, window, address in answered)
                # The reference: every holder's rate over the same window (its own latest rate where its answers
                # do not span it yet), and the rates of the replicas that finished.
                over = {a: self._rate_over(a, now, window, a in answered) for a in holding}
                others = [r if r is not None else self.rates.get(a) for a, r in over.items()]
                reference = max([r for r in others if r is not None] + done_rates, default=0.0)
                slow = rate is not None and rate < self.slower_than * reference
            else:  # another replica finished its chunk unmeasured: only not stepping at all in that time is slow
                rate = self._rate_over(address, now, max(span, min(finished.values())), address in answered)
                slow = rate == 0
            if rate is None:
                continue  # its readings do not span the window yet: no verdict
            self.verdicts[address], self.judged[address] = slow, rate
            if slow:
                slow_now.append(address)
        return slow_now

    def _own_rate(self, address: str) -> float | None:
        """The replica's rate over the shortest trailing window of its answers that holds `steps_needed` of its steps
        and spans a check period; None before it has made that many."""
        history = self._history.get(address, [])
        if len(history) < 2:
            return None
        end = history[-1]
        for start in reversed(history[:-1]):
            if end[1] - start[1] >= self.steps_needed and end[0] - start[0] >= self.check_s:
                return _rate(start, end)
        return None

    def _rate_over(self, address: str, now: float, window: float, answered: bool) -> float | None:
        """The replica's rate over a trailing window of at least `window` seconds: from its newest answer at least
        that old to its last one, or to now (no steps since) when it has not answered for a whole window. None while
        its answers (or, without any, its time holding prompts) do not span the window."""
        history = self._history.get(address, [])
        if not history:
            return 0.0 if now - self._since.get(address, now) >= window else None
        silent = not answered and now - history[-1][0] >= window
        end = (now, history[-1][1]) if silent else history[-1]
        start = next((r for r in reversed(history) if r[0] <= end[0] - window), None)
        if start is None:
            return None
        return _rate(start, end)

    def next_suspects(self) -> set[str]:
        """The suspects of the next batch: replicas slow at their last verdict, and this batch's suspects that were
        never judged (they held no prompts long enough)."""
        return {a for a, slow in self.verdicts.items() if slow} | (self.suspects - set(self.verdicts))


def _rate(start: tuple[float, int], end: tuple[float, int]) -> float:
    return (end[1] - start[1]) / (end[0] - start[0])
