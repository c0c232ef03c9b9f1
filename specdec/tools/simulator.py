"""Replay recorded round traces through any k policy (pure Python, deterministic for a seed).

How a trace becomes a replayable environment
--------------------------------------------
Each generated token of a recorded request is one *position*. A round that drafted d tokens and had
a accepted tells us, position by position: the first a positions were accepted drafts (match = 1),
the next one was a rejected draft (match = 0) that the target corrected, or, when all d passed, a
bonus token whose match is unknown. Positions produced by target-only rounds are unknown as well.
With greedy decoding, whether the draft's token at a position matches the target depends only on
the canonical prefix, so a replay with a different k accepts exactly the run of 1s starting at the
round's first position, capped at k. For sampling it is an approximation (acceptance is random).

The limit: a replay cannot know acceptance beyond what was recorded, i.e. at bonus and target-only
positions. Those are imputed from a two-state Markov chain fitted on consecutive known positions
(it keeps the burstiness of real acceptance), and the draft's confidence there is drawn from the
recorded confidences of accepted / rejected tokens. Every replica draws its own imputation (seeded)
and all policies see the same replicas, so comparisons are paired. Record traces with a high fixed k
(e.g. 8) to observe most positions and keep imputation small; the report says how much was imputed.

Timing comes from the same traces: median draft ms per drafted token, median verify ms per drafted
count (a line through the measured counts for unseen ones), and the median per-call overhead, using
steady-state rounds only (no prompt prefill).
"""
from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.guard import TARGET_ONLY
from orchestrator.kpolicy import CostModelPolicy, KPolicy, SessionStats, draft_forwards


@dataclass
class Episode:
    """One recorded request: per generated position, match (1/0/None) and draft confidence."""
    match: list[int | None] = field(default_factory=list)
    confidence: list[float | None] = field(default_factory=list)


@dataclass
class TimingFit:
    draft_ms_per_token: float
    verify_ms_by_k: dict[int, float]
    rpc_overhead_ms: float
    _slope: float = 0.0
    _intercept: float = 0.0

    def __post_init__(self) -> None:
        ks = sorted(self.verify_ms_by_k)
        if len(ks) >= 2:
            mean_k = statistics.fmean(ks)
            mean_t = statistics.fmean(self.verify_ms_by_k[k] for k in ks)
            var = sum((k - mean_k) ** 2 for k in ks)
            self._slope = max(0.0, sum((k - mean_k) * (self.verify_ms_by_k[k] - mean_t) for k in ks) / var)
            self._intercept = mean_t - self._slope * mean_k
        elif ks:
            self._intercept = self.verify_ms_by_k[ks[0]]

    def verify_ms(self, k: int) -> float:
        if k in self.verify_ms_by_k:
            return self.verify_ms_by_k[k]
        return max(1e-3, self._intercept + self._slope * k)


@dataclass
class TraceData:
    episodes: list[Episode]
    timing: TimingFit
    p_stay_accept: float    # P(match=1 | previous match=1)
    p_recover: float        # P(match=1 | previous match=0)
    accepted_conf: list[float]
    rejected_conf: list[float]

    @property
    def positions(self) -> int:
        return sum(len(e.match) for e in self.episodes)

    @property
    def unknown_fraction(self) -> float:
        total = self.positions
        return sum(m is None for e in self.episodes for m in e.match) / total if total else 0.0


