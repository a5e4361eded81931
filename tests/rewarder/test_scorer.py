"""The Scorer with real worker processes: user files, async functions, failures, policies, hot swap, models."""

from __future__ import annotations

import asyncio
import json

import pytest

from dgrpo.rewarder.config import RewarderConfig
from dgrpo.rewarder.scorer import GroupInput, RequestError, Scorer, ScoringFailed
from dgrpo.rewarder.spec import SpecError

from .conftest import file_fn

pytestmark = pytest.mark.slow


def make_scorer(functions: list[dict], **cfg) -> Scorer:
    return Scorer(RewarderConfig.model_validate({"spec": {"name": "test", "functions": functions}, **cfg}))


def run(coro):
    return asyncio.run(coro)


def test_trl_file_async_none_chat_and_weights(child_processes, reward_file):
    async def scenario():
        scorer = make_scorer([
            {"type": "math_verify", "weight": 2.0},
            file_fn(reward_file, "answer_in_completion", weight=0.5),
            file_fn(reward_file, "async_length", weight=0.0),
            file_fn(reward_file, "only_long", weight=10.0),
        ], workers=1)
        ref = await scorer.start()
        try:
            groups = [
                GroupInput("q1", "1+2?", ["it is 3", "\\boxed{4}"], {"answer": 3}),
                GroupInput("q2", "2+2?", ["4", "five"], {"answer": 4}),
            ]
            result = await scorer.score(groups, group_size=2)
            chat = await scorer.score([GroupInput("c", [{"role": "user", "content": "hi"}], ["hello", "yo"])],
                                      group_size=0)
        finally:
            await scorer.close()
        return ref, result, chat

    ref, result, chat = run(scenario())
    assert result.spec == ref and ref.version == 1 and len(ref.content_hash) == 64
    first, second = result.groups[0]
    # 2*1 (math) + 0.5*1 (answer in text) + 0*7 (length) + 10*1 (len 7 > 5)
    assert first.ok and first.reward == pytest.approx(12.5)
    assert first.breakdown == {"math_verify": 1.0, "answer_in_completion": 1.0, "async_length": 7.0, "only_long": 1.0}
    # "\\boxed{4}": math 0, "3" not in it, 9 chars -> only_long 1.0
    assert second.breakdown["math_verify"] == 0.0 and second.reward == pytest.approx(10.0)
    short = result.groups[1][0]  # "4": only_long is None -> absent and left out of the sum
    assert "only_long" not in short.breakdown and short.reward == pytest.approx(2.0 + 0.5)
    assert [s.ok for s in chat.groups[0]] == [False, False]  # math_verify needs `answer`: the error names it
    assert "'answer' is missing" in chat.groups[0][0].message


def test_conversational_format_reaches_user_functions(child_processes, reward_file):
    async def scenario():
        scorer = make_scorer([file_fn(reward_file, "conversational")], workers=1)
        await scorer.start()
        try:
            return await scorer.score([GroupInput("c", [{"role": "user", "content": "hi"}], ["a", "b"])])
        finally:
            await scorer.close()

    assert [s.reward for s in run(scenario()).groups[0]] == [1.0, 1.0]


