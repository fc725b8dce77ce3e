"""Prometheus metrics of `minillm router` (GET /metrics), named as vLLM's router names its own
(vllm_router_* there, minillm_router_* here); one CollectorRegistry per router app.

Counters and the health gauge are read from the router's counts at scrape time (the router counts
them); the request-duration histogram is fed as each request finishes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minillm.server.metrics import _NamedSeries
from minillm.urls import shown_url

if TYPE_CHECKING:
    from minillm.router import Router

# vLLM router's bounds for its *_duration_seconds histograms.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 45.0,
                    60.0, 90.0, 120.0, 180.0, 240.0)


class _RouterCollector(Collector):
    """The router's counts as metric families, read when scraped."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        stats = self.router.stats
        requests = CounterMetricFamily("minillm_router_requests", "Requests the router answered, by route.",
                                       labels=["route"])
        for route, count in sorted(stats.num_by_route.items()):
            requests.add_metric([route], count)
        errors = CounterMetricFamily("minillm_router_request_errors",
                                     "Requests answered with an error (or left by their client: 499), by route and "
                                     "HTTP status.", labels=["route", "status"])
        for (route, status), count in sorted(stats.num_errors_by_route.items()):
            errors.add_metric([route, str(status)], count)
        yield requests
        yield errors
        yield from self._per_server()

    def _per_server(self):
        processed = CounterMetricFamily("minillm_router_processed_requests",
                                        "Requests each server took (its answer began), by role.",
                                        labels=["role", "worker"])
        failures = CounterMetricFamily("minillm_router_worker_errors",
                                       "Connections each server refused and requests it failed, by role.",
                                       labels=["role", "worker"])
        health = GaugeMetricFamily("minillm_router_worker_health",
                                   "1 while a server is taken to be up, 0 while it is down (a refused connection, "
                                   "until a check of its /health after its backoff).", labels=["role", "worker"])
        for backends in (self.router.prefill, self.router.decode):
            for url in backends.urls:
                shown = shown_url(url)
                processed.add_metric([backends.role, shown], backends.num_requests[shown])
                failures.add_metric([backends.role, shown], backends.num_failures[shown])
                health.add_metric([backends.role, shown], 1.0 if self.router.server_health[url].is_up else 0.0)
        yield processed
        yield failures
        yield health


class RouterMetrics:
    """The router app's registry: its counts, and a histogram of how long requests took."""

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RouterCollector(router))
        self.duration = Histogram("minillm_router_request_duration_seconds",
                                  "Time from a request's arrival to the end of its answer, by route.",
                                  labelnames=["route"], buckets=DURATION_BUCKETS, registry=self.registry)

    def observe(self, route: str, seconds: float) -> None:
        """Count one finished request's duration."""
        self.duration.labels(route).observe(seconds)

    def render(self, names: list[str] | None = None) -> bytes:
        """The Prometheus text exposition; with names, only the series of those sample names."""
        return generate_latest(self.registry if names is None else _NamedSeries(self.registry, names))
