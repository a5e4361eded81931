"""A step's groups: sampled from the replicas and scored as each arrives (`GroupCollector`), then the Sequences the
actor trains on, with group-normalized advantages (`to_sequences`).

Rank 0 alone collects. One `Generate` fan-out is a wave; with DAPO's dynamic sampling (algorithm.filter_groups) a
training batch takes further waves of new prompts in place of the groups whose rewards do not differ
(learner/rollout/dapo.py). Scoring overlaps generation: a group goes to the rewarder the moment its replica streams it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dgrpo.learner.config import LearnerConfig
from dgrpo.learner.rollout import dapo
from dgrpo.learner.rollout.client import RolloutClient, RolloutStats, make_prompt, sampling_params
from dgrpo.learner.rollout.data import PromptRecord
from dgrpo.learner.rollout.reward_client import GroupReward, RewardClient, score_group
from dgrpo.learner.update import grpo
from dgrpo.learner.update.batch import Sequence
from dgrpo.v1 import rewarder_pb2, sampler_pb2


@dataclass
class ScoredGroup:
    """One prompt's group as sampled and scored."""

    record: PromptRecord
    group: sampler_pb2.Group
    reward: GroupReward


@dataclass
class Collected:
    """A batch's groups in batch order (not arrival order: the update must not depend on which replica was faster),
    and what collecting them cost."""

    scored: list[ScoredGroup]
    stats: RolloutStats
    reward_busy_s: float
    """Seconds the rewarder spent on this batch's groups (overlapping generation)."""
    generate_s: float
    """Until the last group arrived."""
    reward_tail_s: float
    """Scoring after the last group arrived: what generation did not hide."""


class GroupCollector:
    """Streams a batch's groups from the samplers at a weight version and scores each the moment it arrives."""

    def __init__(self, cfg: LearnerConfig, rollout: RolloutClient, rewarder: RewardClient,
                 draw: Callable[[int], list[PromptRecord]],
                 trainer_state: Callable[[], rewarder_pb2.RewardTrainerState]):
        self.cfg = cfg
        self.rollout, self.rewarder = rollout, rewarder
        self._draw = draw  # new prompts in place of filtered groups (the training data stream)
        self._trainer_state = trainer_state  # TRL's trainer_state, as the reward functions see it
        self._filter_metrics: dict[int, dict[str, float]] = {}  # step -> dynamic sampling's counts

    async def collect_training(self, batch: list[PromptRecord], step: int, min_version: int) -> Collected:
        """Step `step`'s batch sampled at >= `min_version`; with filter_groups on, only informative groups."""
        params = sampling_params(self.cfg.rollout, step=step)
        prefix = f"s{step}-"
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return await self._wave(batch, params, prefix=prefix, min_version=min_version)
        keep = lambda sg: dapo.informative(dapo.group_metric(sg.reward, fg.metric))
        unit = fg.gen_batch_size or self.cfg.data.train_batch_size

        def wave_params(wave: int) -> sampler_pb2.SamplingParams:
            """A seeded run gives each wave of replacements its own seed: with the first wave's, a replacement
            could repeat the very samples that made the group it replaces flat."""
            if not wave or not params.HasField("seed"):
                return params
            out = sampler_pb2.SamplingParams()
            out.CopyFrom(params)
            out.seed = params.seed + 1_000_003 * wave
            return out

        async def wave(records: list[PromptRecord], n: int, on_scored) -> tuple:
            c = await self._wave(records, wave_params(n), prefix=f"{prefix}w{n}-", min_version=min_version,
                                 on_scored=on_scored)
            return c.scored, c.stats, c.reward_busy_s, (c.generate_s, c.reward_tail_s)

        scored, stats, busy, fstats, (generate_s, tail_s) = await dapo.fill_informative(
            batch, self._draw, wave, keep, fg.max_num_gen_batches * unit or None)
        new = fstats.as_metrics(len(batch), unit)
        old = self._filter_metrics.setdefault(step, {})
        for key, value in new.items():  # a stale group sampled again (pipeline.take) adds to its step's counts
            old[key] = old.get(key, 0.0) + value if key != "filter_groups/kept_frac" else value
        return Collected(scored, stats, busy, generate_s, tail_s)

    async def collect_validation(self, batch: list[PromptRecord], after_step: int, min_version: int) -> Collected:
        """Greedy completions (one per prompt) of the validation prompts, scored."""
        return await self._wave(batch, sampling_params(self.cfg.rollout, greedy=True), prefix=f"v{after_step + 1}-",
                                min_version=min_version)

    def filter_metrics(self, step: int) -> dict[str, float]:
        """Dynamic sampling's counts for step `step` (once: they are handed over with the step's metrics)."""
        return self._filter_metrics.pop(step, {})

    async def _wave(self, batch: list[PromptRecord], params: sampler_pb2.SamplingParams, *, prefix: str,
                    min_version: int, on_scored: Callable[[int, ScoredGroup], None] | None = None) -> Collected:
        """One Generate fan-out: every group of `batch` scored on arrival (and shaped by the overlong penalty);
        `on_scored(i, ScoredGroup)` is told of each as it is scored."""
        prompts = [make_prompt(f"{prefix}{i}", rec.token_ids) for i, rec in enumerate(batch)]
        stats = RolloutStats()
        scoring: dict[int, asyncio.Task] = {}
        groups: dict[int, sampler_pb2.Group] = {}
        busy = [0.0]

        async def score(i: int, group: sampler_pb2.Group) -> GroupReward:
            t0 = time.perf_counter()
            rec = batch[i]
            multi_turn = any(c.messages for c in group.completions)
            result = await self.rewarder.score(score_group(
                group.prompt_id, rec.prompt, [c.text for c in group.completions], rec.extra,
                [c.token_ids for c in group.completions],
                [c.messages for c in group.completions] if multi_turn else None), self._trainer_state())
            busy[0] += time.perf_counter() - t0
            dapo.apply_overlong(result, [len(c.token_ids) for c in group.completions],
                                self.cfg.algorithm.overlong_buffer, self.cfg.rollout.max_response_length)
            if on_scored is not None:
                on_scored(i, ScoredGroup(rec, group, result))
            return result

        t0 = time.perf_counter()
        try:
            async for group in self.rollout.generate(prompts, params, min_weight_version=min_version, stats=stats):
                i = int(group.prompt_id.removeprefix(prefix))
                groups[i] = group
                scoring[i] = asyncio.create_task(score(i, group))
            t1 = time.perf_counter()
            rewards = dict(zip(scoring, await asyncio.gather(*scoring.values()), strict=True))
        finally:  # on a failure, no scoring call outlives the step
            for task in scoring.values():
                task.cancel()
        t2 = time.perf_counter()
        scored = [ScoredGroup(batch[i], groups[i], rewards[i]) for i in range(len(batch))]
        return Collected(scored, stats, busy[0], t1 - t0, t2 - t1)


