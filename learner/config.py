"""Learner configuration."""

from __future__ import annotations

from dgrpo.common.config import StrictConfig


class LearnerConfig(StrictConfig):
    """The GRPO trainer."""
