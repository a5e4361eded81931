"""The learner's client of the reward service: one Score call per arriving group.

Each group is sent as soon as the sampler streams it, so scoring overlaps the generation of the other groups. The
rewarder may go away and come back while training runs (a restart, a hot swap to a new process): calls wait for the
channel to be ready (`wait_for_ready`) and are retried on UNAVAILABLE with backoff, bounded by
`rollout.reward_timeout_s` per group. A rewarder that hangs without an error (a frozen process, dropped packets) misses
the channel's keepalive pings, so its calls fail within seconds and are retried the same way. Requests the rewarder
rejects (INVALID_ARGUMENT, FAILED_PRECONDITION) stop the run with the rewarder's message: retrying the same input cannot
help.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import struct_pb2

from dgrpo.common import auth, tracing
from dgrpo.common.auth_config import Credentials
from dgrpo.common.grpc_server import keepalive_options
from dgrpo.common.retry import Backoff
from dgrpo.learner.rollout.client import CLIENT_OPTIONS
from dgrpo.v1 import rewarder_pb2, rewarder_pb2_grpc, sampler_pb2

log = logging.getLogger(__name__)

RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
               grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


class RewardError(RuntimeError):
    """The rewarder rejected a request, or did not answer within `rollout.reward_timeout_s`."""


@dataclass
class GroupReward:
    """Scores of one group's completions, in sample order."""

    rewards: list[float]
    """Reward per completion; for a completion without one (failed, or NO_REWARD), the mean of the group's valid
    rewards."""
    valid: list[bool]
    """False where the rewarder reported ERROR or NO_REWARD: such a completion is kept out of the group's baseline
    and the policy gradient (advantage 0)."""
    breakdown: list[dict[str, float]]
    """Per-function values of each completion (a function that returned None is absent)."""
    spec: str
    """The reward specification that produced the scores: name@version#hash-prefix."""
    spec_version: int = 0
    """That specification's version in the rewarder (increments on each reload): the learner logs it per step."""
    errors: list[str] = field(default_factory=list)
    """Messages of the failed completions."""
    retries: int = 0
    """Score calls retried for this group (rewarder away or restarting)."""
    no_reward: list[bool] = field(default_factory=list)
    """True where every reward function returned None (NO_REWARD): not valid, and not an error either."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the reward functions logged with `log_metric` for this group (mean per name)."""


