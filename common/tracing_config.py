"""The `tracing` section: where OpenTelemetry spans go (off unless otlp_endpoint is set).

Schema only, kept apart from common/tracing.py: every service's config imports it, and the tracing code checks for its
packages and loads them only when it is on.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from dgrpo.common.config import StrictConfig


class TracingConfig(StrictConfig):
    """OpenTelemetry traces of every service (off unless otlp_endpoint is set)."""

    otlp_endpoint: str | None = None
    """Where spans go: an OTLP receiver, e.g. `http://127.0.0.1:4317` (protocol grpc) or
    `http://127.0.0.1:4318/v1/traces` (protocol http). Unset: no tracing, no connection."""
    protocol: Literal["grpc", "http"] = "grpc"
    """OTLP over gRPC (port 4317 by convention) or over HTTP with protobuf bodies (4318)."""
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of step traces recorded (the learner decides per step; the samplers and the rewarder follow it)."""

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("must be a URL starting with http:// (plaintext) or https://, e.g. http://127.0.0.1:4317")
        return v
