"""The orchestrator's Prometheus metrics: request outcomes (from the servicer) and round metrics
(an observer of every RoundRecord)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator.kpolicy import AcceptanceRate
from orchestrator.record import RoundRecord

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class OrchestratorMetrics:
    """Request metrics from the servicer, round metrics by observing every RoundRecord."""

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
        self.acceptance = Gauge("specdec_acceptance_rate", "Per-token acceptance over recent rounds "
                                "(exponentially weighted accepted / tried positions)",
                                registry=r)
        self._acceptance = AcceptanceRate(0.3, 0.7)
        self.round_seconds = Histogram("specdec_round_duration_seconds", "Round time by part", ["part"],
                                       buckets=ROUND_BUCKETS, registry=r)
        self.fallbacks = Counter("specdec_fallback_rounds", "Rounds run target-only because the draft was unusable",
                                 registry=r)
        self.reprefills = Counter("specdec_reprefills", "Worker caches rebuilt from canonical tokens", registry=r)
        self.sessions = Gauge("specdec_sessions", "Named sessions (conversations) held by the orchestrator", registry=r)
        self.predrafts = Counter("specdec_predrafts", "Pipelined pre-drafts by outcome (hit: used as the "
                                 "next round's drafts; miss: discarded)", ["outcome"], registry=r)
        self.guard_rounds = Counter("specdec_guard_rounds", "Guarded rounds by the pair guard's epoch (spec: "
                                    "the policy's k; off: k forced to 0 for the whole pair)", ["mode"], registry=r)
        self.predraft_saved = Counter("specdec_predraft_saved_seconds", "Draft time pipelined rounds saved: "
                                      "the serial draft calls their hits replaced, less the wait", registry=r)
        self.predraft_branch_hits = Counter("specdec_predraft_branch_hits", "Of the pre-draft hits, those whose "
                                            "drafts came from a branch (the correction guessed right)", registry=r)

    def observe(self, record: RoundRecord) -> None:
        self.rounds.inc()
        self.k.observe(record.drafted)
        self.draft_tokens.inc(record.drafted)
        self.accepted.inc(record.accepted)
        for i in range(record.accepted):
            self.accepted_position.labels(position=str(i)).inc()
        self.round_seconds.labels(part="draft").observe(record.draft_ms / 1000)
        self.round_seconds.labels(part="verify").observe(record.verify_ms / 1000)
        # A pipelined hit's draft ran during the previous verify: it is not part of this round's time.
        waited_draft = 0.0 if record.predraft_hit else record.draft_ms
        overhead = max(0.0, record.round_ms - waited_draft - record.verify_ms)
        self.round_seconds.labels(part="overhead").observe(overhead / 1000)
        self.round_seconds.labels(part="total").observe(record.round_ms / 1000)
        if record.drafted:
            self._acceptance.update(record.drafted, record.accepted)
            self.acceptance.set(self._acceptance.value)
        if record.fallback:
            self.fallbacks.inc()
        if record.predraft_hit is not None:
            self.predrafts.labels(outcome="hit" if record.predraft_hit else "miss").inc()
            self.predraft_saved.inc(record.predraft_saved_ms / 1000)
            if record.hit_from_branch:
                self.predraft_branch_hits.inc()
        if record.reprefills:
            self.reprefills.inc(record.reprefills)
        if record.guard:
            self.guard_rounds.labels(mode=record.guard).inc()

    def request_done(self, method: str, code: str, seconds: float, tokens: int) -> None:
        self.requests.labels(method=method, code=code).inc()
        self.request_seconds.observe(seconds)
        self.tokens.inc(tokens)
