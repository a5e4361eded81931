"""Proto <-> domain conversions of the sampler, in one place: requests in, groups out. The other direction is the
learner's (learner/rollout/client.py builds the requests, learner/rollout/groups.py reads the groups); the tests run
the two ends
against each other."""

from __future__ import annotations

from dgrpo.sampler.requests import MultiTurnRequest, PromptInput, SamplingRequest
from dgrpo.sampler.results import CompletionResult, GroupResult, Message
from dgrpo.v1 import sampler_pb2 as pb

FINISH_TO_PB = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def prompt_from_pb(p: pb.Prompt) -> PromptInput:
    which = p.WhichOneof("input")
    if which == "text":
        return PromptInput(id=p.id, text=p.text)
    if which == "chat":
        return PromptInput(id=p.id, chat=[(m.role, m.content) for m in p.chat.messages])
    if which == "token_ids":
        return PromptInput(id=p.id, token_ids=list(p.token_ids.ids))
    return PromptInput(id=p.id)  # no input: the engine rejects it with the prompt's id


def sampling_from_pb(s: pb.SamplingParams) -> SamplingRequest:
    return SamplingRequest(
        n=s.n,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        max_tokens=s.max_tokens,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        seed=s.seed if s.HasField("seed") else None,
    )


def multi_turn_from_pb(m: pb.GenerateRequest) -> MultiTurnRequest | None:
    """GenerateRequest.multi_turn, or None when unset or not enabled (one completion per sample)."""
    if not m.HasField("multi_turn") or not m.multi_turn.enable:
        return None
    t = m.multi_turn
    return MultiTurnRequest(t.max_assistant_turns, t.max_tool_calls, t.max_response_length,
                            t.max_tool_response_length, t.tool_config_digest)


def message_to_pb(m: Message) -> pb.ChatMessage:
    return pb.ChatMessage(role=m.role, content=m.content, name=m.name,
                          tool_calls=[pb.ToolCall(name=n, arguments=a) for n, a in m.tool_calls])


def completion_to_pb(c: CompletionResult) -> pb.Completion:
    msg = pb.Completion(
        token_ids=c.token_ids,
        logprobs=c.logprobs,
        text=c.text,
        finish_reason=FINISH_TO_PB[c.finish_reason],
        weight_version=c.weight_version,
        first_weight_version=c.first_weight_version,
        mask=c.mask or [],
        messages=[message_to_pb(m) for m in c.messages or []],
    )
    if c.turn_stats is not None:
        s = c.turn_stats
        msg.turn_stats.CopyFrom(pb.TurnStats(turns=s.turns, tool_calls=s.tool_calls, tool_errors=s.tool_errors,
                                             tool_timeouts=s.tool_timeouts, tool_seconds=s.tool_seconds,
                                             ended_by=s.ended_by))
    return msg


def group_to_pb(g: GroupResult, replica_id: str) -> pb.Group:
    return pb.Group(
        prompt_id=g.prompt_id,
        prompt_token_ids=g.prompt_token_ids,
        replica_id=replica_id,
        completions=[completion_to_pb(c) for c in g.completions],
    )
