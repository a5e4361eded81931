"""gRPC server plumbing every service shares: health checking, reflection, graceful SIGTERM.

Lifecycle as a pair (grpc's own examples): a service's `create_server` registers its servicer and calls
`add_standard_services`; `serve_until_signal` runs it and, on SIGTERM/SIGINT, flips health to NOT_SERVING,
stops accepting and gives in-flight calls `grace` seconds.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Message size limit for every channel and server: groups of long completions exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def add_standard_services(server: grpc.aio.Server, service_names: list[str]):
    """Register health and reflection; returns the health servicer. Call `set_health` before serving:
    a service reports NOT_SERVING until it has loaded what it needs."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def set_health(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        result = health_servicer.set(name, status)
        if asyncio.iscoroutine(result):
            await result


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer,
    service_names: list[str],
    *,
    grace: float,
    on_signal: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT; then NOT_SERVING, `on_signal` (e.g. let in-flight work drain),
    server.stop(grace) (cancels what is still running after `grace`), and `on_stop` (e.g. engine shutdown)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_health(health_servicer, service_names, serving=False)
    if on_signal is not None:
        await on_signal()
    await server.stop(grace)
    if on_stop is not None:
        await on_stop()
