"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

Gauges are set from the ``Engine.stats()`` that comes with every iteration's tokens; histograms
observe each token as the engine hands it back (engine clock, before any HTTP): what the server
itself measured, to compare with what a client measures.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the endpoint)

from orca_lab.engine.request import FINISH_REASONS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        g = lambda name, doc: Gauge(f"orca_lab_{name}", doc, registry=r)
        self.running = g("requests_running", "requests scheduled and not finished")
        self.waiting = g("requests_waiting", "requests accepted and never scheduled yet")
        self.kv_reserved = g("kv_slots_reserved", "K/V slots reserved (Algorithm 1's n_rsrv)")
        self.kv_used = g("kv_slots_used", "K/V slots holding a real token's K/V")
        self.kv_total = g("kv_slots_total", "K/V slots in the pool (n_slots)")
        self.ttft = Histogram("orca_lab_time_to_first_token_seconds", "arrival at the endpoint to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("orca_lab_inter_token_latency_seconds", "time between two tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("orca_lab_iteration_tokens", "tokens in one iteration's batch",
                                          buckets=TOKEN_BUCKETS, registry=r)
        c = lambda name, doc: Counter(f"orca_lab_{name}", doc, registry=r)
        self.prefix_hits = c("prefix_cache_hit_tokens", "prompt tokens whose K/V were found cached (prefix caching)")
        self.prefix_queries = c("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache")
        self._prefix = (0, 0)          # the engine's totals when last read: counters grow by the difference
        self.requests = Counter("orca_lab_requests", "requests finished, by final status", ["status"], registry=r)
        for s in FINISH_REASONS:            # every status shows from the start, at 0
            self.requests.labels(s)

    def set_state(self, stats, queued: int):
        """``stats``: ``Engine.stats()``; ``queued``: accepted, not yet handed to the engine."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting + queued)
        self.kv_reserved.set(stats.kv_reserved)
        self.kv_used.set(stats.kv_used)
        self.kv_total.set(stats.kv_total)
        hits, queries = stats.prefix_hit_tokens, stats.prefix_query_tokens
        self.prefix_hits.inc(max(0, hits - self._prefix[0]))
        self.prefix_queries.inc(max(0, queries - self._prefix[1]))
        self._prefix = (hits, queries)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page: ``{'name{label="v"}': value}`` (for tests and notebooks)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
