"""Prometheus metrics on an HTTP port (one registry per process component, so tests can run several)."""
from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class OrchestratorMetrics:
    """Implements the engine's observer hooks (orchestrator.engine.EngineObserver)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdec_requests", "Generate requests by outcome", ["method", "code"], registry=r)
        self.inflight = Gauge("specdec_inflight_requests", "Requests being generated", registry=r)
        self.request_seconds = Histogram("specdec_request_duration_seconds", "Generate wall time",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.tokens = Counter("specdec_generated_tokens", "Tokens returned to callers", registry=r)
        self.rounds = Counter("specdec_rounds", "Speculation rounds", registry=r)
        self.draft_tokens = Counter("specdec_draft_tokens", "Tokens proposed by the draft", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.accepted_position = Counter("specdec_accepted_by_position", "Accepted draft tokens by position",
                                         ["position"], registry=r)
        self.k = Histogram("specdec_round_k", "k chosen per round", buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32),
                           registry=r)
        self.acceptance = Gauge("specdec_acceptance_rate", "EWMA of per-token acceptance (worker-pair prior)",
                                registry=r)
        self.round_seconds = Histogram("specdec_round_duration_seconds", "Round time by part", ["part"],
                                       buckets=ROUND_BUCKETS, registry=r)
        self.fallbacks = Counter("specdec_fallback_rounds", "Rounds run target-only because the draft was unusable",
                                 registry=r)
        self.reprefills = Counter("specdec_reprefills", "Worker caches rebuilt from canonical tokens", registry=r)
        self.sessions = Gauge("specdec_sessions", "Sessions held by the orchestrator", registry=r)

    # EngineObserver hooks
    def round(self, k: int, drafted: int, accepted: int, draft_ms: float, verify_ms: float, round_ms: float,
              fallback: bool, acceptance_ewma: float) -> None:
        self.rounds.inc()
        self.k.observe(drafted)
        self.draft_tokens.inc(drafted)
        self.accepted.inc(accepted)
        for i in range(accepted):
            self.accepted_position.labels(position=str(i)).inc()
        self.round_seconds.labels(part="draft").observe(draft_ms / 1000)
        self.round_seconds.labels(part="verify").observe(verify_ms / 1000)
        self.round_seconds.labels(part="overhead").observe(max(0.0, round_ms - draft_ms - verify_ms) / 1000)
        self.round_seconds.labels(part="total").observe(round_ms / 1000)
        self.acceptance.set(acceptance_ewma)
        if fallback:
            self.fallbacks.inc()

    def reprefill(self) -> None:
        self.reprefills.inc()

    def request_done(self, method: str, code: str, seconds: float, tokens: int) -> None:
        self.requests.labels(method=method, code=code).inc()
        self.request_seconds.observe(seconds)
        self.tokens.inc(tokens)


class WorkerCollector:
    """Reads a WorkerCore's state at scrape time: nothing to maintain on the hot path."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def collect(self) -> Any:
        core, role = self.core, self.core.role
        labels = ["role"]
        gauges = [("specdec_worker_sessions", "Sessions holding a KV cache", len(core.store)),
                  ("specdec_worker_cache_bytes", "Bytes held by KV caches", core.store.total_bytes()),
                  ("specdec_worker_cache_budget_bytes", "KV cache byte budget", core.store.max_bytes)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([role], value)
            yield g
        counters = [("specdec_worker_calls", "Propose/Verify calls", core.counters.calls),
                    ("specdec_worker_fed_tokens", "Tokens run through the model", core.counters.fed_tokens),
                    ("specdec_worker_prefilled_tokens", "Tokens appended by commits", core.counters.prefilled_tokens),
                    ("specdec_worker_session_misses", "Calls for sessions not held (NOT_FOUND)", core.counters.session_misses),
                    ("specdec_worker_cache_mismatches", "Calls whose prefix did not match (FAILED_PRECONDITION)",
                     core.counters.cache_mismatches),
                    ("specdec_worker_evictions", "Sessions evicted (LRU, TTL, budget)", core.store.evictions)]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([role], value)
            yield c


def worker_registry(core: Any) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(core))
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> int:
    """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
