"""DAPO's two data-side techniques (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale"), as verl's DAPO recipe implements them: overlong reward shaping and dynamic sampling.

- Overlong reward shaping (`learner.algorithm.overlong_buffer`): a completion longer than `max - len` tokens loses
  reward linearly, up to `penalty_factor` at the maximum length (verl's `DAPORewardManager`,
  verl/workers/reward_manager/dapo.py). Applied to each group as its scores arrive, before advantages and before
  the dynamic-sampling decision, as in verl (its `seq_reward` includes the penalty).
- Dynamic sampling (`learner.algorithm.filter_groups`): a group whose metric has zero spread has zero advantage for
  every completion, so it carries no gradient; it is dropped and another prompt is sampled in its place until the
  step holds `train_batch_size` informative groups (verl's `RayDAPOTrainer.fit`, recipe/dapo/dapo_ray_trainer.py).
  verl samples whole extra generation batches after the first one completes; here each dropped group's
  replacement is requested as soon as the group is scored, while the rest of the batch is still being sampled
  (the rollout streams groups), so no informative group is sampled only to be discarded.

The settings, `OverlongBufferConfig` and `FilterGroupsConfig`, are in learner/update/config.py with the rest of
`learner.algorithm`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dgrpo.learner.rollout.client import RolloutError
from dgrpo.learner.update.config import OverlongBufferConfig

# Reward breakdown names that are 0/1 correctness checks (the built-ins), for metric `acc`.
ACCURACY_FUNCTIONS = ("math_verify", "exact_match", "accuracy", "correct")
REWARD_METRICS = ("reward", "seq_reward", "seq_final_reward")
"""Metric names meaning the completion's final reward (rewarder's reward + overlong penalty): verl's `seq_reward` and
`seq_final_reward` are the same value when the KL is not in the reward (dgrpo keeps it in the loss)."""


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The penalty of a completion of `length` tokens (<= 0).

    verl/workers/reward_manager/dapo.py: expected_len = max_resp_len - overlong_buffer_len;
    exceed_len = valid_response_length - expected_len; overlong_reward = min(-exceed_len / overlong_buffer_len *
    overlong_penalty_factor, 0).
    """
    expected = max_len - buffer_len
    return min(-(length - expected) / buffer_len * factor, 0.0)


def apply_overlong(reward: Any, lengths: Sequence[int], cfg: OverlongBufferConfig, max_len: int) -> None:
    """Add the penalty to a GroupReward in place: to each valid reward, and to each breakdown as `overlong_reward`
    (verl logs the same name), so the penalty is visible per step under reward/fn/overlong_reward."""
    if not cfg.enable:
        return
    top = cfg.max_response_length or max_len
    for i, n in enumerate(lengths):
        p = overlong_penalty(n, top, cfg.len, cfg.penalty_factor)
        if reward.valid[i]:
            reward.rewards[i] += p
        reward.breakdown[i]["overlong_reward"] = p


def group_metric(reward: Any, metric: str, penalties: Sequence[float] | None = None) -> list[float]:
    """The filter metric of each valid completion of one scored group (GroupReward).

    Raises ValueError naming `learner.algorithm.filter_groups.metric` when the group has no such value."""
    penalties = penalties if penalties is not None else [b.get("overlong_reward", 0.0) for b in reward.breakdown]
    valid = [i for i, ok in enumerate(reward.valid) if ok]
    if metric in REWARD_METRICS:
        return [reward.rewards[i] for i in valid]
    if metric == "score":
        return [reward.rewards[i] - penalties[i] for i in valid]
    names = [metric] if metric != "acc" else ["acc", *ACCURACY_FUNCTIONS]
    for name in names:
        values = [_breakdown(reward.breakdown[i], name) for i in valid]
        if values and all(v is not None for v in values):
            return values  # type: ignore[return-value]
    if metric == "acc":  # verl's DAPO manager records a scalar score as `acc`
        return [reward.rewards[i] - penalties[i] for i in valid]
    known = sorted({k for b in reward.breakdown for k in b} | {"reward", "score", "acc"})
    raise ValueError(f"learner.algorithm.filter_groups.metric={metric!r}: the reward breakdown has no such value "
                     f"for every completion (known: {', '.join(known)})")


def _breakdown(values: dict[str, float], name: str) -> float | None:
    if name in values:
        return values[name]
    return next((v for k, v in values.items() if k.endswith("/" + name)), None)


def informative(values: Sequence[float]) -> bool:
    """verl keeps a group when np.std(metric) > 0; at least two valid completions are needed for any advantage."""
    return len(values) >= 2 and max(values) != min(values)


