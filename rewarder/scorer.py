"""The reward service's domain object: validates requests, scores them on the active spec, hot-swaps specs.

No grpc here: the servicer (rewarder/server.py) converts messages and maps the typed errors below to status
codes. Hot swap: a request pins the spec generation active when it arrives; Reload loads the new spec into a
new worker pool first (a spec that fails to load never becomes active), swaps, and closes the old pool once
its last request has finished.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from dgrpo.common.logs import bounded, printable
from dgrpo.rewarder import metrics
from dgrpo.rewarder.config import RewarderConfig, RewardSpec
from dgrpo.rewarder.pool import CallFailed, WorkerPool
from dgrpo.rewarder.spec import (
    SpecError,
    SpecRef,
    SpecSnapshot,
    allowed_dirs,
    allowed_modules,
    check_modules,
    check_paths,
    check_weights,
    parse_spec_text,
    read_spec_file,
    snapshot,
)

log = logging.getLogger("dgrpo.rewarder")

# Keys a group's extra columns may not use: they are the reward functions' own arguments (TRL's keywords).
RESERVED_COLUMNS = ("prompts", "completions", "trainer_state", "log_extra", "log_metric")
# TRL drops these dataset columns before calling reward functions; so do we.
TRL_DROPPED_COLUMNS = ("prompt", "completion", "completion_ids")


class _QuotesClientText(Exception):
    """An error whose message quotes client text: bounded, so that it fits in a gRPC trailer."""

    def __init__(self, message: str):
        super().__init__(bounded(message))


class RequestError(_QuotesClientText, ValueError):
    """A malformed Score request (-> INVALID_ARGUMENT)."""


class ScoringFailed(_QuotesClientText, RuntimeError):
    """A reward function failed and on_error is fail_request (-> FAILED_PRECONDITION)."""


class NotReady(RuntimeError):
    """No spec loaded yet, or shutting down (-> UNAVAILABLE)."""


@dataclass
class GroupInput:
    prompt_id: str
    prompt: str | list[dict]  # text, or chat messages [{"role", "content"}]
    completions: list[str]
    extra: dict = field(default_factory=dict)
    completion_ids: list[list[int]] | None = None  # token ids per completion (TRL's completion_ids), if sent
    # Multi-turn rollouts: each completion's turns after the prompt (assistant, tool, ..., assistant), if sent;
    # functions then get these message lists (TRL's conversational format) instead of the final answers.
    completion_messages: list[list[dict]] | None = None


@dataclass
class CompletionScore:
    reward: float
    breakdown: dict[str, float]
    ok: bool
    message: str = ""
    no_reward: bool = False  # every function returned None: no reward at all (TRL's all-NaN row)


@dataclass
class ScoreResult:
    groups: list[list[CompletionScore]]
    spec: SpecRef
    metrics: list[dict[str, float]] = field(default_factory=list)  # per group: log_metric means


@dataclass
class _Generation:
    """One loaded spec with its worker pool and the requests still running on it."""

    snap: SpecSnapshot
    ref: SpecRef
    pool: WorkerPool
    in_flight: int = 0
    retired: bool = False
    drained: asyncio.Event = field(default_factory=asyncio.Event)


def _prompt_chars(prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(m.get("content", "")) for m in prompt)


class Scorer:
    def __init__(self, config: RewarderConfig):
        self.config = config
        self.allowed_dirs = allowed_dirs(config)  # fixed at start: the folders every spec's files must lie in
        self.allowed_modules = allowed_modules(config, self._spec_at_start())  # and the modules it may import
        self._active: _Generation | None = None
        self._reload_lock = asyncio.Lock()
        self._versions = 0
        self._closing = False

    # ---- lifecycle ----

    def configured_spec(self) -> RewardSpec:
        """The spec the configuration names: spec_file (re-read each time) or the inline spec."""
        return read_spec_file(self.config.spec_file) if self.config.spec_file else self.config.spec

    def _spec_at_start(self) -> RewardSpec | None:
        try:
            return self.configured_spec()
        except SpecError:  # start() reports it
            return None

    async def start(self) -> SpecRef:
        """Load the configured spec (SpecError if it does not load)."""
        ref, _, _ = await self.reload(None)
        return ref

    async def reload(self, spec_text: str | None) -> tuple[SpecRef, SpecRef | None, bool]:
        """Switch to a new spec (text, or the configured one); returns (active, previous, changed).

        SpecError leaves the active spec untouched."""
        async with self._reload_lock:
            spec = parse_spec_text(spec_text) if spec_text else self.configured_spec()
            check_paths(spec, self.allowed_dirs)
            check_modules(spec, self.allowed_modules)
            check_weights(spec)
            snap = snapshot(spec, self.allowed_dirs)
            old = self._active
            if old is not None and old.snap.content_hash == snap.content_hash:
                return old.ref, old.ref, False
            pool = WorkerPool(snap, self.config.workers, self.config.load_timeout_s)
            started = time.monotonic()
            await pool.start()
            self._versions += 1
            ref = SpecRef(spec.name, self._versions, snap.content_hash)
            self._active = _Generation(snap, ref, pool)
            metrics.set_active_spec(ref)
            log.info("reward spec '%s' version %d (%s) active after %.1fs", printable(ref.name), ref.version,
                     ref.content_hash[:12], time.monotonic() - started)
            if old is not None:
                self._retire(old)
            return ref, (old.ref if old else None), True

    def _retire(self, gen: _Generation) -> None:
        gen.retired = True
        if gen.in_flight == 0:
            gen.drained.set()
        asyncio.get_running_loop().create_task(self._close_when_drained(gen))

    async def _close_when_drained(self, gen: _Generation) -> None:
        await gen.drained.wait()
        await gen.pool.close()
        log.info("reward spec version %d retired", gen.ref.version)

    async def drain(self, timeout: float) -> None:
        """Stop taking requests and wait (up to timeout) for the running ones."""
        self._closing = True
        gen = self._active
        if gen is None or gen.in_flight == 0:
            return
        gen.retired = True
        try:
            await asyncio.wait_for(gen.drained.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("%d score requests still running after %.0fs", gen.in_flight, timeout)

    async def close(self) -> None:
        self._closing = True
        if self._active is not None:
            await self._active.pool.close()

    # ---- state ----

    @property
    def active(self) -> SpecSnapshot | None:
        return self._active.snap if self._active else None

    @property
    def active_ref(self) -> SpecRef | None:
        return self._active.ref if self._active else None

    @property
    def workers_alive(self) -> int:
        return self._active.pool.alive if self._active else 0

    @property
    def in_flight(self) -> int:
        return self._active.in_flight if self._active else 0

    # ---- scoring ----

    def validate(self, groups: list[GroupInput], group_size: int) -> None:
        if not groups:
            raise RequestError("the request has no groups")
        seen: set[str] = set()
        total = chars = 0
        for i, g in enumerate(groups):
            label = f"groups[{i}] (prompt_id {g.prompt_id!r})"
            if g.prompt_id in seen:
                raise RequestError(f"{label}: duplicate prompt_id")
            seen.add(g.prompt_id)
            if not g.completions:
                raise RequestError(f"{label} has no completions")
            if group_size and len(g.completions) != group_size:
                raise RequestError(f"{label} has {len(g.completions)} completions, group_size is {group_size}")
            if g.completion_ids is not None and len(g.completion_ids) != len(g.completions):
                raise RequestError(f"{label} has {len(g.completion_ids)} completion_ids entries for "
                                   f"{len(g.completions)} completions")
            if g.completion_messages is not None and len(g.completion_messages) != len(g.completions):
                raise RequestError(f"{label} has {len(g.completion_messages)} completion_chats entries for "
                                   f"{len(g.completions)} completions")
            reserved = [k for k in g.extra if k in RESERVED_COLUMNS]
            if reserved:
                raise RequestError(f"{label}: extra column {reserved[0]!r} clashes with the reward function argument")
            total += len(g.completions)
            chars += _prompt_chars(g.prompt) + sum(len(c) for c in g.completions)
            chars += sum(_prompt_chars(m) for m in g.completion_messages or [])
        if total > self.config.max_completions_per_request:
            raise RequestError(f"{total} completions in one request; the limit is "
                               f"rewarder.max_completions_per_request={self.config.max_completions_per_request}")
        if chars > self.config.max_request_chars:
            raise RequestError(f"{chars} characters of prompts and completions in one request; the limit is "
                               f"rewarder.max_request_chars={self.config.max_request_chars}")

    async def score(self, groups: list[GroupInput], group_size: int = 0,
                    trainer_state: dict | None = None) -> ScoreResult:
        """`trainer_state`: TRL's trainer_state fields (global_step, max_steps, epoch) for the user functions."""
        self.validate(groups, group_size)
        gen = self._active
        if gen is None or self._closing:
            raise NotReady("the rewarder is not serving (still loading or shutting down)")
        gen.in_flight += 1
        started = time.monotonic()
        try:
            result = await self._score_on(gen, groups, trainer_state)
        finally:
            gen.in_flight -= 1
            if gen.retired and gen.in_flight == 0:
                gen.drained.set()
        metrics.REQUEST_SECONDS.observe(time.monotonic() - started)
        return result

    def _chunks(self, kind: str, groups: list[GroupInput]) -> list[list[int]]:
        """Group indices per call: one group per call for functions (parallel across workers, a failure stays
        in its group); for reward models, one share per worker so batches stay large."""
        if kind != "model":
            return [[i] for i in range(len(groups))]
        n = min(self.config.workers, len(groups))
        return [list(range(len(groups)))[k::n] for k in range(n)]

    async def _score_on(self, gen: _Generation, groups: list[GroupInput], state: dict | None) -> ScoreResult:
        infos = gen.snap.functions()
        # values[f][g][c]: float | None | str (error message); extras[f][g][c]: the call's other numbers
        values: list[list[list]] = [[[None] * len(g.completions) for g in groups] for _ in infos]
        extras: list[list[list[dict]]] = [[[{}] * len(g.completions) for g in groups] for _ in infos]
        logged: list[dict[str, list[float]]] = [{} for _ in groups]  # log_metric values per group
        calls = []
        for f, (info, cfg) in enumerate(zip(infos, gen.snap.spec.functions, strict=True)):
            timeout = cfg.timeout_s or self.config.call_timeout_s
            for chunk in self._chunks(info.kind, groups):
                calls.append(self._call(gen, f, info.name, chunk, groups, (values, extras, logged), timeout, state))
        await asyncio.gather(*calls)
        result = self._combine(gen, infos, groups, values, extras)
        result.metrics = [{k: sum(v) / len(v) for k, v in m.items()} for m in logged]
        return result

    async def _call(self, gen, f: int, name: str, chunk: list[int], groups, out, timeout: float,
                    state: dict | None) -> None:
        values, extras, logged = out
        prompts, completions, kwargs = [], [], {}
        columns = sorted({k for i in chunk for k in groups[i].extra if k not in TRL_DROPPED_COLUMNS})
        for i in chunk:
            g = groups[i]
            prompts += [g.prompt] * len(g.completions)
            if g.completion_messages is not None:  # multi-turn: the whole conversation after the prompt
                completions += g.completion_messages
            elif isinstance(g.prompt, list):  # TRL's conversational format
                completions += [[{"role": "assistant", "content": c}] for c in g.completions]
            else:
                completions += list(g.completions)
            for k in columns:
                kwargs.setdefault(k, []).extend([g.extra.get(k)] * len(g.completions))
        if all(groups[i].completion_ids is not None for i in chunk):
            kwargs["completion_ids"] = [list(ids) for i in chunk for ids in groups[i].completion_ids]
        started = time.monotonic()
        flat_extras: list[dict] = [{}] * len(completions)
        try:
            scored = await gen.pool.call(f, prompts, completions, kwargs, timeout, state)
        except CallFailed as e:
            flat = [f"reward function {name!r} {e}"] * len(completions)
            metrics.FUNCTION_ERRORS.labels(name).inc(len(completions))
            if e.timed_out:
                metrics.FUNCTION_TIMEOUTS.labels(name).inc()
        else:
            flat = [f"reward function {name!r} {v}" if isinstance(v, str) else v for v in scored.values]
            flat_extras = scored.extras
            metrics.FUNCTION_ERRORS.labels(name).inc(sum(isinstance(v, str) for v in flat))
            for i in chunk:  # user functions are called one group at a time: the call's metrics are the group's
                for key, vs in scored.metrics.items():
                    logged[i].setdefault(key, []).extend(vs)
        metrics.FUNCTION_SECONDS.labels(name).observe(time.monotonic() - started)
        pos = 0
        for i in chunk:
            n = len(groups[i].completions)
            values[f][i] = flat[pos:pos + n]
            extras[f][i] = flat_extras[pos:pos + n]
            pos += n

    def _combine(self, gen: _Generation, infos, groups, values, extras) -> ScoreResult:
        policy = self.config.on_error
        out: list[list[CompletionScore]] = []
        for gi, g in enumerate(groups):
            scores = []
            for ci in range(len(g.completions)):
                reward, breakdown, errors, applied = 0.0, {}, [], False
                for fi, info in enumerate(infos):
                    v = values[fi][gi][ci]
                    if isinstance(v, str):
                        errors.append(v)
                    elif v is not None:
                        breakdown[info.name] = v
                        reward += info.weight * v
                        applied = True
                    for key, x in extras[fi][gi][ci].items():  # reported, never summed into the reward
                        breakdown[f"{info.name}/{key}"] = x
                if not math.isfinite(reward):  # finite weights and values can still overflow (1e308 + 1e308)
                    reward = 0.0
                    errors.append(f"the weighted sum of {breakdown} overflows")
                if errors and policy == "fail_request":
                    raise ScoringFailed(f"prompt_id {g.prompt_id!r} completion {ci}: {errors[0]}")
                ok = not errors or policy == "zero"
                message = "; ".join(errors)
                # Every function returned None (TRL: an all-NaN row): no reward, so no baseline share and no loss.
                no_reward = ok and not applied and not errors
                scores.append(CompletionScore(reward if ok else 0.0, breakdown, ok, message, no_reward))
                metrics.scored("no_reward" if no_reward else "ok" if ok else "error")
            out.append(scores)
        return ScoreResult(out, gen.ref)