def test_failures_are_per_completion_and_the_pool_heals(child_processes, reward_file):
    from prometheus_client import REGISTRY

    def timeouts(function: str) -> float:
        return REGISTRY.get_sample_value("dgrpo_rewarder_function_timeouts_total", {"function": function}) or 0.0

    before = {f: timeouts(f) for f in ("hangs", "crashes")}

    async def scenario():
        scorer = make_scorer([
            {"type": "length", "max_length": 100},
            file_fn(reward_file, "hangs", timeout_s=1.5),
            file_fn(reward_file, "crashes"),
            file_fn(reward_file, "bad_values"),
        ], workers=2)
        await scorer.start()
        try:
            groups = [
                GroupInput("fine", "p", ["a", "b", "c", "d"]),
                GroupInput("hang", "p", ["hang", "b", "c", "d"]),
                GroupInput("crash", "p", ["crash", "b", "c", "d"]),
            ]
            result = await scorer.score(groups)
            for _ in range(100):  # both dead workers come back
                if scorer.workers_alive == 2 and scorer._active.pool._idle.qsize() == 2:
                    break
                await asyncio.sleep(0.1)
            alive = scorer.workers_alive
            again = await scorer.score([GroupInput("fine", "p", ["a", "b", "c", "d"])])
        finally:
            await scorer.close()
        return result, alive, again

    result, alive, again = run(scenario())
    fine, hang, crash = result.groups
    # bad_values: NaN, inf, "high", then a good value; only that function's bad completions fail.
    assert [s.ok for s in fine] == [False, False, False, True]
    assert "not finite" in fine[0].message and "'high'" in fine[2].message
    assert fine[3].reward == pytest.approx(1.0 + 0.5 + 0.25 + 1.0)
    assert all(not s.ok for s in hang) and "'hangs' timed out after 1.5s" in hang[1].message
    assert all(not s.ok for s in crash) and "exit code 7" in crash[1].message
    assert hang[1].breakdown["length"] == 1.0 and hang[1].reward == 0.0
    assert alive == 2
    # Prometheus: the hung call counts as a timeout, the crash does not.
    assert (timeouts("hangs") - before["hangs"], timeouts("crashes") - before["crashes"]) == (1.0, 0.0)
    assert [s.ok for s in again.groups[0]] == [False, False, False, True]


def test_error_policies(child_processes, reward_file):
    async def scenario(policy):
        scorer = make_scorer([{"type": "length"}, file_fn(reward_file, "raises"), file_fn(reward_file, "wrong_count")],
                             workers=1, on_error=policy)
        await scorer.start()
        try:
            return await scorer.score([GroupInput("g", "p", ["a", "b"])])
        finally:
            await scorer.close()

    zero = run(scenario("zero")).groups[0][0]
    assert zero.ok and zero.reward == 1.0 and zero.breakdown == {"length": 1.0}
    assert "'raises' raised ValueError: no reward today" in zero.message
    assert "'wrong_count' returned 1 values for 2 completions" in zero.message
    with pytest.raises(ScoringFailed, match="no reward today"):
        run(scenario("fail_request"))


def test_malformed_requests(reward_file):
    scorer = make_scorer([{"type": "length"}], max_completions_per_request=4, max_request_chars=100)
    cases = {
        "no groups": [],
        "has no completions": [GroupInput("a", "p", [])],
        "duplicate prompt_id": [GroupInput("a", "p", ["x"]), GroupInput("a", "p", ["y"])],
        "group_size is 2": [GroupInput("a", "p", ["x"])],
        "max_completions_per_request=4": [GroupInput("a", "p", ["x", "y"]), GroupInput("b", "p", ["x", "y", "z"])],
        "max_request_chars=100": [GroupInput("a", "p" * 99, ["xy"])],
        "clashes": [GroupInput("a", "p", ["x"], {"completions": 1})],
        "column 'trainer_state' clashes": [GroupInput("a", "p", ["x"], {"trainer_state": 1})],
        "2 completion_ids entries for 1 completions": [GroupInput("a", "p", ["x"], {}, [[1], [2]])],
    }
    for message, groups in cases.items():
        with pytest.raises(RequestError, match=message):
            scorer.validate(groups, group_size=2 if message == "group_size is 2" else 0)


