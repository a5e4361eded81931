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

from dgrpo.common import devices
from dgrpo.common.grpc_server import CHANNEL_OPTIONS, add_standard_services, serve_until_signal, set_health
from dgrpo.common.logs import setup_logging

SERVICE_NAME = "dgrpo.v1.Sampler"
log = logging.getLogger("dgrpo.sampler")


async def _watch(engine, metrics, period_s: float = 1.0) -> None:
    """Refresh gauges; if the engine process died, exit via SIGTERM so a supervisor restarts the replica."""
    while True:
        metrics.running.set(engine.unfinished_requests)
        metrics.waiting.set(engine.load.waiting)
        metrics.weight_version.set(engine.weight_version)
        if engine.dead:
            log.error("vLLM engine died (%s); shutting the replica down", engine.llm.dead_error)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        await asyncio.sleep(period_s)


async def serve(cfg) -> int:
    """Run one replica until SIGTERM/SIGINT (cfg: the StackConfig)."""
    import grpc

    from dgrpo.common.models import resolve_model_path
    from dgrpo.sampler.engine import SamplerEngine
    from dgrpo.sampler.metrics import SamplerMetrics
    from dgrpo.sampler.servicer import SamplerServicer
    from dgrpo.v1 import sampler_pb2_grpc

    scfg = cfg.sampler
    device = devices.detect_device(cfg.model.device)
    model_path = str(resolve_model_path(cfg.model.path))

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    servicer = SamplerServicer()  # handlers must be registered before start; the engine is attached below
    sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, server)
    health = add_standard_services(server, [SERVICE_NAME])
    await set_health(health, [SERVICE_NAME], serving=False)
    port = server.add_insecure_port(f"{scfg.host}:{scfg.port}")
    await server.start()  # health answers NOT_SERVING while the engine loads
    replica_id = scfg.replica_id or f"{socket.gethostname()}:{port}"
    log.info("loading %s on %s (replica %s, port %d)", model_path, device, replica_id, port)

    engine = SamplerEngine.create(cfg.model, scfg, model_path, device)
    metrics = SamplerMetrics(replica_id)
    servicer.attach(engine, replica_id, metrics)

    loader = None
    if getattr(cfg.weights, "enabled", False):
        from dgrpo.sampler.weight_loader import WeightLoader

        loader = WeightLoader(engine, cfg.weights, model_path)
        await loader.start()  # a late replica catches up on the latest version before it serves

    if scfg.metrics_port is not None:
        log.info("metrics on http://0.0.0.0:%d/metrics", metrics.serve(scfg.metrics_port))
    gauges = asyncio.create_task(_watch(engine, metrics))

    await set_health(health, [SERVICE_NAME], serving=True)
    log.info("sampler %s serving on port %d (weight version %d)", replica_id, port, engine.weight_version)
    print(f"DGRPO_READY sampler port={port}", flush=True)

    async def drain() -> None:
        log.info("SIGTERM: draining %d in-flight groups (grace %.0fs)", engine.in_flight, scfg.shutdown_grace_s)
        await engine.drain(scfg.shutdown_grace_s)

    died = False

    async def shutdown() -> None:
        nonlocal died
        died = engine.dead  # before shutdown(): a stopped engine also reports errored
        gauges.cancel()
        if loader is not None:
            await loader.stop()
        engine.shutdown()
        log.info("sampler stopped")

    await serve_until_signal(server, health, [SERVICE_NAME], grace=1.0, on_signal=drain, on_stop=shutdown)
    return 1 if died else 0


def main(cfg) -> int:
    setup_logging("sampler")
    device = devices.detect_device(cfg.model.device)
    env = devices.sampler_env(device)
    if device == "cpu" and cfg.sampler.kv_cache_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.sampler.kv_cache_space_gib)
    if device == "cpu":
        env.update(devices.cpu_thread_binding(cfg.sampler.cpu_cores))
    os.environ.update(env)  # before vLLM is imported
    return asyncio.run(serve(cfg))
