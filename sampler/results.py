"""What a sampler replica hands back: each sample's completion, a multi-turn sample's turns, a prompt's group.

Plain data shared by the engine (which makes them), the multi-turn loop (which makes a conversation's completion
from its turns) and the proto conversions (sampler/convert.py): kept apart so that none of them imports another for
its types.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Message:
    """One turn of the response (TRL's conversational format)."""

    role: str
    content: str
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as JSON text)
    name: str = ""  # tool turns: the tool's name

    def as_dict(self) -> dict:
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                                 for n, a in self.tool_calls]
        if self.name:
            out["name"] = self.name
        return out


@dataclass
class TurnStats:
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    ended_by: str = "answer"


@dataclass
class CompletionResult:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weight_version: int
    """The last version that produced its tokens (read at completion)."""
    first_weight_version: int | None = None
    """The version loaded when the request was admitted (None: not recorded)."""
    mask: list[int] | None = None
    """Multi-turn: 1 per model token, 0 per tool / template token (None: every token is the model's)."""
    messages: list[Message] | None = None
    """Multi-turn: the response as messages (assistant turns with their calls, tool results)."""
    turn_stats: TurnStats | None = None
    """Multi-turn: turns, tool calls, errors, timeouts, tool seconds, why it ended."""


@dataclass
class TurnOutput:
    """One engine request of a multi-turn sample (n = 1)."""

    token_ids: list[int]
    logprobs: list[float]
    """The sampled tokens' logprobs (`sampled_logprobs`)."""
    text: str
    finish_reason: FinishReason
    prompt_token_ids: list[int]
    """The ids the engine consumed for this turn (the tests check them against the conversation's ids)."""


@dataclass
class GroupResult:
    prompt_id: str
    prompt_token_ids: list[int]
    completions: list[CompletionResult]