def test_reload_under_load_zero_failures_and_right_attribution(child_processes, tmp_path):
    slow_const = (
        "import time\ndef reward_func(prompts, completions, **kw):\n    time.sleep(0.02)\n"
        "    return [{v}] * len(completions)\n"
    )
    v1, v2 = tmp_path / "v1.py", tmp_path / "v2.py"
    v1.write_text(slow_const.format(v=1.0))
    v2.write_text(slow_const.format(v=2.0))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('import-time failure')\n")

    async def scenario():
        scorer = make_scorer([file_fn(v1, "reward_func")], workers=2)
        await scorer.start()
        responses, rejects = [], []

        done = asyncio.Event()
        old_procs = [w.proc for w in scorer._active.pool._all]

        async def client(k):
            i = after = 0
            while after < 3:  # keep the load on until a few requests after the swap
                groups = [GroupInput(f"{k}-{i}-{j}", "p", ["a", "b", "c", "d"]) for j in range(3)]
                responses.append(await scorer.score(groups, group_size=4))
                i, after = i + 1, after + done.is_set()

        async def reloader():
            await asyncio.sleep(0.3)
            for bad in [file_fn(broken, "reward_func"), file_fn(v2, "nope"), file_fn(tmp_path / "missing.py", "f")]:
                try:
                    await scorer.reload(json.dumps({"functions": [bad]}))
                except SpecError as e:
                    rejects.append(str(e))
            swapped = await scorer.reload(json.dumps({"name": "v2", "functions": [file_fn(v2, "reward_func")]}))
            unchanged = await scorer.reload(json.dumps({"name": "v2", "functions": [file_fn(v2, "reward_func")]}))
            done.set()
            return swapped, unchanged

        try:
            *_, (swapped, unchanged) = await asyncio.gather(*[client(k) for k in range(4)], reloader())
            for _ in range(50):  # the old pool closes once its last request is done
                if all(p.poll() is not None for p in old_procs):
                    break
                await asyncio.sleep(0.1)
            old_pool_closed = len(old_procs) == 2 and all(p.poll() is not None for p in old_procs)
        finally:
            await scorer.close()
        return responses, rejects, swapped, unchanged, old_pool_closed

    responses, rejects, swapped, unchanged, old_pool_closed = run(scenario())
    assert old_pool_closed
    assert len(rejects) == 3
    assert "does not import: RuntimeError at line 1 " in rejects[0] and "import-time failure" not in rejects[0]
    assert "has no function 'nope'" in rejects[1] and "does not exist" in rejects[2]
    new, old, changed = swapped
    assert changed and old.version == 1 and new.version == 2 and new.name == "v2"
    assert unchanged == (new, new, False)
    versions = {r.spec.version for r in responses}
    assert versions == {1, 2}, "the load must span the swap"
    for r in responses:
        expected = {1: 1.0, 2: 2.0}[r.spec.version]
        assert all(s.ok and s.reward == expected for g in r.groups for s in g)


def test_reward_model_batching_truncation_and_service(child_processes, tiny_reward_model):
    from dgrpo.rewarder.config import ModelFunction
    from dgrpo.rewarder.reward_model import RewardModel

    texts = ["short", "a much longer completion " * 5, "mid length text here", "x"]
    prompts = ["Q: "] * 4
    rm = RewardModel(ModelFunction(type="model", path=str(tiny_reward_model), max_tokens_per_batch=4096))
    batched = rm(prompts, texts)
    rm.cfg = rm.cfg.model_copy(update={"max_tokens_per_batch": 8})  # one row per forward pass
    one_by_one = rm(prompts, texts)
    assert one_by_one == pytest.approx(batched, abs=1e-4) and len({round(v, 5) for v in batched}) == 4
    # Left truncation keeps the end: two texts that differ only before the last 16 tokens score the same.
    rm.cfg = rm.cfg.model_copy(update={"max_length": 16})
    tail = " the same ending tokens for both of these" * 3
    s1, s2 = rm(["A"] * 2, ["first start " * 10 + tail, "other opening " * 10 + tail])
    assert s1 == pytest.approx(s2, abs=1e-5)
    rm.cfg = rm.cfg.model_copy(update={"max_length": 2048})
    chat = rm([[{"role": "user", "content": "hi"}]], [[{"role": "assistant", "content": "short"}]])
    assert len(chat) == 1 and chat[0] != pytest.approx(batched[0])

    async def scenario():
        scorer = make_scorer([{"type": "model", "path": str(tiny_reward_model), "weight": 2.0}], workers=1)
        await scorer.start()
        try:
            return await scorer.score([GroupInput(f"g{i}", "Q: ", texts) for i in range(3)])
        finally:
            await scorer.close()

    result = run(scenario())
    for group in result.groups:
        assert [s.reward for s in group] == pytest.approx([2 * v for v in batched], abs=1e-4)
        assert group[0].breakdown == {"reward_model": pytest.approx(batched[0], abs=1e-4)}
