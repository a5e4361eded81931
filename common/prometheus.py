"""Serving Prometheus metrics: one `/metrics` HTTP endpoint per service process, on an address of its config.

Each service names its series `dgrpo_<service>_...` with the unit in the name (Prometheus' naming guide:
https://prometheus.io/docs/practices/naming/). The endpoint is off unless a port is configured, and binds loopback
unless told otherwise, like every other port of the stack (docs/security.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

from dgrpo.common.config import ConfigError


class Forward:
    """A collector that re-exports another registry's series (vLLM registers its engine metrics in
    prometheus_client's global registry; a replica's own series live in a registry of its own)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        return self.registry.collect()

    def describe(self) -> list[Metric]:
        return []  # names are not checked against ours: the two registries never share a name


def serve_metrics(registry: CollectorRegistry, host: str, port: int, config_key: str) -> WSGIServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread; returns the server (`.server_port`: the
    bound port, port 0 picking any free one; `.shutdown()` stops it). A port that cannot be bound stops the service
    naming `config_key`."""
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(
            f"{config_key}={port}: cannot serve Prometheus metrics on {host}:{port} ({e.strerror or e})"
        ) from None
    return server


class RateWindow:
    """Events per second over the last `window_s` seconds (tokens generated, completions scored), for a gauge that
    reads it at scrape time; `rate()` over the matching `_total` counter gives the same in PromQL."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()  # added to on the event loop, read on the HTTP server's thread

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:  # trimmed here too: with nothing scraping, the window must not grow for the process's life
            self._events.append((now, amount))
            self._trim(now)

    def per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(a for _, a in self._events) / self.window_s

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
