"""Conversions between rewarder protos and the scorer's plain objects: the only place that knows both."""

from __future__ import annotations

import json
import math

from google.protobuf import struct_pb2

from dgrpo.rewarder.scorer import GroupInput, RequestError, ScoreResult
from dgrpo.rewarder.spec import FunctionInfo, SpecRef
from dgrpo.v1 import rewarder_pb2 as pb

_MAX_EXACT_INT = 2**53


def _from_value(value: struct_pb2.Value, where: str):
    """A Struct value as the dataset had it: integral numbers become ints again, so `answer == 3` and `str(answer)`
    behave as in the dataset (a TRL function comparing to "3" must not see "3.0"). NaN, infinities and a value with
    no kind set are refused (RequestError naming the column): no JSON dataset holds them, and reward functions
    would compute nonsense from them."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise RequestError(f"{where}: {number} is not a finite number (extra columns hold JSON values)")
        return int(number) if number.is_integer() and abs(number) < _MAX_EXACT_INT else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "null_value":
        return None
    if kind == "struct_value":
        return _from_struct(value.struct_value, where)
    if kind == "list_value":
        return [_from_value(v, f"{where}[{i}]") for i, v in enumerate(value.list_value.values)]
    raise RequestError(f"{where}: a google.protobuf.Value with no kind set")


def _from_struct(struct: struct_pb2.Struct, where: str) -> dict:
    return {k: _from_value(v, f"{where}.{k}") for k, v in struct.fields.items()}


def groups_from_proto(request: pb.ScoreRequest) -> list[GroupInput]:
    """RequestError for an extra column no dataset could hold (NaN, infinity, an empty Value)."""
    groups = []
    for i, g in enumerate(request.groups):
        if g.WhichOneof("prompt") == "chat":
            prompt: str | list[dict] = [{"role": m.role, "content": m.content} for m in g.chat.messages]
        else:
            prompt = g.text
        extra = _from_struct(g.extra, f"groups[{i}].extra") if g.HasField("extra") else {}
        ids = [list(c.ids) for c in g.completion_ids] if len(g.completion_ids) else None
        chats = ([[_message(m) for m in chat.messages] for chat in g.completion_chats] if len(g.completion_chats)
                 else None)
        groups.append(GroupInput(g.prompt_id, prompt, list(g.completions), extra, ids, chats))
    return groups


def _message(m: pb.RewardChatMessage) -> dict:
    """A turn as TRL's conversational format has it: tool calls as OpenAI's entries (arguments parsed when they
    are a JSON object), a tool turn with the tool's name."""
    message: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in m.tool_calls]
    if m.name:
        message["name"] = m.name
    return message


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def trainer_state_from_proto(request: pb.ScoreRequest) -> dict | None:
    """TRL's trainer_state fields, or None when the client sent none (functions then see step 0)."""
    if not request.HasField("trainer_state"):
        return None
    s = request.trainer_state
    return {"global_step": s.global_step, "max_steps": s.max_steps, "epoch": s.epoch}


def spec_ref_to_proto(ref: SpecRef | None) -> pb.RewardSpecRef:
    if ref is None:
        return pb.RewardSpecRef()
    return pb.RewardSpecRef(name=ref.name, version=ref.version, content_hash=ref.content_hash)


def score_response(result: ScoreResult, prompt_ids: list[str]) -> pb.ScoreResponse:
    response = pb.ScoreResponse(spec=spec_ref_to_proto(result.spec))
    group_metrics = result.metrics or [{} for _ in result.groups]
    for prompt_id, scores, logged in zip(prompt_ids, result.groups, group_metrics, strict=True):
        group = response.groups.add(prompt_id=prompt_id, metrics=logged)
        for s in scores:
            status = pb.SCORE_STATUS_NO_REWARD if s.no_reward else pb.SCORE_STATUS_OK if s.ok else pb.SCORE_STATUS_ERROR
            group.scores.add(reward=s.reward, breakdown=s.breakdown, status=status, message=s.message)
    return response


def function_info_to_proto(info: FunctionInfo) -> pb.RewardFunctionInfo:
    return pb.RewardFunctionInfo(name=info.name, kind=info.kind, weight=info.weight, source=info.source)