def to_sequences(scored: list[ScoredGroup], cfg: LearnerConfig, eos_id: int) -> tuple[list[Sequence], torch.Tensor]:
    """The Sequences the actor trains on (groups contiguous), with group-normalized advantages; and the rewards
    [B*G] they were computed from."""
    algo, n = cfg.algorithm, cfg.rollout.n
    rewards = torch.tensor([r for sg in scored for r in sg.reward.rewards], dtype=torch.float32)  # [B*G]
    valid = torch.tensor([ok for sg in scored for ok in sg.reward.valid], dtype=torch.bool)  # [B*G]
    # Completions without a reward (ERROR, or every function returned None) stay out of the baselines.
    advantages = grpo.group_advantages(rewards, n, algo.adv_scale, algo.adv_eps, valid=valid)  # [B*G]
    sequences: list[Sequence] = []
    completions = [(sg, c, ok) for sg in scored
                   for c, ok in zip(sg.group.completions, sg.reward.valid, strict=True)]
    for (sg, c, ok), adv in zip(completions, advantages.tolist(), strict=True):
        ids, logprobs = list(c.token_ids), list(c.logprobs)
        if not ids:  # an aborted completion: keep the group's shape, train on nothing
            ids, logprobs, ok = [eos_id], [0.0], False
        sequences.append(Sequence(
            prompt_ids=list(sg.group.prompt_token_ids) or list(sg.record.token_ids),
            completion_ids=ids,
            # A completion the rewarder could not score has no valid reward: out of the loss entirely.
            advantage=adv if ok else 0.0,
            sampler_logprobs=logprobs if len(logprobs) == len(ids) else None,
            truncated=c.finish_reason == sampler_pb2.FINISH_REASON_LENGTH,
            in_loss=ok,
            tool_mask=list(c.mask) if len(c.mask) == len(ids) else None,  # multi-turn: tool tokens are 0
        ))
    return sequences, rewards