def to_struct(extra: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(extra)
    return s


def score_group(prompt_id: str, prompt: str | list[dict[str, str]], completions: Sequence[str],
                extra: dict[str, Any], completion_ids: Sequence[Sequence[int]] | None = None,
                conversations: Sequence[Sequence[sampler_pb2.ChatMessage]] | None = None) -> rewarder_pb2.ScoreGroup:
    """The ScoreGroup for one prompt: text prompts stay text, chat prompts go as messages (TRL's two formats); the
    completions' token ids when given (TRL's `completion_ids`); multi-turn completions as their conversations
    (the sampler's turns after the prompt), so reward functions see the tool calls and results."""
    group = rewarder_pb2.ScoreGroup(prompt_id=prompt_id, completions=list(completions), extra=to_struct(extra))
    for ids in completion_ids or []:
        group.completion_ids.add(ids=ids)
    for turns in conversations or []:
        group.completion_chats.add().messages.extend(
            rewarder_pb2.RewardChatMessage(role=m.role, content=m.content, name=m.name, tool_calls=[
                rewarder_pb2.RewardToolCall(name=c.name, arguments=c.arguments) for c in m.tool_calls])
            for m in turns)
    if isinstance(prompt, str):
        group.text = prompt
    else:
        group.chat.messages.extend(rewarder_pb2.RewardChatMessage(role=m["role"], content=m["content"])
                                   for m in prompt)
    return group


def _spec_name(spec: rewarder_pb2.RewardSpecRef) -> str:
    return f"{spec.name}@{spec.version}#{spec.content_hash[:8]}"


class RewardClient:
    """Scores groups against one rewarder address, surviving its restarts."""

    def __init__(self, address: str, *, timeout_s: float, retry_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 credentials: Credentials | None = None, keepalive_s: float = 10.0,
                 keepalive_timeout_s: float = 5.0):
        """`keepalive_s` / `keepalive_timeout_s` (rollout's): a frozen or cut-off rewarder fails the calls in flight
        within their sum, and they are retried (waiting for it to come back) instead of hanging to the deadline."""
        self.address, self.timeout_s = address, timeout_s
        self.retry_backoff_s, self.max_backoff_s = retry_backoff_s, max_backoff_s
        options = [*CLIENT_OPTIONS, *keepalive_options(keepalive_s, keepalive_timeout_s)]
        self._channel = auth.channel(address, credentials, options)
        self._stub = rewarder_pb2_grpc.RewarderStub(self._channel)

    async def info(self, timeout: float = 10.0) -> rewarder_pb2.RewarderInfo:
        return await self._stub.Info(rewarder_pb2.RewarderInfoRequest(), timeout=timeout, wait_for_ready=True)

    async def score(self, group: rewarder_pb2.ScoreGroup,
                    trainer_state: rewarder_pb2.RewardTrainerState | None = None) -> GroupReward:
        """Score one group; retried until `timeout_s` while the rewarder is away. `trainer_state` reaches the reward
        functions as TRL's `trainer_state` (the step they shape rewards by)."""
        deadline = time.monotonic() + self.timeout_s
        request = rewarder_pb2.ScoreRequest(groups=[group], group_size=len(group.completions),
                                            trainer_state=trainer_state)
        span = tracing.client_span("Score", prompt_id=group.prompt_id, completions=len(group.completions))
        try:
            response, retries = await self._score_call(request, group, deadline, span.metadata)
        finally:
            span.end()
        return self._to_reward(group, response, retries)

    async def _score_call(self, request: rewarder_pb2.ScoreRequest, group: rewarder_pb2.ScoreGroup, deadline: float,
                          metadata) -> tuple[rewarder_pb2.ScoreResponse, int]:
        """The Score call, retried while the rewarder is away; (response, retries)."""
        backoff, retries = Backoff(self.retry_backoff_s, self.max_backoff_s), 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RewardError(f"rewarder {self.address} did not score group {group.prompt_id!r} within "
                                  f"rollout.reward_timeout_s={self.timeout_s:g}s ({retries} retries)")
            try:
                # wait_for_ready: while the rewarder restarts the call waits for it instead of failing at once.
                response = await self._stub.Score(request, timeout=remaining, wait_for_ready=True,
                                                  metadata=metadata)
                return response, retries
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    continue  # the loop's deadline check raises with the full story
                if e.code() not in RETRY_CODES:
                    raise RewardError(f"rewarder {self.address} rejected group {group.prompt_id!r}: "
                                      f"{e.code().name}: {e.details()}") from None
                retries += 1
                log.warning("rewarder %s: %s (%s); retrying group %r in %.1fs", self.address, e.code().name,
                            e.details(), group.prompt_id, backoff.delay)
                await backoff.wait(limit=deadline - time.monotonic())

    @staticmethod
    def _to_reward(group: rewarder_pb2.ScoreGroup, response: rewarder_pb2.ScoreResponse, retries: int) -> GroupReward:
        if len(response.groups) != 1 or response.groups[0].prompt_id != group.prompt_id:
            raise RewardError(f"rewarder answered {[g.prompt_id for g in response.groups]} for {group.prompt_id!r}")
        scores = response.groups[0].scores
        if len(scores) != len(group.completions):
            raise RewardError(f"rewarder sent {len(scores)} scores for {len(group.completions)} completions")
        valid = [s.status == rewarder_pb2.SCORE_STATUS_OK and math.isfinite(s.reward) for s in scores]
        no_reward = [s.status == rewarder_pb2.SCORE_STATUS_NO_REWARD for s in scores]
        good = [s.reward for s, ok in zip(scores, valid, strict=True) if ok]
        # A failed completion takes the group mean: it then has advantage ~0 and, being masked, no effect on
        # the other completions' advantages beyond keeping the group size fixed.
        fill = sum(good) / len(good) if good else 0.0
        return GroupReward(
            rewards=[s.reward if ok else fill for s, ok in zip(scores, valid, strict=True)],
            valid=valid,
            breakdown=[dict(s.breakdown) for s in scores],
            spec=_spec_name(response.spec),
            spec_version=response.spec.version,
            errors=[s.message for s, ok, none in zip(scores, valid, no_reward, strict=True) if not ok and not none],
            retries=retries,
            no_reward=no_reward,
            metrics=dict(response.groups[0].metrics),
        )

    async def close(self) -> None:
        await self._channel.close()
