"""The router's Prometheus metrics, under `deepserve:router_*`, in a registry of its own.

Counters are counted where things happen (proxy.py); the per-replica gauges (health, circuit state, load)
and the desired replica count are read from the replica set at scrape time, so a removed replica's gauges
disappear with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.router.replica_set import ReplicaSet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_MATCH_CHAR_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_BREAKER_STATES = ("closed", "half_open", "open")


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet, desired_replicas: Callable[[], int | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.attempts = Counter("deepserve:router_requests", "Requests sent to a replica (each attempt), by "
                                "outcome (ok: answered, error: failed or refused with 5xx).",
                                ["replica", "outcome"], registry=self.registry)
        self.replica_errors = Counter("deepserve:router_replica_errors", "Failed attempts, by replica and kind "
                                      "(connect, timeout, protocol, status_5xx, taken_out, mid_stream).",
                                      ["replica", "kind"], registry=self.registry)
        self.retries = Counter("deepserve:router_retries", "Requests sent again to a replica after a failed "
                               "attempt.", registry=self.registry)
        self.failed = Counter("deepserve:router_requests_failed", "Requests answered with an error by the router "
                              "itself, by reason (no_replica, retries_exhausted, mid_stream).", ["reason"],
                              registry=self.registry)
        self.decisions = Counter("deepserve:router_routing_decisions", "Routing decisions, by policy and reason.",
                                 ["policy", "reason"], registry=self.registry)
        self.match_chars = Histogram("deepserve:router_cache_match_chars", "cache_aware: characters of the "
                                     "request's prefix the chosen replica was sent before.",
                                     buckets=_MATCH_CHAR_BUCKETS, registry=self.registry)
        self.match_ratio = Histogram("deepserve:router_cache_match_ratio", "cache_aware: matched fraction of the "
                                     "request's text on the chosen replica.", buckets=_RATIO_BUCKETS,
                                     registry=self.registry)
        self.registry.register(_ReplicaGauges(replicas, desired_replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaGauges(Collector):
    def __init__(self, replicas: ReplicaSet, desired_replicas: Callable[[], int | None]) -> None:
        self.replicas = replicas
        self.desired_replicas = desired_replicas

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily("deepserve:router_replica_healthy", "1 if the replica passes its health "
                                    "probes.", labels=["replica"])
        eligible = GaugeMetricFamily("deepserve:router_replica_eligible", "1 if the replica gets new requests "
                                     "(healthy, not removed, circuit not open).", labels=["replica"])
        breaker = GaugeMetricFamily("deepserve:router_replica_circuit_state", "1 for the circuit breaker's "
                                    "current state.", labels=["replica", "state"])
        in_flight = GaugeMetricFamily("deepserve:router_replica_in_flight", "Requests the router has in flight "
                                      "on the replica.", labels=["replica"])
        load = GaugeMetricFamily("deepserve:router_replica_load", "Load the policies see: max(in flight, the "
                                 "replica's running + waiting).", labels=["replica"])
        for replica in self.replicas:
            healthy.add_metric([replica.url], float(replica.healthy))
            eligible.add_metric([replica.url], float(replica.is_eligible()))
            state = replica.breaker.state
            for name in _BREAKER_STATES:
                breaker.add_metric([replica.url, name], float(state == name))
            in_flight.add_metric([replica.url], float(replica.in_flight))
            load.add_metric([replica.url], replica.load)
        yield from (healthy, eligible, breaker, in_flight, load)
        desired = self.desired_replicas()
        if desired is not None:
            gauge = GaugeMetricFamily("deepserve:router_desired_replicas", "Replicas the load asks for (for an "
                                      "external autoscaler: Kubernetes HPA, KEDA).")
            gauge.add_metric([], float(desired))
            yield gauge
