"""Multi-turn rollout configuration, in verl's vocabulary (`actor_rollout_ref.rollout.multi_turn.*`).

Lives at `learner.rollout.multi_turn` in the stack config; the sampler reads the same section to find its tools.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dgrpo.common.config import StrictConfig


class MultiTurnConfig(StrictConfig):
    """Rollouts where the model may call tools between turns (off by default: one completion per sample)."""

    enable: bool = False
    """Continue each sample turn by turn: parse tool calls, run them sandboxed, append the results as tool messages,
    until the model answers without a call or a limit below is hit (verl: multi_turn.enable)."""
    tool_config_path: str | None = None
    """verl-format tool config (YAML `tools:` list with class_name / config / tool_schema; docs/tools.md). Read by
    each sampler from its own copy of the stack config; required when enable is true."""
    max_assistant_turns: int = Field(default=5, ge=1, le=64)
    """Model turns per sample, the first included (verl: max_assistant_turns). More turns cost more time and KV
    cache for the growing history."""
    max_tool_calls: int = Field(default=8, ge=1, le=256)
    """Tool calls per sample, all turns together; calls beyond it get an error tool message and are not run."""
    max_parallel_calls: int = Field(default=1, ge=1, le=16)
    """Tool calls run per assistant turn (verl: max_parallel_calls); extra calls in one turn get an error message."""
    max_response_length: int | None = Field(default=None, ge=1)
    """Total tokens of the trajectory after the prompt, model and tool tokens together (verl: response_length).
    Unset: the sampling max_tokens."""
    max_tool_response_length: int = Field(default=1024, ge=16, le=1_000_000)
    """Characters of one tool result kept in the conversation (verl's name); longer results are cut."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a long tool result is cut (verl's name): left keeps the end, right keeps the start, middle
    keeps both ends."""
    format: Literal["hermes"] = "hermes"
    """Tool-call format the model writes and the parser reads: Hermes `<tool_call>{json}</tool_call>` (verl: format)."""
    tool_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """Wall-clock limit of one tool call; the call's whole process tree is killed when it runs over."""
    tool_memory_mb: int = Field(default=512, ge=64, le=1_048_576)
    """Address-space limit of one tool call's process (RLIMIT_AS), interpreter included."""
    tool_workers: int = Field(default=8, ge=1, le=256)
    """Tool calls one sampler runs at once (each is a process); more calls wait."""
    sandbox: Literal["strict", "process"] = "strict"
    """Isolation tool calls need. strict: separate pid, network and mount namespaces, a read-only filesystem except a
    per-call scratch folder, an unprivileged uid (or Landlock) — the sampler refuses to start where that is not
    available (e.g. a container without CAP_SYS_ADMIN or user namespaces). process: only a separate process with
    time, memory and file-size limits — tools can reach the network and write what the sampler's user can; for
    trusted tools on a machine where namespaces are off."""

    @model_validator(mode="after")
    def _needs_tools(self) -> MultiTurnConfig:
        if self.enable and not self.tool_config_path:
            raise ValueError("multi_turn.enable is true but multi_turn.tool_config_path is not set (a verl-format "
                             "tool config; see docs/tools.md)")
        return self

    def limits(self):
        """The per-call limits the ToolRunner enforces."""
        from dgrpo.tools.sandbox import ToolLimits

        return ToolLimits(timeout_s=self.tool_timeout_s, memory_mb=self.tool_memory_mb,
                          max_output_chars=self.max_tool_response_length,
                          truncate_side=self.tool_response_truncate_side)
