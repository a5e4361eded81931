"""Rewarder configuration."""

from __future__ import annotations

from dgrpo.common.config import StrictConfig


class RewarderConfig(StrictConfig):
    """The reward service."""
