"""Tool calls in the model's text: Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

We match exactly what vLLM's Hermes2ProToolParser matches (its `tool_call_regex`, copied below; a test checks the two
agree on well-formed text) but do not call that class, because its `extract_tool_calls` (vLLM 0.32) drops EVERY call
of a turn and returns the whole text as content when one call is malformed, logging a traceback — we need one error
per bad call, which becomes an error tool message the model can learn from. It also wants a tokenizer and a
ChatCompletionRequest, and importing it loads vLLM's server stack (~13 s), which tests and the learner do not have.
An unclosed `<tool_call>` at the end is a call too: the sampler may stop generation on `</tool_call>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# Same pattern as vllm.tool_parsers.hermes_tool_parser.Hermes2ProToolParser.tool_call_regex.
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
START = "<tool_call>"
_RAW_IN_ERROR = 200  # chars of a bad call quoted back to the model


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name, its arguments object, and the exact text it came from."""

    name: str
    arguments: dict
    raw: str


@dataclass(frozen=True)
class ParsedCalls:
    """A model turn split into its text before the first call, the well-formed calls, and one error per bad call."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _clip(text: str) -> str:
    return text if len(text) <= _RAW_IN_ERROR else text[:_RAW_IN_ERROR] + "..."


def _parse_one(body: str, index: int) -> ToolCall | str:
    """The JSON between the tags -> a ToolCall, or an error message naming the call and the problem."""
    where = f"tool call {index + 1}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where}: invalid JSON ({e.msg} at char {e.pos}): {_clip(body.strip())}"
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with name and arguments, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: missing \"name\" (a string): {_clip(body.strip())}"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments object as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"{where} ({name}): arguments is a string that is not JSON ({e.msg}): {_clip(args)}"
    if not isinstance(args, dict):
        return f"{where} ({name}): \"arguments\" must be an object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args, raw=body)


def parse_tool_calls(text: str) -> ParsedCalls:
    """Split a decoded model turn; never raises (malformed calls become entries in `errors`)."""
    start = text.find(START)
    if start < 0:
        return ParsedCalls(content=text)
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(TOOL_CALL_RE.finditer(text)):
        body = m.group(1) if m.group(1) is not None else m.group(2)
        parsed = _parse_one(body, i)
        (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    return ParsedCalls(content=text[:start], calls=calls, errors=errors)
