"""Tool pieces without processes: Hermes call parsing, verl-format tool configs, MultiTurnConfig, the calculator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgrpo.common.config import ConfigError
from dgrpo.tools import MultiTurnConfig, load_tool_config, parse_tool_calls
from dgrpo.tools.builtins import CalculatorError, calculator, python
from dgrpo.tools.spec import builtin_toolset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tools" / "tool_config.yaml"


# --- parser ---
def test_parse_no_call():
    p = parse_tool_calls("The answer is 42.")
    assert p.content == "The answer is 42." and p.calls == [] and p.errors == []


def test_parse_one_call():
    p = parse_tool_calls('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
                         "</tool_call>")
    assert p.content == "Let me compute.\n"
    assert [(c.name, c.arguments) for c in p.calls] == [("calculator", {"expression": "12*34"})]
    assert p.errors == []


def test_parse_two_calls_and_unclosed_last():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}')  # stopped on </tool_call>; args as a string
    p = parse_tool_calls(text)
    assert p.content == ""
    assert [(c.name, c.arguments) for c in p.calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_parse_malformed_json_is_an_error_not_an_exception():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>["not", "an", "object"]</tool_call><tool_call>{"arguments": {}}</tool_call>')
    p = parse_tool_calls(text)
    assert [c.arguments for c in p.calls] == [{"expression": "1+1"}]
    assert len(p.errors) == 3
    assert p.errors[0].startswith("tool call 2: invalid JSON")
    assert "tool call 3" in p.errors[1] and "list" in p.errors[1]
    assert "tool call 4" in p.errors[2] and "name" in p.errors[2]


# --- tool config ---
def test_example_verl_config_loads():
    ts = load_tool_config(EXAMPLE)
    assert list(ts.specs) == ["calculator", "code_interpreter", "unit_convert"]
    assert ts.specs["code_interpreter"].kind == "builtin" and ts.specs["code_interpreter"].target == "python"
    assert ts.specs["unit_convert"].kind == "file"
    assert ts.specs["unit_convert"].target.endswith("examples/tools/user_tools.py:unit_convert")
    schemas = ts.schemas()
    assert schemas[0] == {"type": "function", "function": {
        "name": "calculator", "description": ts.specs["calculator"].description,
        "parameters": ts.specs["calculator"].parameters}}
    assert len(ts.digest) == 64


def _write(tmp_path: Path, text: str, name: str = "tools.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_digest_follows_the_user_file_bytes(tmp_path):
    (tmp_path / "t.py").write_text("def f(x):\n    return x\n")
    cfg = _write(tmp_path, "tools:\n  - class_name: file:t.py:f\n    tool_schema: {type: function, function: "
                 "{name: f, parameters: {type: object, properties: {x: {type: string}}}}}\n")
    d1 = load_tool_config(cfg).digest
    assert load_tool_config(cfg).digest == d1
    (tmp_path / "t.py").write_text("def f(x):\n    return x * 2\n")
    assert load_tool_config(cfg).digest != d1


@pytest.mark.parametrize(("body", "expect"), [
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n", "tools[0] (class_name 'verl.tools.gsm8k_tool"),
    ("tools:\n  - class_name: wolfram\n", "unknown class_name 'wolfram'"),
    ("tools:\n  - class_name: file:missing.py:f\n    tool_schema: {function: {name: f}}\n", "does not exist"),
    ("tools:\n  - class_name: calculator\n  - class_name: calculator\n", "used twice"),
    ("tools:\n  - class_name: calculator\n    config: {timeout: 3}\n", "config has unknown keys ['timeout']"),
    (("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: calc, parameters: "
     "{type: object, properties: {expr: {type: string}}}}}\n"), "takes exactly the argument(s) expression"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: 'bad name'}}\n",
     "must be 1-64 letters"),
    ("tools: []\n", "non-empty list"),
    ("tools: [\n", "not valid YAML"),
])
def test_bad_tool_configs_name_file_and_entry(tmp_path, body, expect):
    cfg = _write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_tool_config(cfg)
    assert str(cfg) in str(e.value) and expect in str(e.value)


def test_builtins_without_schema_get_defaults(tmp_path):
    ts = load_tool_config(_write(tmp_path, "tools:\n  - class_name: calculator\n  - class_name: python\n"))
    assert ts.schemas() == builtin_toolset("calculator", "python").schemas()


# --- config ---
def test_multi_turn_config_defaults_and_validation():
    cfg = MultiTurnConfig()
    assert not cfg.enable and cfg.format == "hermes" and cfg.sandbox == "strict"
    with pytest.raises(ValueError, match="tool_config_path is not set"):
        MultiTurnConfig(enable=True)
    with pytest.raises(ValueError, match="max_assistant_turns"):
        MultiTurnConfig(max_assistant_turns=0)
    with pytest.raises(ValueError, match="unknown_key|Extra inputs"):
        MultiTurnConfig(unknown_key=1)
    lim = MultiTurnConfig(enable=True, tool_config_path="x.yaml", tool_timeout_s=2, tool_memory_mb=256,
                          max_tool_response_length=100).limits()
    assert (lim.timeout_s, lim.memory_mb, lim.max_output_chars, lim.truncate_side) == (2, 256, 100, "middle")
    for name, field in MultiTurnConfig.model_fields.items():
        assert field.description, f"{name} is undocumented"


# --- calculator ---
@pytest.mark.parametrize(("expr", "want"), [
    ("1234 * 5678", "7006652"), ("987654321 * 123456789", "121932631112635269"), ("0.1 + 0.2", "0.3"),
    ("7 / 2", "3.5"), ("2 ** 100", str(2**100)), ("-3 ** 2", "-9"), ("(1 + 2) * 3 - 4 // 3", "8"), ("17 % 5", "2"),
    ("2 ^ 10", "1024"), ("1,234 + 1", "1235"), ("10 / 4 * 2", "5"),
])
def test_calculator_right_answers(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(("expr", "why"), [
    ("9**9**9", "exponent"), ("__import__('os').system('true')", "not allowed"), ("(1).__class__", "not allowed"),
    ("10 ** 2000", "digits"), ("(10**600) * (10**600)", "digits"), ("1 / 0", "division by zero"),
    ("x + 1", "names are not allowed"), ("[1, 2]", "not allowed"), ("1 +", "not an arithmetic expression"),
    ("1" * 2000, "longer than"), ("lambda: 1", "not allowed"),
])
def test_calculator_refuses_hostile_expressions(expr, why):
    with pytest.raises(CalculatorError, match=why):
        calculator(expr)


def test_python_tool_in_process_returns_stdout_then_stderr_tail():
    out = python("import sys\nprint('hello')\nprint('warn', file=sys.stderr)\nraise ValueError('boom')")
    assert out.startswith("hello\n") and "[stderr]\nwarn" in out and "ValueError: boom" in out
    assert "sandbox" not in out  # our own frames are not shown to the model
    tail = python("for i in range(10000): print(i)", _output_limit=50)
    assert tail.endswith("9999\n") and "characters cut" in tail


@pytest.mark.slow  # imports vLLM's server stack (~13 s)
def test_parser_agrees_with_vllms_hermes_parser_on_well_formed_turns():
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from dgrpo.tools.parser import TOOL_CALL_RE

    assert TOOL_CALL_RE.pattern == Hermes2ProToolParser.tool_call_regex.pattern
    vllm_parser = Hermes2ProToolParser(tokenizer=object())  # the non-streaming path uses neither tokenizer nor request
    turns = [
        "no call at all",
        'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
        ('<tool_call>{"name": "a", "arguments": {"x": [1, 2]}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
        '{"s": "é <b>"}}</tool_call>'),
        'thinking <tool_call>{"name": "a", "arguments": {}}',  # unclosed: stopped on </tool_call>
    ]
    for text in turns:
        theirs = vllm_parser.extract_tool_calls(text, request=None)
        ours = parse_tool_calls(text)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in theirs.tool_calls] == [
            (c.name, c.arguments) for c in ours.calls]
        assert (theirs.content or "") == ours.content
        assert ours.errors == []
