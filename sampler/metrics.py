"""Prometheus metrics of one sampler replica (served on `sampler.metrics_port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class SamplerMetrics:
    def __init__(self, replica_id: str):
        self.registry = CollectorRegistry()
        labels = {"replica": replica_id}
        self.generated_tokens = Counter("dgrpo_sampler_generated_tokens", "Completion tokens generated", ["replica"],
                                        registry=self.registry).labels(**labels)
        self.requests = Counter("dgrpo_sampler_requests", "Generate calls by outcome", ["replica", "outcome"],
                                registry=self.registry)
        self.groups = Counter("dgrpo_sampler_groups", "Groups streamed", ["replica"],
                              registry=self.registry).labels(**labels)
        self.running = Gauge("dgrpo_sampler_running_requests", "Engine requests running", ["replica"],
                             registry=self.registry).labels(**labels)
        self.waiting = Gauge("dgrpo_sampler_waiting_requests", "Engine requests waiting (queue depth)", ["replica"],
                             registry=self.registry).labels(**labels)
        self.weight_version = Gauge("dgrpo_sampler_weight_version", "Loaded weight version", ["replica"],
                                    registry=self.registry).labels(**labels)
        self.replica_id = replica_id

    def request_done(self, outcome: str) -> None:
        self.requests.labels(replica=self.replica_id, outcome=outcome).inc()

    def serve(self, port: int) -> int:
        server, _ = start_http_server(port, registry=self.registry)
        return server.server_port
