"""Built-in reward functions, value checks, spec parsing and hashing, proto conversions: fast, in-process."""

from __future__ import annotations

import math

import pytest

from dgrpo.learner.rollout.reward_client import score_group
from dgrpo.rewarder.builtins import build_builtin
from dgrpo.rewarder.config import RewardSpec, function_name
from dgrpo.rewarder.convert import groups_from_proto
from dgrpo.rewarder.reward_model import pack_by_budget
from dgrpo.rewarder.scorer import GroupInput
from dgrpo.rewarder.spec import SpecError, build_functions, parse_spec_text, snapshot
from dgrpo.rewarder.worker import call_function, check_values
from dgrpo.v1 import rewarder_pb2


def fn(**cfg):
    spec = RewardSpec.model_validate({"functions": [cfg]})
    return build_builtin(spec.functions[0])


def test_math_verify_boxed_tags_last_number_and_latex():
    f = fn(type="math_verify")
    completions = [
        "so the answer is \\boxed{3}",
        "<think>4? no</think><answer>3</answer>",
        "first 4, then finally 3",
        "\\boxed{\\frac{6}{2}}",
        "\\boxed{4}",
        "no idea",
    ]
    assert f([None] * 6, completions, answer=[3] * 6) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # A reference math-verify cannot parse: not applicable rather than a punishment.
    assert f([None], ["3"], answer=["???"]) == [None]
    assert f([None], [[{"role": "assistant", "content": "\\boxed{2}"}]], answer=["2"]) == [1.0]


def test_math_verify_names_a_missing_column():
    with pytest.raises(KeyError, match="'answer' is missing"):
        fn(type="math_verify")([None], ["3"], solution=["3"])


def test_exact_match_modes():
    refs = ["Paris"] * 4
    completions = ["Paris", " paris. ", "$\\boxed{PARIS}$", "It is Paris"]
    assert fn(type="exact_match", normalize=False)([None] * 4, completions, answer=refs) == [1.0, 0.0, 0.0, 0.0]
    assert fn(type="exact_match")([None] * 4, completions, answer=refs) == [1.0, 1.0, 1.0, 0.0]
    tagged = fn(type="exact_match", extract="answer_tag")
    assert tagged([None] * 2, ["<answer>Paris</answer>", "Paris"], answer=refs[:2]) == [1.0, 0.0]
    last = fn(type="exact_match", extract="last_line")
    assert last([None], ["thinking...\nParis\n\n"], answer=["paris"]) == [1.0]


