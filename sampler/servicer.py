"""gRPC adapter of the sampler: protos in, SamplerEngine calls, protos out; typed errors -> status codes."""

from __future__ import annotations

import logging

import grpc

from dgrpo.sampler.convert import group_to_pb, multi_turn_from_pb, prompt_from_pb, sampling_from_pb
from dgrpo.sampler.engine import EngineUnavailable, InvalidRequest, SamplerEngine, WeightVersionTimeout
from dgrpo.sampler.metrics import SamplerMetrics
from dgrpo.sampler.multi_turn import ToolsUnavailable
from dgrpo.v1 import sampler_pb2 as pb
from dgrpo.v1 import sampler_pb2_grpc

log = logging.getLogger(__name__)

MAX_DETAILS_BYTES = 2000
"""Longest status message (UTF-8 bytes). gRPC sends it percent-encoded in a trailer, and a trailer over the client's
metadata limit (8 KiB) turns the whole answer into RESOURCE_EXHAUSTED "Stream removed": a message quoting a 20 kB
prompt id would hide why the request was refused."""


def _details(e: Exception) -> str:
    raw = str(e).encode()
    if len(raw) <= MAX_DETAILS_BYTES:
        return str(e)
    return raw[:MAX_DETAILS_BYTES].decode(errors="ignore") + f"...[{len(raw) - MAX_DETAILS_BYTES} more bytes]"


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
        try:
            async for group in self.engine.generate(
                prompts, sampling, request.min_weight_version, request.weight_wait_timeout_s or None,
                multi_turn=multi_turn_from_pb(request),
            ):
                self.metrics.groups.inc()
                # Tokens the model sampled (a multi-turn trajectory's tool and template tokens are not generated).
                self.metrics.generated_tokens.inc(sum(sum(c.mask) if c.mask else len(c.token_ids)
                                                      for c in group.completions))
                yield group_to_pb(group, self.replica_id)
        except InvalidRequest as e:
            outcome = "invalid"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(e))
        except ToolsUnavailable as e:
            outcome = "no_tools"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _details(e))
        except WeightVersionTimeout as e:
            outcome = "fenced"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, _details(e))
        except EngineUnavailable as e:
            outcome = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, _details(e))
        except BaseException:
            outcome = "cancelled_or_failed"
            raise
        finally:
            self.metrics.request_done(outcome)

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
