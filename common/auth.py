"""A shared bearer token for every gRPC service: its config, the server interceptor, the client channel.

Every RPC except the standard health service and reflection (they reveal only the public protos and whether a
server is up) must carry the metadata `authorization: Bearer <token>`; anything else is aborted UNAUTHENTICATED,
without echoing what was presented. The token is compared in constant time. It comes from a file
(`auth.token_file`) or the `DGRPO_TOKEN` environment variable, never from the YAML or the command line, where it
would show in `ps`, shell history, logs and the run's stack.yaml. No token configured: no authentication (the
services bind loopback by default then; see docs/security.md).

Without TLS the token crosses the network in clear: it keeps out whoever can reach a port, not whoever can read
the traffic.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from pydantic import model_validator

from dgrpo.common.config import ConfigError, StrictConfig

log = logging.getLogger(__name__)

TOKEN_ENV = "DGRPO_TOKEN"
METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
# Methods any caller may use: health (supervisors, load balancers, compose probes) and reflection (grpcurl's
# listing). Neither changes anything nor returns run data.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")


class AuthConfig(StrictConfig):
    """Authentication of every gRPC call between the services (a shared bearer token; unset: none)."""

    token_file: Path | None = None
    """File holding the shared token (one line, at least 16 printable characters without spaces; e.g. the output
    of `python -c "import secrets; print(secrets.token_urlsafe(32))"`). Unset: the `DGRPO_TOKEN` environment
    variable, and with neither, no authentication. The token itself is never a config key."""

    @model_validator(mode="before")
    @classmethod
    def _no_inline_token(cls, data: Any) -> Any:
        if isinstance(data, dict) and "token" in data:
            raise ValueError(
                "auth.token cannot be set in the config or on the command line (it would show in `ps`, shell "
                f"history, logs and stack.yaml): put the token in a file named by auth.token_file, or in {TOKEN_ENV}"
            )
        return data

    def token(self) -> str | None:
        """The configured token (from `token_file`, else `DGRPO_TOKEN`), or None for no authentication.

        Raises ConfigError for an unreadable file or an unusable token (the message never contains the token)."""
        if self.token_file is not None:
            try:
                text = self.token_file.read_text()
            except OSError as e:
                raise ConfigError(f"auth.token_file={str(self.token_file)!r} cannot be read: {e.strerror}") from None
            return _checked(text.strip(), f"the token in auth.token_file={str(self.token_file)!r}")
        text = os.environ.get(TOKEN_ENV, "").strip()
        return _checked(text, f"${TOKEN_ENV}") if text else None  # empty (compose's `${DGRPO_TOKEN:-}`): unset


def _checked(token: str, where: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"{where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} (e.g. "
                          "python -c \"import secrets; print(secrets.token_urlsafe(32))\")")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigError(f"{where} must be printable ASCII without spaces (it travels as gRPC metadata)")
    return token


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

    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
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


def insecure_channel(target: str, token: str | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A plaintext grpc.aio channel whose every call carries the token (none: a plain channel, as before).

    Metadata rather than call credentials: gRPC attaches call credentials only to TLS or local channels."""
    interceptors = None if token is None else [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary,
                                                                       _StreamStream)]
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
