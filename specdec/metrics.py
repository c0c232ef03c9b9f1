"""Prometheus: the /metrics endpoint and the workers' collector (the orchestrator's metrics are in
orchestrator.metrics). One registry per component, so tests can run several in one process."""
from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

class WorkerCollector:
    """Reads a WorkerCore's state at scrape time: nothing to maintain on the hot path."""

    def __init__(self, core: Any, scheduler: Any = None) -> None:
        self.core = core
        self.scheduler = scheduler

    def collect(self) -> Any:
        core, role = self.core, self.core.role
        labels = ["role"]
        gauges = [("specdec_worker_sessions", "Sessions holding a KV cache (branch slots not counted)",
                   core.session_count()),
                  ("specdec_worker_cache_bytes", "Bytes held by KV caches", core.store.total_bytes()),
                  ("specdec_worker_cache_budget_bytes", "KV cache byte budget", core.store.max_bytes)]
        if self.scheduler is not None:
            load = self.scheduler.snapshot()
            gauges += [("specdec_worker_utilisation", "Busy fraction of the model over the last seconds", load.utilisation),
                       ("specdec_worker_active_calls", "Calls in the batch", load.active),
                       ("specdec_worker_waiting_calls", "Calls waiting for a batch slot", load.waiting),
                       ("specdec_worker_batch_sessions", "Sessions per forward (recent mean)", load.mean_batch)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([role], value)
            yield g
        curve = GaugeMetricFamily("specdec_worker_forward_ms", "Startup-measured forward time over `tokens` new "
                                  "tokens on `context` cached ones", labels=["role", "tokens", "context"])
        for tokens, context, ms in core.cost_curve.points:
            curve.add_metric([role, str(tokens), str(context)], ms)
        yield curve
        counters = [("specdec_worker_calls", "Propose/Verify calls", core.counters.calls),
                    ("specdec_worker_fed_tokens", "Tokens run through the model", core.counters.fed_tokens),
                    ("specdec_worker_prefilled_tokens", "Tokens appended by commits and fed (not those already held)",
                     core.counters.prefilled_tokens),
                    ("specdec_worker_session_misses", "Calls for sessions not held (NOT_FOUND)", core.counters.session_misses),
                    ("specdec_worker_cache_mismatches", "Calls whose prefix did not match (FAILED_PRECONDITION)",
                     core.counters.cache_mismatches),
                    ("specdec_worker_graph_steps", "One-token steps replayed from the decode graph (--decode-graph)",
                     core.counters.graph_steps),
                    ("specdec_worker_evictions", "Sessions evicted (LRU, TTL, budget)", core.store.evictions)]
        if self.scheduler is not None:
            counters += [("specdec_worker_forwards", "Forward passes (each may batch several calls)", self.scheduler.forwards),
                         ("specdec_worker_batched_calls", "Call steps run, summed over forwards", self.scheduler.batched_sessions),
                         ("specdec_worker_rejected_calls", "Calls refused with RESOURCE_EXHAUSTED (queue full)",
                          self.scheduler.rejected),
                         ("specdec_worker_expired_calls", "Calls dropped at their deadline before finishing",
                          self.scheduler.expired),
                         ("specdec_worker_prefill_chunks", "Forwards that ran a chunk of a long prompt next to "
                          "other calls (chunked prefill)", self.scheduler.prefill_chunks)]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([role], value)
            yield c


def worker_registry(core: Any, scheduler: Any = None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(core, scheduler))
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> int:
    """Start the /metrics HTTP endpoint in a daemon thread; returns the bound port."""
    from specdec.grpc_util import bare_host, host_port
    server, _thread = start_http_server(port, addr=bare_host(host), registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s/metrics", host_port(bare_host(host), bound))
    return bound
