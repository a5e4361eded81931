"""OpenTelemetry tracing across the services: one trace per training step.

The learner opens a `step` span; inside it every Generate call (one client span per call, naming the replica),
every Score call, and the `publish` of the new weights. The W3C trace context (`traceparent`,
https://www.w3.org/TR/trace-context/) travels as gRPC metadata, so the sampler's and the rewarder's server spans join
the learner's trace, and inside the weight announcement (`WeightAnnouncement.traceparent`), so each replica's
`load_weights` span joins the publish that it loads. Spans go to an OTLP endpoint (an OpenTelemetry Collector,
Jaeger, Tempo, ...; https://opentelemetry.io/docs/specs/otlp/).

Off unless `tracing.otlp_endpoint` is set: then nothing here imports OpenTelemetry, every helper returns a no-op,
and no connection is made. On, it needs the `tracing` extra (`pip install 'dgrpo[tracing]'`).
"""

from __future__ import annotations

import importlib.util
import logging
from contextlib import contextmanager
from typing import Any

from dgrpo.common.config import ConfigError
from dgrpo.common.tracing_config import TracingConfig

log = logging.getLogger("dgrpo.tracing")
PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp")
INSTALL = "pip install 'dgrpo[tracing]'"


_tracer = None  # set by init(): None means tracing is off
_provider = None


def check(cfg: TracingConfig, key: str = "tracing.otlp_endpoint") -> None:
    """Refuse tracing without its packages, before anything starts, naming the key and the install line."""
    if cfg.otlp_endpoint is None:
        return
    missing = [p for p in PACKAGES if _absent(p)]
    if missing:
        raise ConfigError(
            f"{key}={cfg.otlp_endpoint!r}: tracing needs {', '.join(missing)} ({INSTALL}), which is not installed here"
        )


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def init(cfg: TracingConfig, service: str, instance: str | None = None) -> None:
    """Start exporting this process's spans as service `dgrpo-<service>` (`instance`: e.g. the replica id)."""
    global _tracer, _provider
    if cfg.otlp_endpoint is None:
        return
    check(cfg)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.otlp_endpoint.startswith("http://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint)
    attrs = {"service.name": f"dgrpo-{service}", **({"service.instance.id": instance} if instance else {})}
    _provider = TracerProvider(
        resource=Resource.create(attrs), sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio))
    )
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("dgrpo")
    log.info("tracing: spans of dgrpo-%s go to %s (OTLP/%s)", service, cfg.otlp_endpoint, cfg.protocol)


def shutdown() -> None:
    """Flush the spans still queued (at exit; a learner's last step would otherwise be lost)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


@contextmanager
def span(name: str, **attributes: Any):
    """A span of this process, current inside the block (child spans and traceparent() see it)."""
    if _tracer is None:
        yield None
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as s:
        yield s


class _NoSpan:
    metadata = None

    def end(self, **attributes: Any) -> None:
        pass


NO_SPAN = _NoSpan()


class ClientSpan:
    """A span around one outgoing call: `metadata` carries its context to the server (gRPC `metadata=`)."""

    def __init__(self, name: str, attributes: dict[str, Any]):
        from opentelemetry import trace
        from opentelemetry.propagate import inject

        self._span = _tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes)
        carrier: dict[str, str] = {}
        inject(carrier, context=trace.set_span_in_context(self._span))
        self.metadata = tuple(carrier.items()) or None

    def end(self, **attributes: Any) -> None:
        self._span.set_attributes(attributes)
        self._span.end()


def client_span(name: str, **attributes: Any) -> ClientSpan | _NoSpan:
    """Start a client span, a child of the current one; `.end()` it when the call is over."""
    return NO_SPAN if _tracer is None else ClientSpan(name, attributes)


class ServerSpan:
    """A span of one incoming call, child of the caller's span (from the call's metadata)."""

    def __init__(self, name: str, parent: dict[str, str], attributes: dict[str, Any]):
        from opentelemetry import trace
        from opentelemetry.propagate import extract

        self._span = _tracer.start_span(
            name, context=extract(parent), kind=trace.SpanKind.SERVER, attributes=attributes
        )
        self.metadata = None

    def end(self, **attributes: Any) -> None:
        self._span.set_attributes(attributes)
        self._span.end()


def server_span(name: str, metadata, **attributes: Any) -> ServerSpan | _NoSpan:
    """Start a server span for a call whose invocation metadata is `metadata` (key, value pairs)."""
    if _tracer is None:
        return NO_SPAN
    return ServerSpan(name, {k: v for k, v in (metadata or ()) if isinstance(v, str)}, attributes)


def traceparent() -> str:
    """The current span's W3C traceparent ("" when tracing is off or no span is current)."""
    if _tracer is None:
        return ""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get("traceparent", "")


@contextmanager
def span_from(name: str, parent_traceparent: str, **attributes: Any):
    """A span whose parent is given as a traceparent string (received inside a message rather than metadata)."""
    if _tracer is None:
        yield None
        return
    from opentelemetry.propagate import extract

    ctx = extract({"traceparent": parent_traceparent}) if parent_traceparent else None
    with _tracer.start_as_current_span(name, context=ctx, attributes=attributes) as s:
        yield s
