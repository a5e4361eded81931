"""Reward functions as TRL and verl users have them, run by real worker processes: verl's compute_score file (numbers,
dicts, reward_kwargs, verl's dataset columns), TRL's keywords (completion_ids, trainer_state, log_metric, log_extra)
and booleans, a package with relative imports, a function named by import path (and who may name one), the
all-None completion, and errors that name the user's file and line. Then the same over gRPC with the learner's
client (trainer_state, completion_ids, metrics and NO_REWARD through the protos)."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
import yaml

from dgrpo.rewarder.config import RewarderConfig
from dgrpo.rewarder.scorer import GroupInput, Scorer
from dgrpo.rewarder.spec import SpecError

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rewards" / "verl_style.py"

# A verl custom_reward_function file, written as verl's docs and examples write them.
VERL_FILE = '''
import re


def extract_solution(solution_str):
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None, format_score=0.0, score=1.0):
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    pred = extract_solution(solution_str)
    correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred or "", "split": extra_info["split"],
            "source_is_gsm8k": data_source == "openai/gsm8k"}


def bad_score(data_source, solution_str, ground_truth, extra_info=None):
    if "raise" in solution_str:
        return {"score": 1.0}["missing"]
    return "high"
'''

# A TRL reward file: TRL's soft overlong punishment (its rewards module, as TRL writes it) plus functions using
# trainer_state, log_metric, log_extra and returning booleans.
TRL_FILE = '''
def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        rewards = []
        for ids in completion_ids:
            completion_length = len(ids)
            if completion_length <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif max_completion_len - soft_punish_cache < completion_length <= max_completion_len:
                rewards.append((max_completion_len - soft_punish_cache - completion_length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards

    return soft_overlong_punishment_reward


soft_overlong = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)


def step_shaped(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, solution, **kwargs):
    correct = [c.strip() == s for c, s in zip(completions, solution)]
    log_metric("accuracy", sum(correct) / len(correct))
    log_extra("length", [len(c) for c in completions])
    log_extra("note", ["text is not a number"] * len(completions))
    ramp = min(1.0, trainer_state.global_step / max(trainer_state.max_steps, 1))
    return [ramp if ok else 0.0 for ok in correct]


def is_correct(prompts, completions, solution, **kwargs):
    return [c.strip() == s for c, s in zip(completions, solution)]


def never(prompts, completions, **kwargs):
    return [None] * len(completions)
'''


def run(coro):
    return asyncio.run(coro)


async def _score(functions, groups, state=None, **cfg):
    scorer = Scorer(RewarderConfig.model_validate({"spec": {"name": "peers", "functions": functions},
                                                   "workers": 1, **cfg}))
    await scorer.start()
    try:
        return await scorer.score(groups, trainer_state=state)
    finally:
        await scorer.close()


def verl_group(completions, ground_truth="72"):
    """One group with the columns of verl's gsm8k parquet (examples/data_preprocess/gsm8k.py)."""
    return GroupInput("g0", [{"role": "user", "content": "Natalia sold clips... Let's think step by step."}],
                      completions, {
                          "data_source": "openai/gsm8k", "ability": "math",
                          "reward_model": {"style": "rule", "ground_truth": ground_truth},
                          "extra_info": {"split": "train", "index": 0, "answer": "... #### 72", "question": "q"},
                      })


def test_verl_compute_score_file_in_verls_spelling(child_processes, tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_FILE)
    functions = [
        {"type": "python", "path": str(path), "name": "compute_score"},  # custom_reward_function, as verl spells it
        {"type": "python", "path": str(path), "name": "half", "function": "compute_score",
         "reward_kwargs": {"score": 0.5}},  # verl's custom_reward_function.reward_kwargs
        {"type": "python", "path": str(path), "name": "compute_score_dict", "weight": 2.0},
        {"type": "python", "path": str(EXAMPLE), "name": "example", "function": "compute_score"},
    ]
    result = run(_score(functions, [verl_group(["so #### 72", "#### 71", "no idea"])]))
    right, wrong, none = result.groups[0]
    assert right.ok and right.reward == pytest.approx(1.0 + 0.5 + 2.0 + 1.0)
    assert right.breakdown == {"compute_score": 1.0, "half": 0.5, "compute_score_dict": 1.0,
                               "compute_score_dict/acc": 1.0, "compute_score_dict/source_is_gsm8k": 1.0,
                               "example": 1.0, "example/formatted": 1.0}
    assert wrong.reward == pytest.approx(0.0 + 0.0 - 2.0 + 0.0) and wrong.breakdown["compute_score_dict/acc"] == 0.0
    assert none.breakdown["compute_score"] == 0.0 and none.breakdown["example/formatted"] == 0.0  # verl's int 0


