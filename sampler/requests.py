"""A Generate request before the engine sees it: its dataclasses, its checks, and its prompts as token ids.

The input side of the sampler, as vLLM keeps input processing apart from its engine (vllm/v1/engine/): everything
here answers InvalidRequest naming the field and the value, before a single engine request is made. Never imports
grpc (the servicer converts protos into these dataclasses) nor vLLM (the tokenizer is the engine's, passed in).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

CHAT_ROLES = ("system", "user", "assistant", "tool")


class InvalidRequest(ValueError):
    """The request cannot be served as given; the message names the field and the value."""


@dataclass
class PromptInput:
    """Exactly one of text / chat / token_ids is set (`PromptTokenizer.check_size` refuses anything else)."""

    id: str
    text: str | None = None
    chat: list[tuple[str, str]] | None = None
    token_ids: list[int] | None = None


@dataclass
class SamplingRequest:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class MultiTurnRequest:
    """GenerateRequest.multi_turn in domain form (validated by `ToolConversations.check`)."""

    max_assistant_turns: int = 1
    max_tool_calls: int = 8
    max_response_length: int = 0  # 0: sampling.max_tokens
    max_tool_response_length: int = 0  # 0: no cut here (the sandbox's max_output_chars still applies)
    tool_config_digest: str = ""


def check_batch(prompts: Sequence[PromptInput], max_prompts: int) -> None:
    """At least one prompt, at most `max_prompts` (sampler.max_prompts_per_request), no id twice."""
    if not prompts:
        raise InvalidRequest("prompts: empty batch (send at least one prompt)")
    if len(prompts) > max_prompts:
        raise InvalidRequest(f"prompts: {len(prompts)} exceeds max_prompts_per_request={max_prompts}")
    ids_seen: set[str] = set()
    for p in prompts:
        if p.id in ids_seen:
            raise InvalidRequest(f"prompt id {p.id!r} appears twice in the batch")
        ids_seen.add(p.id)


def check_wait(weight_wait_timeout_s: float | None) -> None:
    if weight_wait_timeout_s is not None and not (math.isfinite(weight_wait_timeout_s)
                                                  and weight_wait_timeout_s >= 0):
        raise InvalidRequest(f"weight_wait_timeout_s={weight_wait_timeout_s}: must be a finite number of seconds "
                             ">= 0 (0: the sampler's weight_wait_timeout_s)")


def validate_sampling(s: SamplingRequest, vocab_size: int) -> None:
    """Reject what vLLM would reject later (or silently accept): each message names field and value."""
    checks = [
        (s.n >= 1, f"sampling.n={s.n}: must be >= 1"),
        (s.max_tokens >= 1, f"sampling.max_tokens={s.max_tokens}: must be >= 1"),
        (math.isfinite(s.temperature) and s.temperature >= 0, f"sampling.temperature={s.temperature}: must be >= 0"),
        (0 < s.top_p <= 1, f"sampling.top_p={s.top_p}: must be in (0, 1]"),
        (s.top_k >= 0, f"sampling.top_k={s.top_k}: must be >= 0 (0 = off)"),
        (0 <= s.min_p <= 1, f"sampling.min_p={s.min_p}: must be in [0, 1]"),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidRequest(message)
    bad = [t for t in s.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequest(f"sampling.stop_token_ids={bad}: outside the vocabulary (size {vocab_size})")


class ToolPrompts(Protocol):
    """What tokenizing a multi-turn prompt needs of the replica's tools (sampler/multi_turn.py's ToolTemplate): the
    prompt with the tool instructions in it."""

    def chat_prompt(self, messages: list[dict]) -> list[int]: ...

    def token_prompt(self, ids: list[int]) -> list[int]: ...


class PromptTokenizer:
    """Prompts -> token ids with the engine's tokenizer, bounded before and after tokenization, on one thread of its
    own: tokenizing long text takes seconds of CPU, and on the event loop it would stall every other RPC (health
    checks included); one thread serializes the calls, as HF fast tokenizers are not safe to share across threads."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, prompt_char_limit: int):
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len, self.prompt_char_limit = vocab_size, max_model_len, prompt_char_limit
        self.tool_template: ToolPrompts | None = None
        """The replica's tool instructions (multi-turn requests), set when its tools are loaded."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgrpo-tokenize")

    def check_size(self, prompt: PromptInput) -> None:
        """One input per prompt, and text bounded before it reaches the tokenizer (cheap: a length)."""
        given = [x is not None for x in (prompt.text, prompt.chat, prompt.token_ids)]
        if sum(given) != 1:
            raise InvalidRequest(f"prompt {prompt.id!r}: set exactly one of text, chat, token_ids")
        if prompt.token_ids is not None:
            return
        chars = len(prompt.text) if prompt.text is not None else sum(len(c) for _, c in prompt.chat)
        limit = self.prompt_char_limit
        if chars > limit:
            raise InvalidRequest(
                f"prompt {prompt.id!r}: {chars} characters exceeds sampler.max_prompt_chars={limit} "
                "(checked before tokenization)"
            )

    async def tokenize_batch(self, prompts: Sequence[PromptInput], tools: bool = False) -> list[list[int]]:
        """Size-check every prompt, then tokenize them off the event loop."""
        for p in prompts:
            self.check_size(p)
        return await self.in_thread(lambda: [self._tokenize(p, tools=tools) for p in prompts])

    async def in_thread(self, fn, *args):
        """Run tokenizer work (`fn(*args)`) on the tokenizer's one thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _tokenize(self, prompt: PromptInput, tools: bool = False) -> list[int]:
        """Prompt ids (of a prompt `check_size` passed); with `tools`, the tool instructions of the replica's tool
        set are part of the prompt (chat: rendered by the template; token ids: a system turn before them; raw text:
        as is)."""
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt {prompt.id!r}: token ids {bad[:5]} outside the vocabulary (size {self.vocab_size})"
                )
            if tools and ids:
                ids = self.tool_template.token_prompt(ids)
        elif prompt.chat is not None:
            if not prompt.chat:
                raise InvalidRequest(f"prompt {prompt.id!r}: chat has no messages")
            for role, _ in prompt.chat:
                if role not in CHAT_ROLES:
                    raise InvalidRequest(f"prompt {prompt.id!r}: unknown chat role {role!r} (use one of {CHAT_ROLES})")
            messages = [{"role": r, "content": c} for r, c in prompt.chat]
            if tools:
                ids = self.tool_template.chat_prompt(messages)
            else:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = list(ids["input_ids"])
        else:
            ids = self.tokenizer.encode(prompt.text)
        if not ids:
            raise InvalidRequest(f"prompt {prompt.id!r}: empty prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt {prompt.id!r}: {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                "(prompt plus at least one new token must fit)"
            )
        return ids

    def check_room(self, prompts: Sequence[PromptInput], token_ids: list[list[int]], sampling: SamplingRequest,
                   multi_turn: MultiTurnRequest | None = None) -> None:
        """Refuse a request whose max_tokens cannot fit the context after a prompt: vLLM's engine would stop the
        completion at max_model_len with finish reason `length`, as if it had used all of max_tokens, so a learner
        would train on a shorter budget than it asked for without knowing. Multi-turn conversations are bounded turn
        by turn instead (tool results add tokens no request can foresee; docs/multi_turn.md)."""
        if multi_turn is not None:
            return
        field, budget = "sampling.max_tokens", sampling.max_tokens
        for p, ids in zip(prompts, token_ids, strict=True):
            room = self.max_model_len - len(ids)
            if budget > room:
                raise InvalidRequest(
                    f"prompt {p.id!r}: {field}={budget} exceeds the {room} tokens the context leaves after its "
                    f"{len(ids)} prompt tokens (max_model_len={self.max_model_len}): this replica's maximum context "
                    f"length is {self.max_model_len} tokens, and {len(ids)} + {budget} > {self.max_model_len}; lower "
                    "max_tokens or the prompt, or raise sampler.max_model_len"
                )

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