@dataclass
class FilterStats:
    """What filling one step with informative groups took (logged under filter_groups/)."""

    requested: int = 0
    """Prompts sampled for the step (the batch, and the replacements)."""
    filtered: int = 0
    """Groups dropped for zero spread."""
    waves: int = 0
    """Sampling calls made (the batch, then each set of replacements)."""
    kept: int = 0

    def as_metrics(self, batch_size: int, gen_batch_size: int) -> dict[str, float]:
        return {
            "filter_groups/filtered_groups": float(self.filtered),
            "filter_groups/extra_prompts": float(self.requested - batch_size),
            "filter_groups/requested_prompts": float(self.requested),
            "filter_groups/kept_groups": float(self.kept),
            "filter_groups/kept_frac": self.kept / max(self.kept + self.filtered, 1),
            # verl's train/num_gen_batches: generation batches this step's prompts amount to
            "filter_groups/num_gen_batches": float(math.ceil(self.requested / gen_batch_size)),
            "filter_groups/waves": float(self.waves),
        }


class TooFewInformativeGroups(RolloutError):
    """The cap on prompts per step was reached before the step had train_batch_size informative groups (the learner
    stops, as verl does)."""


# sample_wave(records, wave, on_scored) -> (scored groups in records' order, RolloutStats, reward busy s, (gen, tail))
SampleWave = Callable[[list, int, Callable[[int, Any], None]], Awaitable[tuple[list, Any, float, tuple[float, float]]]]


@dataclass
class _Fill:
    keep: Callable[[Any], bool]
    deficit: int = 0
    stats: FilterStats = field(default_factory=FilterStats)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


async def fill_informative(batch: list, draw: Callable[[int], list], sample_wave: SampleWave,
                           keep: Callable[[Any], bool], cap_prompts: int | None) -> tuple[list, Any, float, FilterStats,
                                                                                           tuple[float, float]]:
    """Sample `batch`, replacing every group `keep` rejects with a new prompt from `draw(k)` as soon as it is scored,
    until len(batch) groups are kept or `cap_prompts` prompts were sampled (then TooFewInformativeGroups).

    Returns the kept groups (first wave first, each wave in its prompts' order), the merged RolloutStats, the
    rewarder's busy seconds, the FilterStats, and (generate, reward tail) seconds as `sample_wave` reports them."""
    fill = _Fill(keep)
    waves: list[asyncio.Task] = []
    t0 = time.perf_counter()
    arrival: list[float] = []

    def launch(records: list) -> None:
        wave = len(waves)
        fill.stats.requested += len(records)
        fill.stats.waves += 1

        def on_scored(_i: int, scored: Any) -> None:
            if not fill.keep(scored):
                fill.stats.filtered += 1
                fill.deficit += 1
                fill.wake.set()

        async def run() -> tuple[list, Any, float, tuple[float, float]]:
            start = time.perf_counter() - t0
            out = await sample_wave(records, wave, on_scored)
            arrival.append(start + out[3][0])
            return out

        waves.append(asyncio.create_task(run(), name=f"dynamic-sampling-wave-{wave}"))

    launch(list(batch))
    try:
        while True:
            pending = [w for w in waves if not w.done()]
            if fill.deficit:
                room = fill.deficit if cap_prompts is None else min(fill.deficit, cap_prompts - fill.stats.requested)
                if room > 0:
                    fill.deficit -= room
                    launch(draw(room))
                    continue
            if not pending:
                break
            fill.wake.clear()
            waiter = asyncio.create_task(fill.wake.wait())
            try:
                done, _ = await asyncio.wait([*pending, waiter], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            for w in done:
                if w is not waiter and w.exception() is not None:
                    raise w.exception()
            await asyncio.sleep(0.02 if fill.deficit else 0)  # replacements of groups scored together: one call
        results = [w.result() for w in waves]
    finally:
        for w in waves:
            w.cancel()
        await asyncio.gather(*waves, return_exceptions=True)
    kept = [sg for scored, *_ in results for sg in scored if keep(sg)]
    fill.stats.kept = len(kept)
    stats = results[0][1]
    for _, s, *_ in results[1:]:
        stats.merge(s)
    busy = sum(r[2] for r in results)
    total = time.perf_counter() - t0
    generate = max(arrival) if arrival else 0.0
    if len(kept) < len(batch):
        raise TooFewInformativeGroups(
            f"{len(kept)} of {len(batch)} groups carry signal after sampling {fill.stats.requested} prompts, the cap "
            f"of learner.algorithm.filter_groups.max_num_gen_batches x gen_batch_size = {cap_prompts} (verl stops the "
            "same way: 'Generated too many. Please check if your data are too difficult.'); the task is too hard or "
            "too easy for the model, or raise max_num_gen_batches (0: no cap)")
    return kept[: len(batch)], stats, busy, fill.stats, (generate, max(total - generate, 0.0))
