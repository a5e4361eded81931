"""Conversions between rewarder protos and the scorer's plain objects: the only place that knows both."""

from __future__ import annotations

from google.protobuf import json_format

from dgrpo.rewarder.scorer import GroupInput, ScoreResult
from dgrpo.rewarder.spec import FunctionInfo, SpecRef
from dgrpo.v1 import rewarder_pb2 as pb

_MAX_EXACT_INT = 2**53


def _restore_ints(value):
    """Struct numbers are doubles; integral ones become ints again so `answer == 3` and `str(answer)` behave as in
    the dataset (a TRL function comparing to "3" must not see "3.0")."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_EXACT_INT:
        return int(value)
    if isinstance(value, list):
        return [_restore_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _restore_ints(v) for k, v in value.items()}
    return value


def groups_from_proto(request: pb.ScoreRequest) -> list[GroupInput]:
    groups = []
    for g in request.groups:
        if g.WhichOneof("prompt") == "chat":
            prompt: str | list[dict] = [{"role": m.role, "content": m.content} for m in g.chat.messages]
        else:
            prompt = g.text
        extra = _restore_ints(json_format.MessageToDict(g.extra)) if g.HasField("extra") else {}
        groups.append(GroupInput(g.prompt_id, prompt, list(g.completions), extra))
    return groups


def groups_to_proto(groups: list[GroupInput], group_size: int = 0) -> pb.ScoreRequest:
    """The client side of the same mapping, for the tests (round trip, requests to a real server). The learner
    builds its own requests (learner/reward_client.py): services never import each other."""
    request = pb.ScoreRequest(group_size=group_size)
    for g in groups:
        msg = request.groups.add(prompt_id=g.prompt_id, completions=g.completions)
        if isinstance(g.prompt, str):
            msg.text = g.prompt
        else:
            msg.chat.messages.extend(pb.RewardChatMessage(role=m["role"], content=m["content"]) for m in g.prompt)
        if g.extra:
            msg.extra.update(g.extra)
    return request


def spec_ref_to_proto(ref: SpecRef | None) -> pb.RewardSpecRef:
    if ref is None:
        return pb.RewardSpecRef()
    return pb.RewardSpecRef(name=ref.name, version=ref.version, content_hash=ref.content_hash)


def score_response(result: ScoreResult, prompt_ids: list[str]) -> pb.ScoreResponse:
    response = pb.ScoreResponse(spec=spec_ref_to_proto(result.spec))
    for prompt_id, scores in zip(prompt_ids, result.groups):
        group = response.groups.add(prompt_id=prompt_id)
        for s in scores:
            group.scores.add(
                reward=s.reward,
                breakdown=s.breakdown,
                status=pb.SCORE_STATUS_OK if s.ok else pb.SCORE_STATUS_ERROR,
                message=s.message,
            )
    return response


def function_info_to_proto(info: FunctionInfo) -> pb.RewardFunctionInfo:
    return pb.RewardFunctionInfo(name=info.name, kind=info.kind, weight=info.weight, source=info.source)