def build(traces: Sequence) -> TraceData:
    """Turn RoundTrace records (in file order) into episodes and a timing fit."""
    episodes: list[Episode] = []
    by_session: dict[str, Episode] = {}
    draft_per_token: list[float] = []
    verify_by_k: dict[int, list[float]] = {}
    overheads: list[float] = []
    for t in traces:
        if t.round == 1 or t.session not in by_session:
            by_session[t.session] = Episode()
            episodes.append(by_session[t.session])
        ep = by_session[t.session]
        pattern = t.pattern
        for i, match in enumerate(pattern):
            ep.match.append(match)
            confidences = t.draft_confidences or t.draft_probs
            ep.confidence.append(confidences[i] if i < len(confidences) else None)
        if len(pattern) == t.accepted:  # no rejection: a bonus token or target-only round, never drafted
            ep.match.append(None)
            ep.confidence.append(None)
        if t.draft_token_ms > 0:
            # Timed apart from catch-up, so valid after a prefill or a fully accepted round too.
            draft_per_token.append(t.draft_token_ms)
        # A round the pair guard forced to k = 0 ran with the whole pair off: its verify time is not
        # what a k = 0 of one session costs beside the others' drafts.
        if t.steady and not t.fallback and t.guard != TARGET_ONLY:
            if t.drafted > 0 and not t.draft_token_ms:  # older traces: whole call over its forwards
                draft_per_token.append(t.draft_ms / draft_forwards(t.k, t.drafted))
            verify_by_k.setdefault(t.drafted, []).append(t.verify_ms)
            # A round with k > 0 called the draft even when the early stop left it no drafts.
            overheads.append(max(0.0, t.round_ms - t.draft_ms - t.verify_ms) / (2 if t.k else 1))
    if not verify_by_k:
        raise ValueError("no steady-state rounds in the traces (every round prefilled a prompt)")
    timing = TimingFit(statistics.median(draft_per_token) if draft_per_token else 0.0,
                       {k: statistics.median(v) for k, v in verify_by_k.items()},
                       statistics.median(overheads) if overheads else 0.0)
    pairs = [(a, b) for e in episodes for a, b in zip(e.match, e.match[1:]) if a is not None and b is not None]
    after_1 = [b for a, b in pairs if a == 1]
    after_0 = [b for a, b in pairs if a == 0]
    known = [m for e in episodes for m in e.match if m is not None]
    base = statistics.fmean(known) if known else 0.5
    accepted_conf = [c for e in episodes for m, c in zip(e.match, e.confidence) if m == 1 and c is not None]
    rejected_conf = [c for e in episodes for m, c in zip(e.match, e.confidence) if m == 0 and c is not None]
    return TraceData(episodes, timing,
                     statistics.fmean(after_1) if after_1 else base,
                     statistics.fmean(after_0) if after_0 else base,
                     accepted_conf or [1.0], rejected_conf or [0.0])


def impute(data: TraceData, rng: random.Random) -> list[tuple[list[int], list[float]]]:
    """One replica: fill unknown matches (Markov chain) and confidences (empirical draws)."""
    out = []
    for ep in data.episodes:
        match, conf, prev = [], [], 1
        for m, c in zip(ep.match, ep.confidence):
            if m is None:
                m = int(rng.random() < (data.p_stay_accept if prev == 1 else data.p_recover))
            if c is None:
                c = rng.choice(data.accepted_conf if m == 1 else data.rejected_conf)
            match.append(m)
            conf.append(c)
            prev = m
        out.append((match, conf))
    return out


@dataclass
class SimResult:
    tokens: int = 0
    time_ms: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.time_ms / 1000.0) if self.time_ms else 0.0

    @property
    def mean_k(self) -> float:
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: "SimResult") -> None:
        self.tokens += other.tokens
        self.time_ms += other.time_ms
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted


def simulate(replica: list[tuple[list[int], list[float]]], timing: TimingFit, make: Callable[[], KPolicy],
             min_k: int, max_k: int, min_draft_prob: float) -> SimResult:
    """Run one policy over every episode of a replica; the pair's prior carries across episodes as
    in the orchestrator: it learns from every round, a new session starts from it, and at the end of
    a turn it takes over the session's timings and probe back-off. The prior's timings start from the
    replayed ones, as the orchestrator's start from the workers' startup calibration."""
    result = SimResult()
    prior = SessionStats().as_pair_prior()
    prior.timing.seed(timing.draft_ms_per_token or None, {k: timing.verify_ms(k) for k in range(max_k + 1)})
    for match, conf in replica:
        stats = prior.new_session()
        policy = make()
        n, j = len(match), 0
        while j < n:
            k = max(0, min(policy.next_k(stats, min_k, max_k), n - j - 1))
            drafted = 0
            while drafted < k and conf[j + drafted] >= min_draft_prob:
                drafted += 1
            accepted = 0
            while accepted < drafted and match[j + accepted] == 1:
                accepted += 1
            forwards = draft_forwards(k, drafted)
            round_ms = (forwards * timing.draft_ms_per_token + timing.verify_ms(drafted)
                        + timing.rpc_overhead_ms * (2 if k else 1))
            if forwards:
                stats.timing.observe_draft(forwards, forwards * timing.draft_ms_per_token)
            stats.timing.observe_verify(drafted, timing.verify_ms(drafted))
            stats.timing.observe_rtt(timing.rpc_overhead_ms)
            stats.observe_round(drafted, accepted, round_ms)
            prior.observe_round(drafted, accepted, round_ms)
            produced = min(accepted + 1, n - j)
            j += produced
            result.add(SimResult(produced, round_ms, 1, drafted, accepted))
        stats.carry_turn_into(prior, policy_chose_k=isinstance(policy, CostModelPolicy))
    return result
