"""The root configuration of the whole stack: one YAML file, one section per component.

Each section's schema lives next to its component; this file only assembles them, holds the checks that span
components (e.g. prompt + response lengths must fit the sampler's context) and cuts out what each service is
handed (services cannot import this module: it imports all of them).
"""

from __future__ import annotations

import logging

from pydantic import Field

from dgrpo.common.auth_config import AuthConfig
from dgrpo.common.config import ConfigError, StrictConfig
from dgrpo.common.model_config import ModelConfig
from dgrpo.common.tracing_config import TracingConfig
from dgrpo.learner.config import LearnerConfig, LearnerRunConfig
from dgrpo.rewarder.config import RewarderConfig
from dgrpo.sampler.config import SamplerConfig
from dgrpo.weights.config import WeightSyncConfig


class StackConfig(StrictConfig):
    """dgrpo: learner, sampler replicas and rewarder."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model (shared by learner and samplers)."""
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    """Sampler replicas (vLLM)."""
    rewarder: RewarderConfig = Field(default_factory=RewarderConfig)
    """Reward service."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """GRPO trainer and loop driver."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight sync from the learner to every sampler."""
    auth: AuthConfig = Field(default_factory=AuthConfig)
    """The shared token every gRPC service requires and every client sends (docs/security.md)."""
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    """OpenTelemetry traces of every service, one trace per training step (off unless an OTLP endpoint is set)."""

    def check_whole_stack(self) -> None:
        """Checks that span services, run by the commands that drive the whole stack (learner, up).

        Not a validator: a lone `dgrpo sampler` or `dgrpo rewarder` must not fail on the learner's settings.
        """
        prompt, response = self.learner.data.max_prompt_length, self.learner.rollout.max_response_length
        if prompt + response > self.sampler.max_model_len:
            raise ConfigError(
                f"learner.data.max_prompt_length={prompt} + learner.rollout.max_response_length={response} exceeds "
                f"sampler.max_model_len={self.sampler.max_model_len}: the samplers could not hold a full sequence"
            )
        ob = self.learner.algorithm.overlong_buffer
        top = ob.max_response_length or response
        if ob.enable and ob.len > top:
            raise ConfigError(
                f"learner.algorithm.overlong_buffer.len={ob.len} exceeds the maximum response length {top} it ends at "
                "(verl asserts max_resp_len >= overlong_buffer.len)"
            )
        if self.model.device != "auto":
            from dgrpo.weights.transports import transport_for

            try:  # model.device=auto is resolved, and checked the same way, when the learner starts
                transport_for(self.weights).check_device(self.model.device)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.learner.rollout.max_staleness and self.weights.pause_mode == "abort":
            raise ConfigError(
                f"learner.rollout.max_staleness={self.learner.rollout.max_staleness} with weights.pause_mode=abort: "
                "every weight update would abort the batches sampled ahead; use weights.pause_mode=keep"
            )
        if self.learner.rollout.max_staleness and self.weights.pause_mode == "wait":
            logging.getLogger("dgrpo").warning(
                "learner.rollout.max_staleness=%d with weights.pause_mode=wait: each weight update waits for every "
                "request in flight to finish, so sampling stalls at each step; weights.pause_mode=keep lets updates "
                "land between engine steps", self.learner.rollout.max_staleness)

    def learner_run(self) -> LearnerRunConfig:
        """The learner's sections, the sampler addresses it drives, and this whole config for its records."""
        return LearnerRunConfig(model=self.model, learner=self.learner, weights=self.weights,
                                sampler_addresses=self.sampler.addresses, auth=self.auth, tracing=self.tracing,
                                stack=self.model_dump(mode="json"))
