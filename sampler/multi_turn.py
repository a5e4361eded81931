"""Multi-turn rollouts with tool calls: each sample continues turn by turn where the KV cache is.

A sample's loop (verl's tool agent loop, token in / token out): generate a turn from token ids, parse its tool calls
(Hermes `<tool_call>` JSON, dgrpo.tools.parser), run them in the sandbox (ToolRunner, one process per call,
on a thread pool so the engine's event loop never waits), append the tool messages' tokens, and continue until a turn
has no call or a limit is hit. The ids handed back are the prompt's continuation exactly as the engine produced and
consumed it: model tokens verbatim (mask 1, with their sampled logprobs), tool and template tokens between turns
(mask 0, logprob 0). Model text is never re-tokenized — only the new tool messages are rendered, as the suffix the
chat template puts after the history (`ToolTemplate.tool_block`), which is checked to be prefix-stable at start.

Prefix caching (`sampler.enable_prefix_caching`, on by default) keeps each turn's history in the KV cache, so a turn
costs its new tokens, not the whole conversation again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dgrpo.sampler.requests import MultiTurnRequest, SamplingRequest
from dgrpo.sampler.results import CompletionResult, Message, TurnOutput, TurnStats

if TYPE_CHECKING:
    from dgrpo.tools.config import MultiTurnConfig

log = logging.getLogger(__name__)

ENDED_BY = ("answer", "max_assistant_turns", "max_tool_calls", "max_response_length", "abort")

# Hermes / Qwen2.5 function-calling instructions, for chat templates that ignore `tools=` (SmolLM2's does).
HERMES_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_SENTINEL = "\u2063dgrpo-turn\u2063"


class TurnEngine(Protocol):
    """What a conversation needs of the engine (SamplerEngine): one turn at a time, the weight version, the context
    length, the end-of-sequence id, and the tokenizer's thread."""

    @property
    def weight_version(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    async def run_turn(self, request_id: str, ids: list[int], sampling: SamplingRequest, max_tokens: int,
                       seed: int | None, turn: int) -> TurnOutput: ...

    async def in_tokenizer_thread(self, fn, *args): ...


class ToolsUnavailable(RuntimeError):
    """The request asks for tools this replica does not have (none configured, or another tool set)."""


class ToolTemplate:
    """The chat template's pieces the loop needs: the tool instructions for the first turn's prompt, and the token
    block that follows a finished assistant turn (tool messages + the next generation prompt)."""

    def __init__(self, tokenizer, schemas: list[dict]):
        self.tokenizer, self.schemas = tokenizer, schemas
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        probe = [{"role": "user", "content": "x"}]
        self.native_tools = self._render(probe, True, tools=schemas) != self._render(probe, True)
        self.tool_prompt = HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
        # The suffix method below needs the rendering of a history to be a prefix of the rendering of its extension.
        base = [*probe, {"role": "assistant", "content": _SENTINEL}]
        longer = self._render([*base, {"role": "tool", "content": "y"}], True)
        if not longer.startswith(self._render(base, False)):
            raise ValueError("the chat template does not render a prefix-stable history (a tool message changes how "
                             "the earlier turns render): multi-turn needs a template whose history only grows")

    def _render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """A chat prompt's ids with the tools: `tools=` where the template uses them, else the Hermes instructions as
        the system message (prepended to the caller's own system message, or replacing the template's default)."""
        if self.native_tools:
            return self._encode(self._render(messages, True, tools=self.schemas))
        if messages and messages[0]["role"] == "system":
            head = {"role": "system", "content": self.tool_prompt + "\n\n" + messages[0]["content"]}
            messages = [head, *messages[1:]]
        else:
            messages = [{"role": "system", "content": self.tool_prompt}, *messages]
        return self._encode(self._render(messages, True))

    def token_prompt(self, ids: list[int]) -> list[int]:
        """An already rendered prompt with the tool instructions in a system turn placed before it (its own system
        turn, if any, follows)."""
        block = self._render([{"role": "system", "content": self.tool_prompt}], False)
        return self._encode(block) + list(ids)

    def tool_block(self, tool_messages: list[dict], turn_ended_with_eos: bool) -> list[int]:
        """Token ids that follow an assistant turn's last sampled token: the rest of its end-of-turn markup (what the
        template puts after the content, less the EOS the model sampled), the tool messages, the generation prompt."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        history = self._render(base, False)
        extended = self._render([*base, *tool_messages], True)
        if not extended.startswith(history):
            raise ValueError("the chat template re-rendered the history when tool messages were added")
        tail = history[history.rindex(_SENTINEL) + len(_SENTINEL):]
        if turn_ended_with_eos and self.eos_text and tail.startswith(self.eos_text):
            tail = tail[len(self.eos_text):]
        return self._encode(tail + extended[len(history):])


class ToolConversations:
    """A replica's tools (loaded from ITS OWN config) and the per-sample conversation loop."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer, scratch_root: str | Path | None = None):
        from dgrpo.tools.sandbox import ToolRunner
        from dgrpo.tools.spec import load_tool_config

        if not cfg.tool_config_path:
            raise ValueError("learner.rollout.multi_turn.tool_config_path is unset: a replica needs a tool config")
        self.cfg = cfg
        self.toolset = load_tool_config(cfg.tool_config_path)
        self.template = ToolTemplate(tokenizer, self.toolset.schemas())
        self._scratch = None
        if scratch_root is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="dgrpo-tools-")
            scratch_root = self._scratch.name
        self.runner = ToolRunner(self.toolset, cfg.limits(), scratch_root, sandbox=cfg.sandbox)
        self.pool = ThreadPoolExecutor(max_workers=cfg.tool_workers, thread_name_prefix="dgrpo-tool")
        log.info("tools %s (digest %s, isolation: %s, %s template tools)", sorted(self.toolset.specs),
                 self.toolset.digest[:12], self.runner.isolation, "native" if self.template.native_tools else "Hermes")

    @property
    def digest(self) -> str:
        return self.toolset.digest

    def check(self, req: MultiTurnRequest) -> None:
        """ToolsUnavailable for another tool set; ValueError for impossible limits."""
        if req.tool_config_digest != self.digest:
            raise ToolsUnavailable(f"multi_turn.tool_config_digest={req.tool_config_digest[:16] or '(empty)'}... does "
                                   f"not match this replica's tool set ({self.digest[:16]}..., from "
                                   f"{self.cfg.tool_config_path}): the learner and the sampler read different tools")
        if req.max_assistant_turns < 1:
            raise ValueError(f"multi_turn.max_assistant_turns={req.max_assistant_turns}: must be >= 1")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.runner.close()
        if self._scratch is not None:
            self._scratch.cleanup()

    async def _run_calls(self, calls) -> list:
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*[loop.run_in_executor(self.pool, self.runner.run, c) for c in calls])

    def _cut(self, text: str, limit: int) -> str:
        if limit and len(text) > limit:
            return text[:limit] + f"\n...[{len(text) - limit} more characters cut]"
        return text

    async def conversation(self, engine: TurnEngine, request_id: str, prompt_ids: list[int],
                           sampling: SamplingRequest, req: MultiTurnRequest, seed: int | None) -> CompletionResult:
        """One sample's whole conversation as one completion with its mask, messages and stats."""
        from dgrpo.tools.parser import parse_tool_calls

        budget = req.max_response_length or sampling.max_tokens
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        messages: list[Message] = []
        stats = TurnStats()
        finish = "stop"
        first_version = engine.weight_version
        eos = engine.eos_token_id
        while True:
            room = min(budget - len(ids), engine.max_model_len - len(prompt_ids) - len(ids))
            if room <= 0:
                stats.ended_by, finish = "max_response_length", "length"
                break
            turn_seed = None if seed is None else seed + 7919 * stats.turns
            out = await engine.run_turn(f"{request_id}-t{stats.turns}", prompt_ids + ids, sampling, room, turn_seed,
                                        turn=stats.turns)
            turn = list(out.token_ids)
            ids += turn
            mask += [1] * len(turn)
            logprobs += out.logprobs
            stats.turns += 1
            parsed = parse_tool_calls(out.text)
            calls = list(parsed.calls)
            messages.append(Message("assistant", parsed.content,
                                    [(c.name, json.dumps(c.arguments)) for c in calls]))
            reason = out.finish_reason
            if reason != "stop":  # length (budget, context) or abort: the turn was cut, its calls are not run
                finish = reason
                stats.ended_by = "max_response_length" if reason == "length" else "abort"
                break
            if not calls and not parsed.errors:
                stats.ended_by = "answer"
                break
            if stats.turns >= req.max_assistant_turns:
                stats.ended_by = "max_assistant_turns"
                break
            left = req.max_tool_calls - stats.tool_calls
            if left <= 0:
                stats.ended_by = "max_tool_calls"
                break
            run = calls[: min(left, self.cfg.max_parallel_calls)]
            errors = list(parsed.errors) + [
                f"{c.name}: not run (over max_parallel_calls={self.cfg.max_parallel_calls} per turn or "
                f"max_tool_calls={req.max_tool_calls} per sample)" for c in calls[len(run):]]
            results = await self._run_calls(run)
            tool_messages: list[Message] = []
            for e in errors:  # malformed or refused calls: the model reads why, as a tool message
                tool_messages.append(Message("tool", self._cut(f"error: {e}", req.max_tool_response_length)))
            for call, r in zip(run, results, strict=True):
                text = r.text if r.ok or r.text else f"error: {r.error}"
                tool_messages.append(Message("tool", self._cut(text, req.max_tool_response_length), name=call.name))
                stats.tool_seconds += r.seconds
                stats.tool_errors += 0 if r.ok or r.error == "output_truncated" else 1
                stats.tool_timeouts += r.error == "timeout"
            stats.tool_calls += len(run)
            stats.tool_errors += len(errors)
            turn_ended_with_eos = bool(turn) and turn[-1] == eos
            block = await engine.in_tokenizer_thread(
                self.template.tool_block, [{"role": m.role, "content": m.content} for m in tool_messages],
                turn_ended_with_eos)
            messages += tool_messages
            if len(ids) + len(block) >= min(budget, engine.max_model_len - len(prompt_ids)):
                stats.ended_by, finish = "max_response_length", "length"  # no room for the results and a reply
                break
            ids += block
            mask += [0] * len(block)
            logprobs += [0.0] * len(block)
        last = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
        return CompletionResult(ids, logprobs, last, finish, engine.weight_version, first_version,
                                mask=mask, messages=messages, turn_stats=stats)