def test_verl_errors_name_the_file_and_line(child_processes, tmp_path):
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_FILE)
    fn = {"type": "python", "path": str(path), "name": "bad_score"}
    result = run(_score([fn], [verl_group(["fine", "raise"])]))
    unusable, raised = result.groups[0]
    assert not unusable.ok and "returned 'high' (str), not a number" in unusable.message
    assert f"{path}:" in unusable.message and "(bad_score)" in unusable.message  # where the function is defined
    line = VERL_FILE.splitlines().index('        return {"score": 1.0}["missing"]') + 1
    assert not raised.ok and f"raised KeyError: 'missing' (at {path}:{line})" in raised.message
    # A group without verl's ground truth: the error says where verl takes it from.
    missing = run(_score([{"type": "python", "path": str(path)}], [GroupInput("g", "q", ["#### 1"], {"answer": 1})]))
    assert "reward_model.ground_truth" in missing.groups[0][0].message


def test_trl_keywords_booleans_and_none(child_processes, tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_FILE)
    file = {"type": "file", "path": str(path)}
    functions = [{**file, "function": "soft_overlong"}, {**file, "function": "step_shaped"},
                 {**file, "function": "is_correct", "weight": 0.5}]
    group = GroupInput("g", "2+2?", ["4", "5", "4 "], {"solution": "4"}, completion_ids=[[1, 2], [1, 2, 3], [1] * 9])
    result = run(_score(functions, [group], state={"global_step": 3, "max_steps": 4, "epoch": 0.0}))
    a, b, c = result.groups[0]
    # soft overlong (max 4, cache 2): 2 tokens -> 0, 3 tokens -> -0.5, 9 tokens -> -1
    assert [s.breakdown["soft_overlong"] for s in (a, b, c)] == [0.0, -0.5, -1.0]
    assert a.breakdown["step_shaped"] == pytest.approx(0.75)  # trainer_state.global_step / max_steps
    assert a.breakdown["is_correct"] == 1.0 and b.breakdown["is_correct"] == 0.0  # booleans are 1 / 0
    assert a.reward == pytest.approx(0.0 + 0.75 + 0.5) and b.reward == pytest.approx(-0.5)
    assert a.breakdown["step_shaped/length"] == 1.0 and "step_shaped/note" not in a.breakdown  # log_extra
    assert result.metrics == [{"accuracy": pytest.approx(2 / 3)}]  # log_metric
    # Every function None for a completion: no reward (left out of baselines), unlike one None among others.
    nothing = run(_score([{**file, "function": "never"}], [GroupInput("n", "q", ["x", "y"])]))
    assert all(s.ok and s.no_reward and s.reward == 0.0 and s.breakdown == {} for s in nothing.groups[0])
    mixed = run(_score([{**file, "function": "never"}, {**file, "function": "is_correct"}],
                       [GroupInput("m", "q", ["4"], {"solution": "4"})]))
    assert not mixed.groups[0][0].no_reward and mixed.groups[0][0].reward == 1.0


