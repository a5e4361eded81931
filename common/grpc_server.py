"""The one gRPC server bootstrap every service uses: bind, health, reflection, graceful SIGTERM.

Lifecycle as a pair (grpc's own examples): a service's `create_server(config)` registers its servicer through
`create_server` here, which adds health and reflection and binds (a failed bind names the config key);
`serve_until_signal` runs it. Health answers NOT_SERVING from `start()` until the service has loaded what it needs
and calls `set_serving(True)`; on SIGTERM/SIGINT it flips back to NOT_SERVING, lets in-flight work drain, and stops
the server with a grace period. Server interceptors (the token check) and server credentials (TLS) are passed here
and nowhere else (both come from `common/auth.py`).
"""

from __future__ import annotations

import asyncio
import inspect
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Message size limit for every channel and server: groups of long completions exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken port would bind, and the two would split
# the connections silently. Off, a taken port fails the bind, which `create_server` reports.
# Keepalive pings: clients ping every few seconds (`keepalive_options`) to find a peer that is frozen or cut off
# without a reset. A server by default answers pings more often than every 5 minutes on a quiet connection with
# GOAWAY "too_many_pings", which would end every long Generate stream: it accepts one every second here, however
# many (gRPC's keepalive guide, https://grpc.io/docs/guides/keepalive/).
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Client channel options that close the connection to a peer that has not answered a ping within
    `interval_s + timeout_s`: its calls fail (UNAVAILABLE) although no error or reset ever arrives (a SIGSTOPped
    process, a host whose packets are dropped)."""
    return [
        ("grpc.keepalive_time_ms", int(interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        # Any ping in flight (gRPC's own bandwidth probes too) holds back the keepalive ping and has its own ack
        # deadline, 60 s by default: bounded the same way, a frozen peer is found within interval + timeout.
        ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class BindError(OSError):
    """The server cannot listen on the configured address (taken, or not an address of this host)."""


@dataclass
class GrpcServer:
    """A bound grpc.aio server with health and reflection; made by `create_server`."""

    server: grpc.aio.Server
    port: int
    """The bound port (the configured one, or the one picked for port 0)."""
    service_names: list[str]
    health: health.aio.HealthServicer

    async def start(self) -> None:
        """Accept calls, with health NOT_SERVING (the health servicer's default would be SERVING)."""
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        """Health of the whole server ("") and of each service."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def stop(
        self,
        grace: float,
        *,
        drain: Callable[[], Awaitable[None]] | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """NOT_SERVING (balancers stop sending), `drain` (e.g. let in-flight work finish), server.stop(grace)
        (cancels what still runs after `grace` seconds), then `on_stop` (e.g. engine shutdown)."""
        await self.set_serving(False)
        if drain is not None:
            await drain()
        await self.server.stop(grace)
        if on_stop is not None:
            await on_stop()


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Parses unary request bodies itself, so one that does not parse answers INVALID_ARGUMENT naming the message
    type (grpc.aio's own parsing answers UNKNOWN, which clients retry as if transient). Innermost: the token check
    runs before any byte is parsed."""

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, codecs = handler.request_deserializer, {"response_serializer": handler.response_serializer}
        if handler.unary_unary:
            inner_unary = handler.unary_unary

            async def unary(body: bytes, context: grpc.aio.ServicerContext):
                return await inner_unary(await _parsed(parse, body, context), context)

            return grpc.unary_unary_rpc_method_handler(unary, **codecs)
        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            inner_stream = handler.unary_stream

            async def stream(body: bytes, context: grpc.aio.ServicerContext):
                async for item in inner_stream(await _parsed(parse, body, context), context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, **codecs)
        return handler


async def _parsed(parse: Callable[[bytes], Any], body: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(body)
    except Exception as e:  # noqa: BLE001 (protobuf's DecodeError, or anything a custom deserializer raises)
        owner = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        name = getattr(owner, "full_name", "request")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the request body is not a valid {name} message ({type(e).__name__})")


def create_server(
    servicer: Any,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
    *,
    host: str,
    port: int,
    config_key: str,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """A server with `servicer` (registered by its generated `add_*Servicer_to_server`), health and reflection,
    bound to host:port, with TLS when `credentials` are given (`auth.server_credentials(...)`; health and
    reflection then answer over TLS too). `config_key` names the setting of the port in a BindError. Not started:
    call `start()`."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, ParseInterceptor()])
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([service_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio raises "Failed to bind"; older versions returned port 0
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address} ({config_key}={port}): the port is taken or {host!r} is not "
                        "an address of this host")
    return GrpcServer(server, bound, [service_name], health_servicer)


async def serve_until_signal(
    server: GrpcServer,
    *,
    grace: float,
    drain: Callable[[], Awaitable[None]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then `server.stop(grace, drain=..., on_stop=...)`. Further signals during the
    stop are absorbed, so a second Ctrl-C does not cut the drain short."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await server.stop(grace, drain=drain, on_stop=on_stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
