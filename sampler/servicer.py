"""gRPC adapter of the sampler: protos in, SamplerEngine calls, protos out; typed errors -> status codes."""

from __future__ import annotations

import asyncio
import logging

import grpc

from dgrpo.common import tracing
from dgrpo.common.logs import bounded
from dgrpo.sampler.convert import group_to_pb, multi_turn_from_pb, prompt_from_pb, sampling_from_pb
from dgrpo.sampler.engine import EngineUnavailable, SamplerEngine, WeightVersionTimeout
from dgrpo.sampler.metrics import SamplerMetrics
from dgrpo.sampler.multi_turn import ToolsUnavailable
from dgrpo.sampler.requests import InvalidRequest
from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc

log = logging.getLogger(__name__)

# The engine's typed errors -> (status code, outcome label of the request metrics). Anything else propagates: a
# cancelled stream, or a bug that gRPC reports as UNKNOWN.
STATUS: dict[type[Exception], tuple[grpc.StatusCode, str]] = {
    InvalidRequest: (grpc.StatusCode.INVALID_ARGUMENT, "invalid"),
    ToolsUnavailable: (grpc.StatusCode.FAILED_PRECONDITION, "no_tools"),
    WeightVersionTimeout: (grpc.StatusCode.DEADLINE_EXCEEDED, "fenced"),
    EngineUnavailable: (grpc.StatusCode.UNAVAILABLE, "unavailable"),
}


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    """Registered before the server starts (gRPC requires it); answers UNAVAILABLE until `attach`."""

    engine: SamplerEngine | None = None

    def attach(self, engine: SamplerEngine, replica_id: str, metrics: SamplerMetrics) -> None:
        self.engine, self.replica_id, self.metrics = engine, replica_id, metrics

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sampler engine is still loading")
        prompts = [prompt_from_pb(p) for p in request.prompts]
        sampling = sampling_from_pb(request.sampling)
        outcome = "ok"
        self.metrics.requests_in_flight.inc()
        span = tracing.server_span("Generate", context.invocation_metadata(), replica=self.replica_id,
                                   prompts=len(request.prompts), min_weight_version=request.min_weight_version)
        try:
            async for group in self.engine.generate(
                prompts, sampling, request.min_weight_version, request.weight_wait_timeout_s or None,
                multi_turn=multi_turn_from_pb(request),
            ):
                # Tokens the model sampled (a multi-turn trajectory's tool and template tokens are not generated).
                self.metrics.group_streamed(sum(sum(c.mask) if c.mask else len(c.token_ids) for c in group.completions))
                yield group_to_pb(group, self.replica_id)
        except tuple(STATUS) as e:
            code, outcome = next(v for t, v in STATUS.items() if isinstance(e, t))
            await context.abort(code, bounded(str(e)))
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"  # the client went away or cancelled (the learner does once its last group came)
            raise
        except BaseException:
            outcome = "failed"
            raise
        finally:
            self.metrics.requests_in_flight.dec()
            self.metrics.request_done(outcome)
            span.end(outcome=outcome, weight_version=self.engine.weight_version)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.SamplerInfo:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sampler engine is still loading")
        e = self.engine
        return pb.SamplerInfo(
            model=e.model_path,
            dtype=e.model_cfg.dtype,
            device=e.device,
            max_model_len=e.max_model_len,
            replica_id=self.replica_id,
            weight_version=e.weight_version,
            running_requests=e.unfinished_requests,
            waiting_requests=e.load.waiting,
            vocab_size=e.vocab_size,
            busy_seconds=e.busy_seconds,
            engine_steps=e.load.steps,
        )
