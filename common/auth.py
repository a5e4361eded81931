"""Who may call the gRPC services: the shared bearer token, optional (mutual) TLS, the server side, the channels.

Every RPC except the standard health service and reflection (they reveal only the public protos and whether a
server is up) must carry the metadata `authorization: Bearer <token>`; anything else is aborted UNAUTHENTICATED,
without echoing what was presented. The token is compared in constant time. It comes from a file
(`auth.token_file`) or the `DGRPO_TOKEN` environment variable, never from the YAML or the command line, where it
would show in `ps`, shell history, logs and the run's stack.yaml. No token configured: no authentication (the
services bind loopback by default then; see docs/security.md).

Without TLS the token crosses the network in clear: it keeps out whoever can reach a port, not whoever can read
the traffic. With `auth.tls` (PEM files read from disk) every server listens with TLS, every client verifies the
server against the CA, and with `require_client_cert` a server also refuses any client without a certificate from
that CA (mutual TLS). The token is checked either way. One `Credentials` object, made once from AuthConfig, is what
servers and channels take. The config and the checks of its files are in common/auth_config.py (no grpc there).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Sequence
from typing import Any

import grpc

from dgrpo.common.auth_config import TOKEN_ENV, Credentials, TlsMaterial
from dgrpo.common.config import ConfigError

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
# Methods any caller may use: health (supervisors, load balancers, compose probes) and reflection (grpcurl's
# listing). Neither changes anything nor returns run data.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")


# ---- credentials ------------------------------------------------------------------------------------------------


def server_credentials(credentials: Credentials | None) -> grpc.ServerCredentials | None:
    """For `grpc_server.create_server(credentials=...)`: TLS (mutual if configured), or None: plaintext."""
    tls = None if credentials is None else credentials.tls
    if tls is None:
        return None
    if tls.certificate_chain is None or tls.private_key is None:
        raise ConfigError("a TLS server needs auth.tls.cert_file and auth.tls.key_file")
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)],
        root_certificates=tls.root_certificates if tls.require_client_cert else None,
        require_client_auth=tls.require_client_cert)


def _channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    """Verify the server against the CA; present this process's certificate when the server asks for one."""
    return grpc.ssl_channel_credentials(tls.root_certificates, tls.private_key, tls.certificate_chain)


# ---- server side ------------------------------------------------------------------------------------------------


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Serves a call only if it carries `authorization: Bearer <token>`; health and reflection are open."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        presented = [v for k, v in (handler_call_details.invocation_metadata or ()) if k == METADATA_KEY]
        if len(presented) == 1 and isinstance(presented[0], str) and hmac.compare_digest(
                presented[0].encode(), self._expected):
            return handler
        why = "no `authorization` metadata" if not presented else "the `authorization` metadata does not match"
        return _denied(handler, f"{why}: this server requires `authorization: Bearer <token>` with the stack's "
                                f"shared token (auth.token_file or {TOKEN_ENV})")


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts UNAUTHENTICATED before reading anything."""

    async def abort(_request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # No request deserializer: the body of a call without the token is never parsed (a garbage body would
    # otherwise answer UNKNOWN from the parser before the token is checked).
    codecs = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **codecs)
    return grpc.stream_stream_rpc_method_handler(abort, **codecs)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_interceptors(token: str | None, *, host: str, config_key: str) -> list[grpc.aio.ServerInterceptor]:
    """What `grpc_server.create_server(interceptors=...)` gets: the token check, or nothing (and a warning when the
    server is reachable from other hosts with no token, `config_key` naming its bind address)."""
    if token is None:
        if not _is_loopback(host):
            log.warning("%s=%s without a token: anyone who reaches this port can call every RPC (set "
                        "auth.token_file or %s; docs/security.md)", config_key, host, TOKEN_ENV)
        return []
    return [TokenInterceptor(token)]


# ---- client side ------------------------------------------------------------------------------------------------


class _TokenMetadata:
    def __init__(self, token: str):
        self._pair = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_TokenMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def channel(target: str, credentials: Credentials | None,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to `target`: TLS when `credentials.tls` is set (the server verified against the CA, this
    process's certificate presented when asked), else plaintext; every call carries the token, if one is set.

    Metadata rather than call credentials: gRPC attaches call credentials only to TLS or local channels, and one
    path for both keeps plaintext and TLS stacks alike."""
    creds = credentials or Credentials()
    interceptors = None if creds.token is None else [cls(creds.token) for cls in (_UnaryUnary, _UnaryStream,
                                                                                   _StreamUnary, _StreamStream)]
    if creds.tls is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(target, _channel_credentials(creds.tls),
                                   options=[*options, *creds.tls.channel_options()], interceptors=interceptors)


def health_channel(target: str, credentials: Credentials | None) -> grpc.Channel:
    """A blocking channel for polling gRPC health (supervisors): TLS as configured, no token (health is open)."""
    tls = (credentials or Credentials()).tls
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, _channel_credentials(tls), options=tls.channel_options())


def not_serving(channel: grpc.Channel, timeout: float, service: str = "") -> str | None:
    """One gRPC health Check on `channel`: None when it answers SERVING, else why not (the status, or the error)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                            timeout=timeout).status
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()}"
    if status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
