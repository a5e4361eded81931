"""Weight-sync configuration, shared by the learner's publisher and the samplers' receivers."""

from __future__ import annotations

from dgrpo.common.config import StrictConfig


class WeightSyncConfig(StrictConfig):
    """How new weights travel from the learner to every sampler."""
