"""Adaptive speculation length: policies choose k per round from a session's running statistics.

Pure Python (no grpc, no torch), so every policy is unit-tested on synthetic acceptance sequences.
k = 0 means target-only decoding for that round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class Ewma:
    """Exponentially weighted moving average with a prior that counts as `prior_weight` observations."""
    alpha: float
    value: float
    observations: int = 0

    def update(self, x: float) -> None:
        self.value = (1 - self.alpha) * self.value + self.alpha * x
        self.observations += 1


@dataclass
class DecayingLine:
    """Least-squares line y = a + b*x with exponential forgetting; falls back to a prior slope
    until two distinct x values have been seen."""
    intercept: float
    slope: float
    decay: float = 0.9
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def update(self, x: float, y: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        var = self._w * self._sxx - self._sx ** 2
        if var > 1e-9 * max(1.0, self._w * self._sxx):
            self.slope = max(0.0, (self._w * self._sxy - self._sx * self._sy) / var)
        self.intercept = max(0.0, (self._sy - self.slope * self._sx) / self._w)

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass
class TimingModel:
    """Measured round costs: t_draft per drafted token, t_verify(k) as a line in k, and rtt.

    Only steady-state rounds are observed: a call that prefilled many tokens (a new turn, a
    re-prefill) says nothing about the per-token cost.
    """
    draft_ms_per_token: Ewma = field(default_factory=lambda: Ewma(0.2, 20.0))
    verify_line: DecayingLine = field(default_factory=lambda: DecayingLine(40.0, 2.0))
    # Per-k measurements win over the line: on CPUs the cost of a forward over k+1 tokens is often a
    # step function (GEMM kernels switch at a batch size), which no line captures.
    verify_by_k: dict[int, Ewma] = field(default_factory=dict)
    rtt_ms: Ewma = field(default_factory=lambda: Ewma(0.2, 1.0))

    def verify_ms(self, k: int) -> float:
        measured = self.verify_by_k.get(k)
        return measured.value if measured is not None else self.verify_line(k)

    def observe_draft(self, k: int, compute_ms: float) -> None:
        if k > 0:
            self.draft_ms_per_token.update(compute_ms / k)

    def observe_verify(self, k: int, compute_ms: float) -> None:
        self.verify_line.update(k, compute_ms)
        if k in self.verify_by_k:
            self.verify_by_k[k].update(compute_ms)
        else:
            self.verify_by_k[k] = Ewma(0.3, compute_ms, 1)

    def observe_rtt(self, overhead_ms: float) -> None:
        self.rtt_ms.update(max(0.0, overhead_ms))


@dataclass
class SessionStats:
    """What a policy sees. Updated by the orchestrator after each round."""
    acceptance: Ewma = field(default_factory=lambda: Ewma(0.3, 0.7))
    timing: TimingModel = field(default_factory=TimingModel)
    last_k: int = 0
    last_accepted: int = 0
    rounds: int = 0
    rounds_since_draft: int = 0

    def observe_round(self, k: int, accepted: int) -> None:
        """Per-token acceptance from one round: accepted of k (a rejection ends the round)."""
        self.rounds += 1
        self.last_k, self.last_accepted = k, accepted
        if k == 0:
            self.rounds_since_draft += 1
            return
        self.rounds_since_draft = 0
        # Under a geometric model, a round with `accepted` successes then (maybe) a failure gives the
        # per-token estimate accepted / (accepted + 1 if rejected else accepted).
        trials = accepted + (1 if accepted < k else 0)
        self.acceptance.update(accepted / trials)


def expected_tokens(a: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): tokens produced per round (accepted + correction/bonus)."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 1.0)
    if a >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class KPolicy(Protocol):
    name: str

    def next_k(self, stats: SessionStats, min_k: int, max_k: int) -> int: ...


@dataclass
class FixedPolicy:
    k: int = 4
    name: str = "fixed"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int) -> int:
        return _clamp(self.k, min_k, max_k)


@dataclass
class HeuristicPolicy:
    """Hugging Face's schedule: +2 when all drafts were accepted, else -1 (floor 1)."""
    initial_k: int = 4
    name: str = "heuristic"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int) -> int:
        if stats.rounds == 0:
            return _clamp(self.initial_k, max(min_k, 1), max_k)
        k = stats.last_k + 2 if stats.last_accepted >= stats.last_k else stats.last_k - 1
        return _clamp(max(k, 1), max(min_k, 1), max_k)


@dataclass
class CostModelPolicy:
    """Maximise expected tokens per second E(k) / (k*t_draft + t_verify(k) + rtt).

    Picks k = 0 (target-only) when no k > 0 beats plain decoding, e.g. when the draft is slow or
    acceptance is low. While at k = 0 nothing new is learned about acceptance, so every
    `probe_every` rounds it drafts one token to refresh the estimate.
    """
    probe_every: int = 16
    name: str = "cost"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int) -> int:
        best = self._argmax(stats, min_k, max_k)
        if best == 0 and max_k > 0 and self.probe_every and stats.rounds_since_draft >= self.probe_every:
            return max(1, min_k)
        return best

    def _argmax(self, stats: SessionStats, min_k: int, max_k: int) -> int:
        best_k, best_rate = min_k, -1.0
        for k in range(min_k, max_k + 1):
            rate = self.tokens_per_ms(stats, k)
            if rate > best_rate + 1e-12:
                best_k, best_rate = k, rate
        return best_k

    @staticmethod
    def tokens_per_ms(stats: SessionStats, k: int) -> float:
        t = stats.timing
        cost = k * t.draft_ms_per_token.value + t.verify_ms(k) + t.rtt_ms.value
        if k > 0:
            cost += t.rtt_ms.value  # a speculative round makes two calls, target-only one
        return expected_tokens(stats.acceptance.value, k) / max(cost, 1e-6)


def _clamp(k: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, k))


POLICY_NAMES = ("fixed", "heuristic", "cost")


def make_policy(name: str, fixed_k: int = 4) -> KPolicy:
    if name == "fixed":
        return FixedPolicy(k=fixed_k)
    if name == "heuristic":
        return HeuristicPolicy()
    if name == "cost":
        return CostModelPolicy()
    raise ValueError(f"unknown k policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


def speedup_bound(a: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected speedup S(k) = (1 - a^(k+1)) / ((1 - a)(k*c + 1))."""
    return expected_tokens(a, k) / (k * c + 1.0)


def clamp_prob(x: float) -> float:
    return 0.0 if math.isnan(x) else min(max(x, 0.0), 1.0)
