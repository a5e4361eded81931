"""The reward service's gRPC edge: a thin servicer over the Scorer, the server lifecycle, and `dgrpo rewarder`.

Lifecycle: bind and report NOT_SERVING, load the spec into the worker pool, report SERVING; SIGHUP reloads
the configured spec; SIGTERM reports NOT_SERVING, lets running requests finish (grace_s), stops the workers.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc

from dgrpo.common import grpc_server, tracing
from dgrpo.common.auth import server_credentials, server_interceptors
from dgrpo.common.auth_config import AuthConfig, Credentials
from dgrpo.common.logs import printable, setup_logging
from dgrpo.common.tracing_config import TracingConfig
from dgrpo.rewarder import convert, metrics
from dgrpo.rewarder.config import RewarderConfig
from dgrpo.rewarder.scorer import NotReady, RequestError, Scorer, ScoringFailed
from dgrpo.rewarder.spec import SpecError
from dgrpo.v1 import rewarder_pb2 as pb
from dgrpo.v1 import rewarder_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Rewarder"].full_name
log = logging.getLogger("dgrpo.rewarder")


class RewarderServicer(rewarder_pb2_grpc.RewarderServicer):
    """Converts messages, calls the Scorer, maps its typed errors to status codes (and nothing else)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        span = tracing.server_span("Score", context.invocation_metadata(), groups=len(request.groups),
                                   prompt_id=request.groups[0].prompt_id if request.groups else "")
        try:
            result = await self.scorer.score(convert.groups_from_proto(request), request.group_size,
                                             convert.trainer_state_from_proto(request))
        except RequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ScoringFailed as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except NotReady as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            span.end()
        return convert.score_response(result, [g.prompt_id for g in request.groups])

    async def Info(self, request: pb.RewarderInfoRequest, context: grpc.aio.ServicerContext) -> pb.RewarderInfo:
        snap = self.scorer.active
        return pb.RewarderInfo(
            spec=convert.spec_ref_to_proto(self.scorer.active_ref),
            functions=[convert.function_info_to_proto(f) for f in snap.functions()] if snap else [],
            workers=self.scorer.config.workers,
            workers_alive=self.scorer.workers_alive,
            on_error=self.scorer.config.on_error,
            in_flight_requests=self.scorer.in_flight,
        )

    async def Reload(self, request: pb.ReloadRequest, context: grpc.aio.ServicerContext) -> pb.ReloadResponse:
        try:
            ref, previous, changed = await self.scorer.reload(request.spec_text or None)
        except SpecError as e:
            log.error("reload rejected, the active spec stays: %s", printable(e, limit=2000))  # quotes the request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.ReloadResponse(
            spec=convert.spec_ref_to_proto(ref), previous=convert.spec_ref_to_proto(previous or ref), changed=changed
        )


def create_server(config: RewarderConfig,
                  credentials: Credentials | None = None) -> tuple[grpc_server.GrpcServer, Scorer]:
    """The bound server (health NOT_SERVING from `start()` until `serve` has loaded the spec) and its scorer. With
    a token in `credentials`, every call but health and reflection must carry it; with TLS, it listens with TLS
    (`common/auth.py`)."""
    creds = credentials or Credentials()
    scorer = Scorer(config)
    server = grpc_server.create_server(
        RewarderServicer(scorer), rewarder_pb2_grpc.add_RewarderServicer_to_server, SERVICE_NAME,
        host=config.host, port=config.port, config_key="rewarder.port",
        interceptors=server_interceptors(creds.token, host=config.host, config_key="rewarder.host"),
        credentials=server_credentials(creds),
    )
    return server, scorer


async def _reload_on_sighup(scorer: Scorer) -> None:
    try:
        ref, _, changed = await scorer.reload(None)
        log.info("SIGHUP: %s", f"now on version {ref.version}" if changed else "spec unchanged")
    except SpecError as e:
        log.error("SIGHUP reload rejected, the active spec stays: %s", e)


async def serve(config: RewarderConfig, credentials: Credentials | None = None) -> int:
    server, scorer = create_server(config, credentials)
    await server.start()
    log.info("rewarder listening on %s:%d, loading the reward spec into %d workers", config.host, server.port,
             config.workers)
    if config.metrics_port is not None:
        log.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_host,
                 metrics.serve(config.metrics_host, config.metrics_port))
        metrics.WORKERS_ALIVE.set_function(lambda: scorer.workers_alive)
    # Before loading: SIGHUP's default action would kill the process; an early one reloads after the first load.
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(_reload_on_sighup(scorer)))
    try:
        await scorer.start()
    except SpecError as e:
        log.error("the reward spec does not load: %s", e)
        await server.stop(0)
        return 1
    await server.set_serving(True)
    log.info("rewarder SERVING on port %d", server.port)
    await grpc_server.serve_until_signal(
        server, grace=config.grace_s, drain=lambda: scorer.drain(config.grace_s), on_stop=scorer.close,
    )
    log.info("rewarder stopped")
    return 0


def main(config: RewarderConfig, auth: AuthConfig | None = None, tracing_cfg: TracingConfig | None = None) -> int:
    """`dgrpo rewarder`: serve the `rewarder` section until SIGTERM (with `auth`'s token and TLS, if set; spans to
    `tracing_cfg`'s endpoint, if set)."""
    setup_logging("rewarder")
    credentials = (auth or AuthConfig()).credentials()
    tracing.init(tracing_cfg or TracingConfig(), "rewarder")
    try:
        return asyncio.run(serve(config, credentials))
    finally:
        tracing.shutdown()