def test_package_with_relative_imports(child_processes, tmp_path):
    pkg = tmp_path / "my_rewards"
    (pkg / "scoring").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring" / "__init__.py").write_text("")
    (pkg / "utils.py").write_text("def normalize(s):\n    return s.strip().lower()\n")
    (pkg / "scoring" / "reward.py").write_text(textwrap.dedent('''
        from ..utils import normalize
        from . import weights


        def reward_func(prompts, completions, answer, **kwargs):
            return [weights.FULL if normalize(c) == normalize(a) else 0.0 for c, a in zip(completions, answer)]
    '''))
    (pkg / "scoring" / "weights.py").write_text("FULL = 1.0\n")
    fn = {"type": "file", "path": str(pkg / "scoring" / "reward.py")}
    # The package's root must lie in an allowed folder (its __init__ files run too).
    result = run(_score([fn], [GroupInput("g", "q", [" Paris ", "Rome"], {"answer": "paris"})],
                        allowed_dirs=[str(tmp_path)]))
    assert [s.reward for s in result.groups[0]] == [1.0, 0.0]
    # The package is taken only as far up as the allowed folder: above it, `..` has no parent package.
    limited = Scorer(RewarderConfig.model_validate({"spec": {"functions": [fn]}, "workers": 1,
                                                    "allowed_dirs": [str(pkg / "scoring")]}))
    with pytest.raises(SpecError, match=r"does not import: ImportError at line 2"):
        run(limited.start())


