"""Which replicas holding a batch's prompts are stragglers, read from how fast their engines step.

Hedging only from an idle replica (rollout.hedge_after_s) comes too late for a straggler: the fast replica first
finishes its own chunk, then starts the straggler's from scratch, and a step takes about twice as long as on the
fast replica alone. Engines batch: prompts added to a running batch cost little more than the batch itself. So the
rollout reads every busy replica's engine step counter (Info's engine_steps) every `straggler_check_s`, and a
replica whose engine steps slower than `straggler_speed` of the fastest one at two checks in a row has its pending
prompts duplicated at once on the fastest healthy replica, busy or not (the hedged requests of "The Tail at Scale",
Dean & Barroso 2013, sent as soon as the tail is known rather than after a fixed delay).

A replica that does not answer Info within a check counts as not stepping: a process stopped most of the time
answers late. Its answer is still awaited and, when it comes, read at the time it came: a busy CPU replica whose
gRPC server answers a little later than a check period still shows its true rate (else the fastest replica, the one
every other is compared with, could go unmeasured for a whole batch). Two checks in a row keep one slow prefill,
one garbage-collection pause or one late answer from being taken for a straggler; a wrong guess costs only
duplicate work (the first complete group wins). A replica that was slow at its last check of the previous batch
needs one slow check only: a throttled host or a noisy neighbour stays slow from one step to the next, and the
earlier the hedge, the less the step waits.

A replica on a small model can deliver its whole chunk before its Info answers twice, leaving no rate to compare
with. Its delivered groups still prove that a healthy engine steps: while it holds nothing, a replica holding prompts
whose engine did not step at all (or did not answer) is slow at that check.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class StepRates:
    """Engine step rates of the replicas holding a batch's prompts, and which of them are stragglers."""

    slower_than: float
    """A replica stepping slower than this share of the fastest is slow at that check."""
    checks_in_a_row: int = 2
    suspects: set[str] = field(default_factory=set)
    """Stragglers of the previous batch: one slow check suffices (a throttled host stays slow from step to step)."""
    verdicts: dict[str, bool] = field(default_factory=dict)
    """Per replica, whether it was slow at its last check: the next batch's suspects are the slow ones."""
    _last: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Per replica, its last answer: (when, engine_steps)."""
    rates: dict[str, float] = field(default_factory=dict)
    """Per replica, steps per second between its last two answers while it held prompts."""
    _slow: Counter = field(default_factory=Counter)

    def watched(self) -> set[str]:
        """Replicas read at the last check: the next check reads them again, with those holding prompts now, so
        that one which finished its prompts in between still gives the rate of its last window."""
        return set(self._last)

    def observe(self, now: float, steps: dict[str, int | None], holding: set[str] | None = None,
                read_at: dict[str, float] | None = None, finished: set[str] | None = None) -> list[str]:
        """One check: engine_steps (None when Info did not answer) of the replicas holding prompts, `holding`
        (default: all of `steps`), and of those read at the previous check; returns the stragglers among the
        holders: slow at `checks_in_a_row` checks in a row. `read_at`: when a count was read, where not `now` (an
        answer that came after its check). A replica that no longer holds prompts gets the rate of its last window
        and is then forgotten, so its next window starts when it gets prompts again. `finished`: replicas that
        delivered groups of this batch and hold none now, the reference when no rate is known."""
        holding = set(steps) if holding is None else holding
        read_at = read_at or {}
        current: dict[str, float | None] = {}
        for address, count in steps.items():
            when = read_at.get(address, now)
            previous = self._last.pop(address, None)
            if count is None:
                if previous is not None and address in holding:
                    self._last[address] = previous  # its next answer closes a longer window
                current[address] = None
                continue
            if address in holding:
                self._last[address] = (when, count)
            if previous is not None and when > previous[0]:
                rate = (count - previous[1]) / (when - previous[0])
                if address not in holding:
                    # Done with its prompts within this window (or before it, its groups still on their way): idle
                    # for part of it, so the window understates its speed, which its earlier window showed.
                    rate = max(rate, self.rates.get(address, 0.0))
                current[address] = self.rates[address] = rate
        for address in set(self._last) - holding:
            del self._last[address]
        for address in set(self._slow) - holding:
            self._slow[address] = 0
        # The fastest: among this check's rates and the last rate of replicas that finished their prompts (a fast
        # replica done with its chunk still shows what a healthy engine does).
        fastest = max([r for r in current.values() if r is not None] + list(self.rates.values()), default=0.0)
        stepped_elsewhere = bool((finished or set()) - holding)
        if fastest <= 0 and not stepped_elsewhere:
            return []
        for address in holding & set(current):
            rate = current[address]
            if fastest > 0:
                slow = rate is None or rate < self.slower_than * fastest
            else:  # another replica finished its chunk unmeasured: only not stepping at all is slow
                slow = not rate
            self.verdicts[address] = slow
            self._slow[address] = self._slow[address] + 1 if slow else 0
        return sorted(a for a in holding if self._slow[a] >= (1 if a in self.suspects else self.checks_in_a_row))

    def next_suspects(self) -> set[str]:
        """The suspects of the next batch: replicas slow at their last check, and this batch's suspects that were
        never checked (they held no prompts long enough)."""
        return {a for a, slow in self.verdicts.items() if slow} | (self.suspects - set(self.verdicts))
