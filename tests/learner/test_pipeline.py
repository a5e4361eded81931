"""The asynchronous rollout's bookkeeping (learner/rollout/pipeline.py) as plain functions: which batches start when,
with
which `min_weight_version`, what a checkpoint's data position is, and the staleness check. The sampling function
here stands in for the samplers + rewarder (tests/learner/test_async.py runs the real ones); it answers with real
Completion messages carrying the versions a sampler would report."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dgrpo.learner.rollout.client import RolloutStats
from dgrpo.learner.rollout.data import PromptRecord, PromptStream
from dgrpo.learner.rollout.pipeline import RolloutPipeline, first_version, staleness_metrics
from dgrpo.v1 import sampler_pb2


@dataclass
class Scored:
    record: PromptRecord
    group: sampler_pb2.Group


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(row=i, token_ids=(1, 2, i), prompt=f"p{i}") for i in range(n)]


class Sampler:
    """Answers each batch with completions sampled by `serving` (first version) and finished at `serving`."""

    def __init__(self, serving: int = 0, firsts: list[int | None] | None = None):
        self.calls: list[tuple[int, int, list[int]]] = []
        self.serving, self.firsts = serving, list(firsts or [])

    async def __call__(self, batch, step, min_version):
        self.calls.append((step, min_version, [r.row for r in batch]))
        forced = self.firsts.pop(0) if self.firsts else None
        await asyncio.sleep(0)
        first = forced if forced is not None else max(self.serving, min_version)
        groups = [sampler_pb2.Group(prompt_id=f"s{step}-{i}", completions=[
            sampler_pb2.Completion(token_ids=[5, 6, 7], weight_version=max(self.serving, min_version),
                                   first_weight_version=first)]) for i in range(len(batch))]
        return [Scored(r, g) for r, g in zip(batch, groups, strict=True)], RolloutStats(calls=1), 0.0


def test_fill_keeps_k_batches_ahead_with_their_version_floor():
    async def scenario():
        data = PromptStream(_records(20), 2, shuffle=False)
        sampler = Sampler()
        pipe = RolloutPipeline(data, sampler, max_staleness=2)
        pipe.fill(next_step=1, version=0, last_step=10)
        # Steps 1..3 start at once: step j trains from version j-1 and accepts samples >= j-1-2.
        assert [(s, v) for s, v, _ in sampler.calls] == []  # tasks not run yet
        await asyncio.sleep(0)
        assert [(s, v) for s, v, _ in sampler.calls] == [(1, 0), (2, 0), (3, 0)]
        taken = await pipe.take(1, version=0)
        assert [sg.record.row for sg in taken.scored] == [0, 1] and taken.data_before == {
            "epoch": 0, "index": 0, "seed": 0, "size": 20}
        # A checkpoint after step 1 resumes before step 2's batch (in flight, sampled again on resume).
        assert pipe.data_position()["index"] == 2
        pipe.fill(next_step=2, version=1, last_step=10)  # version 1 published: step 4 may start (floor 4-1-2 = 1)
        await asyncio.sleep(0)
        assert sampler.calls[-1][:2] == (4, 1)
        for step in (2, 3, 4):
            await pipe.take(step, version=step - 1)
        pipe.fill(next_step=5, version=4, last_step=6)  # never past the last step
        await asyncio.sleep(0)
        assert [s for s, _, _ in sampler.calls] == [1, 2, 3, 4, 5, 6]
        await pipe.cancel()
        assert pipe.data_position() is None and data.state_dict()["index"] == 12

    asyncio.run(scenario())


def test_groups_older_than_k_are_dropped_and_sampled_again():
    async def scenario():
        data = PromptStream(_records(10), 2, shuffle=False)
        # The first call is answered by a replica stuck on version 0, the resample by one at the current version.
        sampler = Sampler(firsts=[0, None])
        pipe = RolloutPipeline(data, sampler, max_staleness=1)
        pipe.fill(next_step=1, version=3, last_step=1)
        taken = await pipe.take(1, version=3)  # floor 3 - 1 = 2 > 0: both groups too old
        assert taken.dropped_groups == 2
        assert sampler.calls[-1][:2] == (1, 3)  # sampled again at the current version
        assert all(first_version(c) >= 2 for sg in taken.scored for c in sg.group.completions)
        await pipe.cancel()

    asyncio.run(scenario())


def test_staleness_metrics_use_each_completions_first_version():
    g = sampler_pb2.Group(completions=[
        sampler_pb2.Completion(token_ids=[1, 2, 3], weight_version=5, first_weight_version=3),  # spans 3..5
        sampler_pb2.Completion(token_ids=[1], weight_version=5),  # an older sampler: no first version
    ])
    m = staleness_metrics([Scored(None, g)], version=5)
    assert m["staleness/max"] == 2 and m["staleness/oldest_version"] == 3
    assert m["staleness/mean"] == (2 * 3 + 0 * 1) / 4
    assert m["staleness/spanning_completions"] == 1