def test_regex_format():
    full = fn(type="regex_format")
    ok = "<think>a\nb</think>\n<answer>3</answer>"
    assert full([None] * 3, [ok, "<answer>3</answer>", ok + " trailing"], ) == [1.0, 0.0, 0.0]
    search = fn(type="regex_format", pattern=r"\d+", mode="search")
    assert search([None] * 2, ["x 12 y", "none"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        fn(type="regex_format", pattern="(unclosed")


def test_length_bounds_and_penalty():
    texts = ["a" * 5, "a" * 10, "a" * 25]
    assert fn(type="length", min_length=10, max_length=20)([None] * 3, texts) == [0.0, 1.0, 0.0]
    penalty = fn(type="length", min_length=10, max_length=20, mode="penalty", penalty_per_unit=0.1)
    assert penalty([None] * 3, texts) == pytest.approx([-0.5, 0.0, -0.5])
    words = fn(type="length", unit="words", min_length=2, max_length=3)
    assert words([None] * 2, ["one two", "one"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="above max_length"):
        fn(type="length", min_length=5, max_length=1)


def test_length_and_reference():
    f = fn(type="length_and_reference")
    completions = ["需要3小时。因为360除以120等于3。", "太短", "答案是 24平方米" + "。" * 300, "x" * 12]
    answers = ["3小时", "3小时", "24平方米", "24平方米"]
    # both halves, neither, the reference in an over-long completion, the right length without the reference
    assert f([None] * 4, completions, answer=answers) == [1.0, 0.0, 0.5, 0.5]
    # the length window is inclusive at 10 and 200 characters
    assert f([None] * 4, ["x" * 9, "x" * 10, "x" * 200, "x" * 201], answer=["y"] * 4) == [0.0, 0.5, 0.5, 0.0]


def test_seed_rule_is_a_deprecated_alias_that_keeps_its_breakdown_name():
    with pytest.warns(FutureWarning, match="'seed_rule' is deprecated; use 'length_and_reference'"):
        spec = RewardSpec.model_validate({"functions": [{"type": "seed_rule"}, {"type": "seed_rule", "name": "r2"}]})
    assert [f.type for f in spec.functions] == ["length_and_reference"] * 2
    assert [function_name(f) for f in spec.functions] == ["seed_rule", "r2"]
    f = build_builtin(spec.functions[0])
    assert f([None] * 2, ["answer: 3 hours", "no"], answer=["3", "3"]) == [1.0, 0.0]


def test_check_values():
    import numpy as np

    assert check_values([1, 0.5, None], 3) == [1.0, 0.5, None]
    # Booleans are 1/0 as TRL's float tensor makes them, numpy's too (np.bool_ is no numbers.Real).
    assert check_values([True, False, np.bool_(True), np.float32(0.5)], 4) == [1.0, 0.0, 1.0, 0.5]
    assert check_values(np.array([True, False]), 2) == [1.0, 0.0]
    bad = check_values([math.nan, math.inf, "high", b"x"], 4)
    assert [type(v) for v in bad] == [str] * 4 and "not finite" in bad[0] and "not a number" in bad[2]
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        check_values([1.0], 2)
    with pytest.raises(ValueError, match="expected a list"):
        check_values(1.0, 1)


def test_call_function_plain_async_and_raising():
    async def areward(prompts, completions, **kwargs):
        return [2.0 for _ in completions]

    def boom(prompts, completions, **kwargs):
        raise RuntimeError("nope")

    kind, scored = call_function(areward, ["p"], ["c"], {})
    assert kind == "ok" and scored.values == [2.0]
    kind, message = call_function(boom, ["p"], ["c"], {})
    assert kind == "error" and message.startswith("raised RuntimeError: nope (at ") and "test_builtins.py" in message


def test_pack_by_budget():
    batches = pack_by_budget([5, 1, 9, 3, 2], budget=10)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    lengths = [5, 1, 9, 3, 2]
    assert all(max(lengths[i] for i in b) * len(b) <= 10 for b in batches)
    assert pack_by_budget([50], budget=10) == [[0]]  # an over-long row still gets its own batch


def test_spec_text_errors_name_the_problem(tmp_path):
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_spec_text("functions: [")
    with pytest.raises(SpecError, match=r"functions\.0: .*tag 'nope'"):
        parse_spec_text('{"functions": [{"type": "nope"}]}')
    with pytest.raises(SpecError, match="named 'length'"):
        parse_spec_text("functions: [{type: length}, {type: length}]")
    with pytest.raises(SpecError, match="does not exist"):
        snapshot(parse_spec_text(f"functions: [{{type: file, path: {tmp_path}/missing.py}}]"))
    with pytest.raises(SpecError, match="not a Hugging Face folder"):
        snapshot(parse_spec_text(f"functions: [{{type: model, path: {tmp_path}}}]"))


def test_bad_reward_files_are_rejected_at_build(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def reward_func(prompts, completions, **kw):\n    return [\n")
    with pytest.raises(SpecError, match="does not import: SyntaxError at line 2 ") as err:
        build_functions(snapshot(parse_spec_text(f"functions: [{{type: file, path: {broken}}}]")))
    assert "never closed" not in str(err.value)  # the type and the line, not what the compiler said about it
    failing = tmp_path / "failing.py"
    failing.write_text("x = 1\nimport not_a_module_anywhere\n")
    with pytest.raises(SpecError, match="does not import: ModuleNotFoundError at line 2 ") as err:
        build_functions(snapshot(parse_spec_text(f"functions: [{{type: file, path: {failing}}}]")))
    assert "not_a_module_anywhere" not in str(err.value)
    other = tmp_path / "other.py"
    other.write_text("def something(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(SpecError, match=r"has no function 'reward_func' \(it defines: something\)"):
        build_functions(snapshot(parse_spec_text(f"functions: [{{type: file, path: {other}}}]")))


def test_content_hash_follows_the_file_contents(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def reward_func(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    spec = parse_spec_text(f"functions: [{{type: file, path: {path}}}]")
    first = snapshot(spec).content_hash
    assert snapshot(spec).content_hash == first
    path.write_text("def reward_func(prompts, completions, **kw):\n    return [2.0] * len(completions)\n")
    assert snapshot(spec).content_hash != first
    renamed = parse_spec_text(f"{{name: other, functions: [{{type: file, path: {path}}}]}}")
    assert snapshot(renamed).content_hash != snapshot(spec).content_hash


def test_proto_round_trip_keeps_extra_columns_and_chat():
    """The learner's request builder (learner/rollout/reward_client.py, the one that ships) into the rewarder's
    reader."""
    groups = [
        GroupInput("a", "What is 1+2?", ["3", "4"], {"answer": 3, "tags": ["x", 2.5], "meta": {"level": 1}}),
        GroupInput("b", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], ["hello"]),
    ]
    request = rewarder_pb2.ScoreRequest(groups=[score_group(g.prompt_id, g.prompt, g.completions, g.extra)
                                                for g in groups])
    back = groups_from_proto(request)
    assert back == groups
    assert isinstance(back[0].extra["answer"], int)
