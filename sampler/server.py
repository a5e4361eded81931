"""`dgrpo sampler`: build the engine, serve gRPC (Sampler + health + reflection), metrics, graceful SIGTERM.

Start-up order matters: environment defaults for the device are applied before vLLM is imported; health
stays NOT_SERVING until the engine is up and the latest published weights are loaded, so load balancers and
the learner never send work to a replica that would answer from stale weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import TYPE_CHECKING

from dgrpo.common import cpu_leases, devices, grpc_server, tracing
from dgrpo.common.auth import server_credentials, server_interceptors
from dgrpo.common.auth_config import AuthConfig, Credentials
from dgrpo.common.logs import setup_logging
from dgrpo.common.model_config import ModelConfig
from dgrpo.common.tracing_config import TracingConfig
from dgrpo.sampler.config import SamplerConfig
from dgrpo.weights.config import LoraConfig, WeightSyncConfig

if TYPE_CHECKING:
    from dgrpo.sampler.servicer import SamplerServicer
    from dgrpo.tools.config import MultiTurnConfig

SERVICE_NAME = "dgrpo.v1.Sampler"
log = logging.getLogger("dgrpo.sampler")


async def _watch(engine, metrics, subscriber, period_s: float = 1.0) -> None:
    """Refresh gauges; if the engine died or the weights cannot be trusted any more, exit via SIGTERM so a
    supervisor restarts the replica (it catches up on the latest version before it serves again)."""
    while True:
        metrics.running.set(engine.unfinished_requests)
        metrics.waiting.set(engine.load.waiting)
        metrics.weight_version.set(engine.weight_version)
        metrics.groups_in_flight.set(engine.in_flight)
        if subscriber is not None:
            metrics.weights_loaded(subscriber.last_stats)
        broken = subscriber.failed if subscriber is not None else None
        if engine.dead or broken is not None:
            log.error("%s; shutting the replica down", broken or f"vLLM engine died ({engine.llm.dead_error})")
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(period_s)


def create_server(config: SamplerConfig,
                  credentials: Credentials | None = None) -> tuple[grpc_server.GrpcServer, SamplerServicer]:
    """The bound server and its servicer; the engine is attached to the servicer once it is built (handlers must
    be registered before the server starts, and health answers NOT_SERVING meanwhile). With a token in
    `credentials`, every call but health and reflection must carry it; with TLS, it listens with TLS
    (`common/auth.py`)."""
    creds = credentials or Credentials()
    from dgrpo.sampler.servicer import SamplerServicer
    from dgrpo.v1 import sampler_pb2_grpc

    servicer = SamplerServicer()
    server = grpc_server.create_server(servicer, sampler_pb2_grpc.add_SamplerServicer_to_server, SERVICE_NAME,
                                       host=config.host, port=config.port, config_key="sampler.port",
                                       interceptors=server_interceptors(creds.token, host=config.host,
                                                                        config_key="sampler.host"),
                                       credentials=server_credentials(creds))
    return server, servicer


async def serve(model: ModelConfig, sampler: SamplerConfig, weights: WeightSyncConfig,
                credentials: Credentials | None = None, multi_turn: MultiTurnConfig | None = None,
                tracing_cfg: TracingConfig | None = None, lora: LoraConfig | None = None) -> int:
    """Run one replica until SIGTERM/SIGINT. With `multi_turn` enabled, the replica loads the tool set named by
    its `tool_config_path` (the stack config's learner.rollout.multi_turn: the same file the learner's digest is
    computed from) and serves multi-turn requests. With `lora` (the stack config's learner.lora) publishing adapters,
    the engine serves each adapter version (sampler/lora_target.py)."""
    from dgrpo.common.models import resolve_model_path
    from dgrpo.sampler.engine import SamplerEngine
    from dgrpo.sampler.metrics import SamplerMetrics

    device = devices.detect_device(model.device)
    model_path = str(resolve_model_path(model.path))

    token = (credentials or Credentials()).token
    server, servicer = create_server(sampler, credentials)
    await server.start()  # health answers NOT_SERVING while the engine loads
    port = server.port
    replica_id = sampler.replica_id or f"{socket.gethostname()}:{port}"
    tracing.init(tracing_cfg or TracingConfig(), "sampler", instance=replica_id)
    log.info("loading %s on %s in %s (replica %s, port %d)", model_path, device, model.dtype, replica_id, port)

    engine = SamplerEngine.create(model, sampler, model_path, device, lora)
    if multi_turn is not None and multi_turn.enable:
        engine.enable_tools(multi_turn)  # a bad tool config or an unavailable sandbox fails here, before serving
    metrics = SamplerMetrics(replica_id)
    servicer.attach(engine, replica_id, metrics)

    subscriber = None
    if weights.enabled:
        from dgrpo.sampler.weight_target import EngineWeightTarget
        from dgrpo.weights.subscriber import WeightSubscriber, checkpoint_shapes

        adapters = lora is not None and lora.serves_adapters
        if adapters:
            from dgrpo.sampler.lora_target import LoraWeightTarget

            target = LoraWeightTarget(engine, weights)
        else:
            target = EngineWeightTarget(engine, weights)
        await target.start()
        # The gRPC token also keys the weight channel (TLS does not apply to it): only the run's learner is followed.
        subscriber = WeightSubscriber(weights, target, checkpoint_shapes(model_path),
                                      token=token.encode() if token else None, adapters=adapters)
        await subscriber.start()  # a late replica catches up on the latest version before it serves

    if sampler.metrics_port is not None:
        log.info("Prometheus metrics on http://%s:%d/metrics", sampler.metrics_host,
                 metrics.serve(sampler.metrics_host, sampler.metrics_port))
    gauges = asyncio.create_task(_watch(engine, metrics, subscriber))

    await server.set_serving(True)
    log.info("sampler %s serving on port %d (weight version %d)", replica_id, port, engine.weight_version)
    print(f"DGRPO_READY sampler port={port}", flush=True)

    async def drain() -> None:
        log.info("SIGTERM: draining %d in-flight groups (grace %.0fs)", engine.in_flight, sampler.shutdown_grace_s)
        await engine.drain(sampler.shutdown_grace_s)

    died = False

    async def shutdown() -> None:
        nonlocal died
        died = engine.dead  # before shutdown(): a stopped engine also reports errored
        gauges.cancel()
        if subscriber is not None:
            await subscriber.stop()
        engine.shutdown()
        tracing.shutdown()
        log.info("sampler stopped")

    await grpc_server.serve_until_signal(server, grace=1.0, drain=drain, on_stop=shutdown)
    return 1 if died else 0


def main(model: ModelConfig, sampler: SamplerConfig, weights: WeightSyncConfig, auth: AuthConfig | None = None,
         multi_turn: MultiTurnConfig | None = None, tracing_cfg: TracingConfig | None = None,
         lora: LoraConfig | None = None) -> int:
    """`dgrpo sampler`: the device environment first (vLLM reads it at import), then serve."""
    setup_logging("sampler")
    credentials = (auth or AuthConfig()).credentials()  # an unreadable token or TLS file fails before the engine loads
    device = devices.detect_device(model.device)
    env = devices.sampler_env(device)
    if device == "cpu" and sampler.kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(sampler.kv_cache_space_gib)
    lease = None  # held until this process exits: the cores of `all` among this host's replicas
    if device == "cpu":
        cores = sampler.cpu_cores
        if cores == "all":
            lease = cpu_leases.claim(sampler.replica_id or socket.gethostname())
            cores = lease.binding()
            if lease.peers:
                log.info("sampler.cpu_cores=all: binding cores %s, next to %d other replica(s) of this host on %s",
                         cores, len(lease.peers), "; ".join(",".join(map(str, p)) for p in lease.peers))
        env.update(devices.cpu_thread_binding(cores))
    os.environ.update(env)  # before vLLM is imported
    tracing.check(tracing_cfg or TracingConfig())  # missing packages fail before the engine loads
    lora = lora.on_device(device) if lora is not None else None  # merge_on_sync auto: as the learner decides it
    return asyncio.run(serve(model, sampler, weights, credentials, multi_turn, tracing_cfg, lora))