def test_module_functions_and_who_may_name_them(child_processes, tmp_path, monkeypatch):
    lib = tmp_path / "site"
    (lib / "acme_rewards").mkdir(parents=True)
    (lib / "acme_rewards" / "__init__.py").write_text("")
    (lib / "acme_rewards" / "math.py").write_text(
        "def accuracy_reward(completions, solution, **kwargs):\n"
        "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    monkeypatch.setenv("PYTHONPATH", str(lib))  # installed: importable in the workers' environment
    spec = {"name": "m", "functions": [{"type": "file", "module": "acme_rewards.math:accuracy_reward"}]}

    async def scenario():
        scorer = Scorer(RewarderConfig.model_validate({"spec": spec, "workers": 1}))
        await scorer.start()
        try:
            scored = await scorer.score([GroupInput("g", "q", ["4", "5"], {"solution": "4"})])
            info = scorer.active.functions()[0]
            refusals = []
            for module in ("os:system", "subprocess:run", "acme_rewards_evil:f", "acme:f"):  # not named at start
                text = yaml.safe_dump({"functions": [{"type": "file", "module": module}]})
                with pytest.raises(SpecError) as e:
                    await scorer.reload(text)
                refusals.append(str(e.value))
            # The submodule of an allowed module is allowed (here: missing, named by its import error).
            with pytest.raises(SpecError, match="no module named 'acme_rewards.math.nope'"):
                await scorer.reload(yaml.safe_dump({"functions": [
                    {"type": "file", "module": "acme_rewards.math.nope:f"}]}))
            return scored, info, refusals, scorer.active_ref
        finally:
            await scorer.close()

    scored, info, refusals, ref = run(scenario())
    assert [s.reward for s in scored.groups[0]] == [1.0, 0.0]
    assert (info.name, info.source) == ("accuracy_reward", "acme_rewards.math:accuracy_reward")
    assert all("rewarder.allowed_modules: acme_rewards.math" in r and "is not a module" in r for r in refusals)
    assert ref.version == 1  # nothing refused became active
    # allowed_modules [] forbids even the spec at start; an explicit list allows what it names.
    with pytest.raises(SpecError, match="allowed_modules: none"):
        run(Scorer(RewarderConfig.model_validate({"spec": spec, "allowed_modules": []})).start())
    explicit = run(_score(spec["functions"], [GroupInput("g", "q", ["4"], {"solution": "4"})],
                          allowed_modules=["acme_rewards"]))
    assert explicit.groups[0][0].reward == 1.0


async def _score_over_grpc(config: RewarderConfig, group, state=None):
    """One group scored by a real rewarder server through the learner's client."""
    from dgrpo.learner.rollout.reward_client import RewardClient
    from dgrpo.rewarder.server import create_server

    server, scorer = create_server(config)
    await server.start()
    await scorer.start()
    client = RewardClient(f"127.0.0.1:{server.port}", timeout_s=30)
    try:
        return await client.score(group, state)
    finally:
        await client.close()
        await scorer.close()
        await server.stop(0)


def test_over_grpc_with_the_learner_client(child_processes, tmp_path):
    """trainer_state, completion_ids, log_metric and NO_REWARD through the protos, learner client to real server."""
    from dgrpo.learner.rollout.reward_client import score_group
    from dgrpo.v1 import rewarder_pb2

    path = tmp_path / "trl_rewards.py"
    path.write_text(textwrap.dedent('''
        def ids_or_none(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
            log_metric("step", trainer_state.global_step)
            return [None if c == "x" else float(len(ids)) for c, ids in zip(completions, completion_ids)]
    '''))
    config = RewarderConfig.model_validate({"port": 0, "workers": 1, "spec": {"functions": [
        {"type": "file", "path": str(path), "function": "ids_or_none"}]}})

    group = score_group("g", "q", ["four", "x"], {"solution": "4"}, [[5, 6, 7], [8]])
    reward = run(_score_over_grpc(config, group, rewarder_pb2.RewardTrainerState(global_step=7, max_steps=9)))
    assert reward.breakdown == [{"ids_or_none": 3.0}, {}] and reward.metrics == {"step": 7.0}
    # "x": every function None -> NO_REWARD: not valid (no baseline share, advantage 0), and not an error.
    assert reward.valid == [True, False] and reward.no_reward == [False, True] and reward.errors == []
    assert reward.rewards == [3.0, 3.0]  # the group mean of the valid rewards, as for errors


def test_multi_turn_conversations_reach_the_functions(child_processes, tmp_path):
    """Multi-turn completions (the sampler's turns after the prompt, tool calls and results included) reach TRL-style
    functions as message lists over the protos; rules and verl's compute_score read the last assistant turn, also
    when the conversation was cut off after a tool result."""
    from dgrpo.learner.rollout.reward_client import score_group
    from dgrpo.v1 import sampler_pb2

    path = tmp_path / "tool_rewards.py"
    path.write_text(textwrap.dedent('''
        def used_the_calculator(prompts, completions, **kwargs):
            out = []
            for turns in completions:
                calls = [c for m in turns if m["role"] == "assistant" for c in m.get("tool_calls", [])]
                tool_said = [m["content"] for m in turns if m["role"] == "tool" and m.get("name") == "calculator"]
                ok = bool(calls) and calls[0]["function"]["arguments"] == {"expression": "123*45"} and tool_said
                out.append(1.0 if ok else 0.0)
            return out

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0 if solution_str.strip() == ground_truth else 0.0
    '''))
    config = RewarderConfig.model_validate({"port": 0, "workers": 1, "spec": {"functions": [
        {"type": "file", "path": str(path), "function": "used_the_calculator"},
        {"type": "file", "path": str(path), "function": "compute_score"},
        {"type": "math_verify", "field": "answer"}]}})
    call = sampler_pb2.ToolCall(name="calculator", arguments='{"expression": "123*45"}')
    with_tool = [sampler_pb2.ChatMessage(role="assistant", content="Let me compute.", tool_calls=[call]),
                 sampler_pb2.ChatMessage(role="tool", name="calculator", content="5535"),
                 sampler_pb2.ChatMessage(role="assistant", content="5535")]
    cut_off = [sampler_pb2.ChatMessage(role="assistant", content="4000", tool_calls=[call]),
               # the tool said it, not the model
               sampler_pb2.ChatMessage(role="tool", name="calculator", content="5535")]

    group = score_group("g", [{"role": "user", "content": "What is 123*45?"}], ["5535", "4000"],
                        {"answer": "5535", "ground_truth": "5535"}, [[1, 2], [3]], [with_tool, cut_off])
    reward = run(_score_over_grpc(config, group))
    assert reward.errors == [], reward.errors
    first, second = reward.breakdown
    assert first["used_the_calculator"] == 1.0 and second["used_the_calculator"] == 1.0
    assert first["compute_score"] == 1.0 and second["compute_score"] == 0.0
    assert first["math_verify"] == 1.0 and second["math_verify"] == 0.0


def test_completion_chats_must_match_the_completions():
    from dgrpo.rewarder.scorer import RequestError

    scorer = Scorer(RewarderConfig.model_validate({"spec": {"functions": [{"type": "math_verify"}]}, "workers": 1}))
    group = GroupInput("g", "q", ["a", "b"], {}, None, [[{"role": "assistant", "content": "a"}]])
    with pytest.raises(RequestError, match="1 completion_chats entries for 2 completions"):
        scorer.validate([group], 0)
