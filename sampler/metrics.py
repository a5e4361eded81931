"""Prometheus metrics of one sampler replica (served on `sampler.metrics_host`:`sampler.metrics_port`).

A registry of its own (tests build several replicas' metrics in one process), served together with vLLM's engine
metrics (`vllm:*`, which vLLM registers in prometheus_client's global registry: docs.vllm.ai, "Production
Metrics")."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from dgrpo.common.prometheus import Forward, RateWindow, serve_metrics


class SamplerMetrics:
    def __init__(self, replica_id: str):
        self.registry = CollectorRegistry()
        self.replica_id = replica_id
        labels = {"replica": replica_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["replica"], registry=self.registry).labels(**labels)

        self.generated_tokens = Counter("dgrpo_sampler_generated_tokens", "Completion tokens generated", ["replica"],
                                        registry=self.registry).labels(**labels)
        self.requests = Counter("dgrpo_sampler_requests", "Generate calls by outcome", ["replica", "outcome"],
                                registry=self.registry)
        self.groups = Counter("dgrpo_sampler_groups", "Groups streamed", ["replica"],
                              registry=self.registry).labels(**labels)
        self.requests_in_flight = gauge("dgrpo_sampler_requests_in_flight", "Generate calls being served")
        self.groups_in_flight = gauge("dgrpo_sampler_groups_in_flight", "Groups asked for and not yet streamed")
        self.running = gauge("dgrpo_sampler_running_requests", "Engine requests running")
        self.waiting = gauge("dgrpo_sampler_waiting_requests", "Engine requests waiting (queue depth)")
        self.weight_version = gauge("dgrpo_sampler_weight_version", "Loaded weight version")
        self.weight_load_seconds = gauge("dgrpo_sampler_weight_load_seconds",
                                         "Seconds the last weight version took to load (fetch, stage, pause, load)")
        self.weight_loads = Counter("dgrpo_sampler_weight_loads", "Weight versions loaded", ["replica"],
                                    registry=self.registry).labels(**labels)
        self.token_rate = RateWindow()
        gauge("dgrpo_sampler_generated_tokens_per_second",
              "Completion tokens generated per second over the last 30 s").set_function(self.token_rate.per_second)
        self._last_load = None

    def request_done(self, outcome: str) -> None:
        self.requests.labels(replica=self.replica_id, outcome=outcome).inc()

    def group_streamed(self, tokens: int) -> None:
        self.groups.inc()
        self.generated_tokens.inc(tokens)
        self.token_rate.add(tokens)

    def weights_loaded(self, stats) -> None:
        """Record a load (weights.subscriber.LoadStats) once; the replica's watch loop hands the latest one."""
        if stats is not None and stats is not self._last_load:
            self._last_load = stats
            self.weight_load_seconds.set(stats.total_s)
            self.weight_loads.inc()

    def serve(self, host: str, port: int) -> int:
        """Serve ours and vLLM's series; returns the bound port."""
        served = CollectorRegistry()
        served.register(Forward(self.registry))
        served.register(Forward(REGISTRY))
        return serve_metrics(served, host, port, "sampler.metrics_port").server_port
