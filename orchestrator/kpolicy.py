"""Adaptive speculation length: policies choose k per round from a session's running statistics.

Pure Python (no grpc, no torch), so every policy is unit-tested on synthetic acceptance sequences.
k = 0 means target-only decoding for that round.

Over 300 lines: the timing model, the session statistics and the four policies read the same
estimates (acceptance, per-k costs, RTTs, bonus match); one module keeps them consistent.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec import curves
from specdec.contract import MAX_K


@dataclass
class Ewma:
    """Exponentially weighted moving average whose starting value counts as `prior_weight` observations.

    The n-th observation weighs max(alpha, 1 / (n + prior_weight)): a running mean with the start
    counted as prior_weight observations, until 1 / (n + prior_weight) falls below alpha. With
    prior_weight 0 (a guess) the first observation replaces the start. The default (infinite)
    weight is a plain EWMA from a trusted start (a calibrated cost)."""
    alpha: float
    value: float
    observations: int = 0
    prior_weight: float = math.inf

    def update(self, x: float, kept: float = 1.0) -> None:
        """kept < 1: the current value is staler than one observation's age, and keeps only that
        share of its usual weight (see TimingModel.observe_draft)."""
        weight = max(self.alpha, 1.0 / (self.observations + 1.0 + self.prior_weight))
        weight = 1.0 - (1.0 - weight) * kept
        self.value = (1 - weight) * self.value + weight * x
        self.observations += 1


@dataclass
class AcceptanceRate:
    """Per-token acceptance as a ratio of exponentially weighted sums: draft tokens accepted over
    positions tried (the accepted ones, plus the rejected one where a round ended early).

    This is the geometric model's maximum-likelihood estimate. The mean of each round's own ratio is
    not: a round that accepts all k says 1 and one rejected at its first token says 0, whatever k,
    so at a true a = 0.6 the per-round mean is 0.48 at k = 2 and 0.41 at k = 4 (0.61 at a = 0.8,
    k = 8), and a policy reading it drafts less the more it drafts. Each round decays both sums by
    1 - alpha; the starting value counts as `prior_positions` tried positions; the sums never hold
    more than `max_positions` (scaled down together, the ratio kept)."""
    alpha: float
    start: float
    prior_positions: float = 4.0
    max_positions: float = math.inf
    observations: int = 0
    _accepted: float = field(init=False, repr=False)
    _tried: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._accepted, self._tried = self.start * self.prior_positions, self.prior_positions

    @property
    def value(self) -> float:
        return self._accepted / self._tried if self._tried > 0 else self.start

    @value.setter
    def value(self, a: float) -> None:
        """Set the estimate, keeping its weight (tests, and a prior handed to a new session)."""
        self._tried = self._tried if self._tried > 0 else max(self.prior_positions, 1.0)
        self._accepted = a * self._tried

    def relax_towards(self, a: float, rate: float) -> None:
        """Move the estimate a fraction `rate` of the way to `a`, keeping its weight."""
        self.value = (1.0 - rate) * self.value + rate * a

    def update(self, drafted: int, accepted: int) -> None:
        """One round that proposed `drafted` tokens, of which the target accepted the first `accepted`."""
        if drafted <= 0:
            return
        keep = 1.0 - self.alpha
        self._accepted = keep * self._accepted + accepted
        self._tried = keep * self._tried + accepted + (1 if accepted < drafted else 0)
        if self._tried > self.max_positions:
            scale = self.max_positions / self._tried
            self._accepted, self._tried = self._accepted * scale, self.max_positions
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
class TargetLoad:
    """The target's load and its forward cost over token rows, as one worker pair sees them.

    Shared, not copied: every session of a pair holds the same object (deepcopy returns it), so
    each verify of every session updates the load that all of them price k with, and a session that
    starts while the target is busy knows it from its first round. `fresh()` starts a new pair's."""
    target_curve: tuple[tuple[int, float], ...] = ()  # (rows, ms): the target's startup calibration
    target_batch: Ewma = field(default_factory=lambda: Ewma(0.3, 1.0))  # sessions per forward + queued calls
    # The same curve as measured in service: every verify reports the rows of its forward and its
    # time. Where a row count has been seen, it wins over the startup figure, which knows nothing of
    # prefills sharing the forward, per-session attention, or a co-located draft's load.
    observed_rows: dict[int, Ewma] = field(default_factory=dict)
    # rows_curve, rebuilt only after a forward was observed: every k's price at every round reads it.
    _curve: list[tuple[float, float]] | None = field(default=None, init=False, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "TargetLoad":
        return self

    def fresh(self) -> "TargetLoad":
        return TargetLoad(self.target_curve)

    def rows_curve(self) -> list[tuple[float, float]]:
        """Startup points, replaced by in-service measurements near them; non-decreasing in rows."""
        if self._curve is None:
            seen = {bucket: e.value for bucket, e in self.observed_rows.items()}
            points = {rows: ms for rows, ms in self.target_curve if _rows_bucket(rows) not in seen}
            points.update(seen)
            self._curve = _running_max(points.items())
        return self._curve

    def observe_forward(self, rows: float, ms: float) -> None:
        if rows >= 1 and ms > 0:
            self._curve = None
            bucket = _rows_bucket(rows)
            if bucket in self.observed_rows:
                self.observed_rows[bucket].update(ms)
            else:
                self.observed_rows[bucket] = Ewma(0.3, ms, 1)

    def forward_ms(self, rows: float) -> float | None:
        """The target's forward cost over `rows` token rows (rows_curve): interpolated, extended past
        the largest known count by the last segment's slope; None with fewer than two points."""
        return curves.extended(self.rows_curve(), rows)


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
    verify_seed: dict[int, float] = field(default_factory=dict)  # the startup curve's cost per k (seed)
    _verifies: int = field(default=0, repr=False, compare=False)  # verifies observed, and when each k was last
    _verify_seen: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    # The verify call's network + serving overhead (its wall time minus its compute). The 1 ms start is
    # a guess (prior_weight 0): the first measurement replaces it, or a ping at startup (seed_rtt).
    rtt_ms: Ewma = field(default_factory=lambda: Ewma(0.2, 1.0, prior_weight=0.0))
    # The draft call's own overhead, likewise: a draft on a far node can cost more in RTT than in compute.
    draft_rtt_ms: Ewma = field(default_factory=lambda: Ewma(0.2, 1.0, prior_weight=0.0))
    # Load. The target batches the verifies of concurrent sessions into one forward, so at B sessions
    # per forward a round at k costs a forward over about B*(k+1) rows, not k+1: what the extra
    # drafts cost depends on where B*(k+1) sits on the target's cost curve (flat while the forward
    # is memory-bound, linear once it is compute-bound). Each session prices its k as if every
    # session in the batch chose the same k: the cost of the rows it adds to everyone's forward is
    # then part of its own, and at saturation no k > 0 pays.
    load: TargetLoad = field(default_factory=TargetLoad)
    # The draft's forward cost over token rows (its startup calibration): what the rows of branch
    # pre-drafts add to each of its forwards (flat on a GPU, growing on a CPU).
    draft_curve: tuple[tuple[int, float], ...] = ()
    # load_factor's running maximum over k, for one (batch, rows curve): every k of every round reads it.
    _factors: tuple[float, object, list[float]] | None = field(default=None, init=False, repr=False, compare=False)

    def draft_prefill_ms(self, rows: int, slowdown: tuple[float, float]) -> float | None:
        """D(rows): the draft's startup curve at `rows` new tokens, scaled by how its per-token cost
        now compares with the curve's one row (a draft slowed by a neighbour is slower at prefill
        too), that ratio held within `slowdown` (lowest, highest). None without a curve."""
        one, many = curves.extended(self.draft_curve, 1), curves.extended(self.draft_curve, rows)
        if not one or many is None:
            return None
        lowest, highest = slowdown
        return many * min(highest, max(lowest, self.draft_ms_per_token.value / one))

    def draft_rows_factor(self, rows: int) -> float:
        """A draft forward over `rows` rows against one row. Unmeasured: rows (as if linear), so
        that without a curve branches are taken only where the draft has that much time to spare."""
        one, many = curves.extended(self.draft_curve, 1), curves.extended(self.draft_curve, rows)
        if not one or many is None:
            return float(rows)
        return max(1.0, many / one)

    def load_factor(self, k: int, batch: float | None = None) -> float:
        """How much a verify at k costs at the current load relative to alone: T(B(k+1)) / T(k+1)."""
        batch = self.load.target_batch.value if batch is None else batch
        if batch <= 1.0:
            return 1.0
        alone, loaded = self.load.forward_ms(k + 1), self.load.forward_ms(batch * (k + 1))
        if alone is None or loaded is None or alone <= 0:
            return 1.0
        return max(1.0, loaded / alone)

    def verify_ms(self, k: int) -> float:
        """Verify cost of k drafts at the current load, monotone in k: the cost alone times the
        largest load factor of any k' <= k. The factor alone is not monotone: where the rows curve
        steps up at k + 1 rows but not at B(k + 1), it falls, and with a per-k cost alone that does not
        have the step (measured by other rounds than the curve), k + 1 drafts were priced below k."""
        batch, curve = self.load.target_batch.value, self.load.rows_curve()
        if self._factors is None or self._factors[0] != batch or self._factors[1] is not curve:
            self._factors = (batch, curve, [])
        factors = self._factors[2]
        while len(factors) <= k:
            factor = self.load_factor(len(factors), batch)
            factors.append(max(factor, factors[-1]) if factors else factor)
        return self.solo_verify_ms(k) * factors[k]

    def solo_verify_ms(self, k: int) -> float:
        """Verify cost of k drafts with the target to this session alone, monotone in k.

        Measured per-k values (made non-decreasing), linear between measured k, the fitted slope past
        the largest. Below the smallest measured k: that value scaled by the token count (k + 1
        tokens), never the line's intercept, which large-k rounds fit and which says nothing about
        small k. The scaling is optimistic on purpose: the policy tries the smaller k and measures
        it. Only with nothing measured at all does the prior line answer.
        """
        if not self.verify_by_k:
            return self.verify_line(k)
        envelope = _running_max((j, e.value) for j, e in self.verify_by_k.items())
        first_k, first_ms = envelope[0]
        if k <= first_k:
            return first_ms * (k + 1) / (first_k + 1)
        within = curves.interpolate(envelope, k)
        if within is not None:
            return within
        last_k, last_ms = envelope[-1]
        return last_ms + self.verify_line.slope * (k - last_k)

    def seed(self, draft_ms_per_token: float | None, verify_ms_by_k: dict[int, float]) -> None:
        """Start from a worker's own measured cost curve (self-calibration) instead of the defaults."""
        if draft_ms_per_token is not None:
            self.draft_ms_per_token = Ewma(self.draft_ms_per_token.alpha, draft_ms_per_token)
        for k, ms in verify_ms_by_k.items():
            self.verify_by_k[k] = Ewma(0.3, ms)
            self.verify_seed[k] = ms
        if len(verify_ms_by_k) >= 2:
            for k, ms in sorted(verify_ms_by_k.items()):
                self.verify_line.update(k, ms)

    def seed_rtt(self, draft_rtt_ms: float | None, target_rtt_ms: float | None) -> None:
        """Start the RTTs from round trips measured at startup (GetInfo pings): each counts as one
        observation, so that a far worker is priced from the first round of a fresh deployment."""
        if draft_rtt_ms is not None:
            self.draft_rtt_ms = Ewma(self.draft_rtt_ms.alpha, draft_rtt_ms, prior_weight=1.0)
        if target_rtt_ms is not None:
            self.rtt_ms = Ewma(self.rtt_ms.alpha, target_rtt_ms, prior_weight=1.0)

    def observe_draft(self, k: int, compute_ms: float, unseen_rounds: int = 0) -> None:
        """A draft call's compute over k tokens. unseen_rounds: target-only rounds since the last
        drafting round. The draft's cost is only seen while drafting, so after a stretch at k = 0
        the estimate is as old as that stretch: it keeps DRAFT_STALE_KEEP of its weight per round
        unseen. Otherwise a slow spell of the draft (a neighbour's burst, a GC pause) outlived
        itself: each probe moved the estimate 20 % of the way back, looked like a failed probe,
        and doubled the wait for the next (a 20-round spell cost 95 target-only rounds after it)."""
        if k > 0:
            self.draft_ms_per_token.update(compute_ms / k, kept=DRAFT_STALE_KEEP ** max(0, unseen_rounds))

    def observe_verify(self, k: int, compute_ms: float, rows: float = 0.0) -> None:
        """A verify's compute time, measured in a forward of `rows` rows (0: alone), stored as what
        it would have cost alone, so that the per-k costs do not mix load with k."""
        alone, batched = self.load.forward_ms(k + 1), self.load.forward_ms(rows) if rows > k + 1 else None
        if rows >= k + 1:
            self.load.observe_forward(rows, compute_ms)
        if alone and batched:
            compute_ms *= min(1.0, alone / batched)
        self.verify_line.update(k, compute_ms)
        if k in self.verify_by_k:
            self.verify_by_k[k].update(compute_ms)
        else:
            self.verify_by_k[k] = Ewma(0.3, compute_ms, 1)
        # A k is re-measured only when the policy picks it, and the envelope (solo_verify_ms) carries
        # a smaller k's price up to every larger one: one slow k = 0 sample (a GC pause) priced
        # every k alike, k = 0 never looked cheaper than drafting again, and the policy drafted for
        # good (on a CPU whose verify grows with k, 40 % below target-only). So the k not measured
        # this round learn from it too:
        # - the costs are monotone in k: k drafts at this k's cost bound every smaller k from above;
        # - a k not measured in the last UNSEEN_K_AFTER verifies drifts back (UNSEEN_K_RELAX a
        #   round) towards its startup cost scaled by how this k's cost compares with its own: the
        #   calibrated shape of the curve at the machine's current speed, the best guess for a k not
        #   seen lately. (Not the k in use: alternating between k = 3 and 4 across a GEMM step,
        #   relaxing both pulled each a quarter of the way towards the calibrated shape.)
        self._verifies += 1
        self._verify_seen[k] = self._verifies
        current, seed_k = self.verify_by_k[k].value, self.verify_seed.get(k)
        speed = current / seed_k if seed_k else None
        for other_k, cost in self.verify_by_k.items():
            if other_k == k:
                continue
            if other_k < k and cost.value > current:
                cost.update(current)
            unseen = self._verifies - self._verify_seen.get(other_k, 0) > UNSEEN_K_AFTER
            if speed is not None and other_k in self.verify_seed and unseen:
                cost.value += UNSEEN_K_RELAX * (self.verify_seed[other_k] * speed - cost.value)

    def observe_rtt(self, overhead_ms: float) -> None:
        self.rtt_ms.update(max(0.0, overhead_ms))

    def observe_draft_rtt(self, overhead_ms: float) -> None:
        self.draft_rtt_ms.update(max(0.0, overhead_ms))


# While the draft is not seen (target-only rounds), its cost estimate keeps this share of its weight
# per round against the next measurement: after the 16 rounds of a first probe the probe's sample
# weighs about 85 %, after 2 rounds about 35 % (a plain 20 % while drafting). See observe_draft.
DRAFT_STALE_KEEP = 0.9
# Per verify measured, how far each k not measured in the last UNSEEN_K_AFTER verifies moves towards
# its startup cost scaled to the machine's current speed (see observe_verify): 88 % of the way back
# 20 rounds later.
UNSEEN_K_RELAX = 0.1
UNSEEN_K_AFTER = 4

# A session follows its own text: each round decays its acceptance sums by 15 % (about 7 rounds of
# memory). Chosen by replaying traces and synthetic acceptance (iid, bursty, mixed) through the
# simulator (docs/adaptive-k.md): 0.1-0.2 came within 1 % of each other, 0.3 was noisier and dropped
# to k = 0 after chance runs of rejections.
SESSION_ACCEPTANCE_ALPHA = 0.15
# A session starts from its pair's acceptance weighed as this many tried positions: a round at k = 4
# already outweighs it.
SESSION_PRIOR_POSITIONS = 4.0
# ... and holds at most this many tried positions of evidence. A round adds as many positions as it
# tried: after a stretch of fully accepted rounds at k = 8 the sums held about 50, and a hard stretch
# (one position a round) took 11 rounds to bring the estimate under the break-even, drafting 8 each
# time; capped at 10, 7 (scripts/replay_synthetic.py, its last line), at no cost in the replays.
SESSION_MAX_POSITIONS = 10.0
# A worker pair's prior, which every round of every session updates, forgets 5 % per round (about 20
# rounds): a new session starts from the pair's typical acceptance, not from whatever the last three
# rounds of other sessions did (acceptance is bimodal per prompt; at 0.3, a few fully accepted rounds
# elsewhere made new sessions start at k = 8 and reject at their first or second token).
PAIR_ACCEPTANCE_ALPHA = 0.05
# A fresh pair's starting acceptance (0.7) is a guess: it weighs as 4 tried positions, so the pair's
# first rounds average in at once.
PAIR_GUESS_POSITIONS = 4.0
# While a session runs target-only, its fast acceptance estimate drifts back this much per round
# towards its long-run rate (`SessionStats.typical`): acceptance comes in stretches, a target-only
# round shows nothing of the text that follows, and a dip of two or three rejections, which is noise
# as often as it is a hard stretch, should not keep the session off until the next probe.
TARGET_ONLY_RELAX = 0.3


def session_acceptance(a: float) -> AcceptanceRate:
    """A session's estimate, starting at a: the session's pace, prior weight and cap."""
    return AcceptanceRate(SESSION_ACCEPTANCE_ALPHA, a, SESSION_PRIOR_POSITIONS, SESSION_MAX_POSITIONS)


def pair_acceptance(a: float) -> AcceptanceRate:
    """A worker pair's (and a session's long-run) estimate, starting at a: the pair's pace."""
    return AcceptanceRate(PAIR_ACCEPTANCE_ALPHA, a, PAIR_GUESS_POSITIONS)


@dataclass
class SessionStats:
    """What a policy sees. Updated by the orchestrator after each round."""
    acceptance: AcceptanceRate = field(default_factory=lambda: session_acceptance(0.7))
    # The session's long-run acceptance (the pair's pace, from the pair's value): what its fast
    # estimate returns to while target-only rounds show nothing (TARGET_ONLY_RELAX).
    typical: AcceptanceRate = field(default_factory=lambda: pair_acceptance(0.7))
    timing: TimingModel = field(default_factory=TimingModel)
    # Pipelining: how often the draft's guess of the bonus token is the target's, after a fully
    # accepted round (the second condition of a pre-draft hit; the first is accepting all k).
    bonus_match: Ewma = field(default_factory=lambda: Ewma(0.2, 0.5))
    # Branches: how often, after a rejection at a position a branch was made for, the draft's
    # runner-up there was the target's correction (a branch hit).
    branch_match: Ewma = field(default_factory=lambda: Ewma(0.2, 0.5))
    last_k: int = 0
    last_accepted: int = 0
    rounds: int = 0
    rounds_since_draft: int = 0
    # Probes in a row that found speculation still losing: each doubles the wait before the next.
    failed_probes: int = 0
    # Bandit arms: k -> [rounds, mean tokens per ms]
    arms: dict[int, list[float]] = field(default_factory=dict)

    def as_pair_prior(self) -> "SessionStats":
        """A copy to serve as a fresh worker pair's prior: its acceptance averages over many rounds,
        and its starting value (a guess) gives way to the pair's first rounds."""
        a = self.acceptance.value
        return self._copy_with(pair_acceptance(a), pair_acceptance(a))

    def new_session(self) -> "SessionStats":
        """A new session's statistics, from this pair prior: its value, a session's pace; its long-run
        rate, the pair's own estimate with the pair's evidence behind it. (Seeded as a guess of 4
        positions, one first-token rejection took it from 0.75 to 0.59, and the fast estimate's
        relaxing towards it undid nothing.) The last round (its k, what it accepted, the count) is
        some other session's: a new session has none."""
        session = self._copy_with(session_acceptance(self.acceptance.value), copy.deepcopy(self.acceptance))
        session.rounds = session.last_k = session.last_accepted = 0
        return session

    def _copy_with(self, acceptance: AcceptanceRate, typical: AcceptanceRate) -> "SessionStats":
        copied = copy.deepcopy(self)
        copied.acceptance, copied.typical = acceptance, typical
        return copied

    def snapshot(self) -> "SessionStats":
        """A copy to put back if the turn fails (OrchestratorSession's all-or-nothing turn). The
        pair's live load is shared, not copied: it is the pair's, not the turn's."""
        return copy.deepcopy(self, {id(self.timing.load): self.timing.load})

    def carry_turn_into(self, prior: "SessionStats", policy_chose_k: bool) -> None:
        """At the end of a turn, what the pair's prior takes over from this session (its acceptance,
        rounds and arms it has learned round by round): the latest timings, and, where the cost
        policy chose k this turn, its probe back-off, so that where drafting keeps losing a new
        session waits as long as the pair has learned to (rounds_since_draft is the pair's already)."""
        load = prior.timing.load  # the pair's own (shared, live), whatever the session held
        prior.timing = copy.deepcopy(self.timing)
        prior.timing.load = load
        if policy_chose_k:
            prior.failed_probes = self.failed_probes

    def described(self, max_k: int) -> Any:
        """The estimates a policy reads, as an object that turns into one line when printed: a debug
        log pays for the formatting only when it is written."""
        return _Lazy(lambda: self.describe(max_k))

    def describe(self, max_k: int) -> str:
        t = self.timing
        verify = " ".join(f"{t.verify_ms(k):.0f}" for k in range(max_k + 1))
        return (f"a={self.acceptance.value:.2f} draft={t.draft_ms_per_token.value:.1f}ms "
                f"rtt={t.rtt_ms.value:.1f}/{t.draft_rtt_ms.value:.1f}ms batch={t.load.target_batch.value:.2f} "
                f"verify(k=0..{max_k})=[{verify}]ms")

    def observe(self, record: Any, timing: bool = True) -> None:
        """One round (an orchestrator.rounds.RoundRecord). Prefill rounds say nothing about a k's
        steady-state speed, so they do not feed the per-k rates or the verify cost."""
        if timing:
            if record.draft_token_ms > 0:
                self.timing.observe_draft(1, record.draft_token_ms, unseen_rounds=self.rounds_since_draft)
            if record.target_prefilled <= 1:
                self.timing.observe_verify(record.drafted, record.verify_ms, record.target_rows)
            self.timing.load.target_batch.update(max(1.0, record.target_batch) + record.target_waiting)
            self.timing.observe_rtt(record.verify_wall_ms - record.verify_ms)
            if record.draft_wall_ms > 0 and record.draft_ms > 0:
                self.timing.observe_draft_rtt(record.draft_wall_ms - record.draft_ms)
        if record.predraft_hit is not None and self.last_k > 0 and self.last_accepted == self.last_k:
            # The previous round accepted everything, so hit or miss was the bonus guess's doing.
            self.bonus_match.update(1.0 if record.predraft_hit else 0.0)
        if record.predraft_branch_hit is not None:
            self.branch_match.update(1.0 if record.predraft_branch_hit else 0.0)
        if record.overlapped or getattr(record, "budget_capped", False):  # not in traces written before it
            # The prefill overlap ran this round at k = 0 beside the draft's prefill, or the turn's
            # budget left no room to draft: not the policy choosing target-only (which relaxes the
            # acceptance and makes the next drafting round a probe). It says nothing about
            # acceptance or a k's speed.
            self.rounds += 1
            self.last_k, self.last_accepted = 0, 0
            return
        self.observe_round(record.drafted, record.accepted, record.round_ms if record.steady else None, record.k)

    def observe_round(self, k: int, accepted: int, round_ms: float | None = None, chosen_k: int | None = None) -> None:
        """Per-token acceptance from one round: accepted of k drafted (a rejection ends the round);
        chosen_k, the k the round asked for (default: k), tells a target-only round the policy chose
        from one that drafted nothing for another reason (an early stop at the first token, a draft
        fallback)."""
        self.rounds += 1
        self.last_k, self.last_accepted = k, accepted
        if round_ms is not None and round_ms > 0:
            arm = self.arms.setdefault(k, [0.0, 0.0])
            arm[0] += 1
            # Windowed mean (cap the count) so the estimate follows slow drift.
            arm[1] += ((accepted + 1) / round_ms - arm[1]) / min(arm[0], 50.0)
        if k == 0:
            if (k if chosen_k is None else chosen_k) == 0:
                # Target-only by the policy's choice: the wait before a probe grows. Not a round that
                # asked for drafts and got none (an early stop at the first token, a draft fallback):
                # counted as target-only, it made the next drafting round a probe, and a rejection
                # there froze the session at k = 0 for the doubled wait.
                self.rounds_since_draft += 1
                # Only while no probe has failed lately: where drafting was tried and lost, the
                # long-run rate is stale, and the probes' doubling waits decide when to try again.
                if self.failed_probes == 0:
                    self.acceptance.relax_towards(self.typical.value, TARGET_ONLY_RELAX)
            return
        self.rounds_since_draft = 0
        self.acceptance.update(k, accepted)
        self.typical.update(k, accepted)


class _Lazy:
    def __init__(self, text: Callable[[], str]) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text()


def branch_budget(timing: TimingModel, k: int, depth: int, most: int) -> int:
    """How many branch pre-drafts a pipelined round can afford: the most b <= `most` for which the
    main pre-draft (depth tokens) with b branches beside it, each of its forwards then b + 1 rows,
    still ends within the verify it overlaps (its compute + RTT). Branches then use only time the
    draft would spend idle, and never delay a hit of the main pre-draft. None while the pair serves
    other sessions too (target batch > 1.5): their calls need the draft's batch and queue places."""
    if most <= 0 or k <= 0 or timing.load.target_batch.value > 1.5:
        return 0  # (with other sessions on the pair, the draft's batch places are theirs)
    verify_wall = timing.verify_ms(k) + timing.rtt_ms.value
    per_token = timing.draft_ms_per_token.value
    for b in range(most, 0, -1):
        if depth * per_token * timing.draft_rows_factor(b + 1) + timing.draft_rtt_ms.value <= verify_wall:
            return b
    return 0


def predraft_depth(k: int, max_k: int = MAX_K, timing: TimingModel | None = None) -> int:
    """Tokens a pipelined round's pre-draft asks for after k drafts: the guess of the bonus token,
    then k more, and one past k (so that k can grow along a run of hits) where that extra forward
    still ends within the verify it overlaps (`timing`; always without one): a hit waits for the
    whole pre-draft, so where the draft is the slower of the two it would cost every hit a forward.
    Within max_k + 1 and MAX_K. The rounds (orchestrator.rounds) draft this many; the cost policy
    prices it."""
    depth = min(k + 1, max_k) + 1
    if timing is not None and depth > k + 1:
        pre_draft_ms = depth * timing.draft_ms_per_token.value + timing.draft_rtt_ms.value
        if pre_draft_ms > timing.verify_ms(k) + timing.rtt_ms.value:
            depth = k + 1
    return min(depth, MAX_K)


def draft_forwards(k: int, drafted: int) -> int:
    """Forward passes a draft call ran for `drafted` of k tokens: an early stop also ran the forward
    whose distribution's confidence fell below min_draft_prob (at the first position, the commit's
    own forward, and the call proposed nothing)."""
    return drafted + (1 if drafted < k else 0)


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

    def next_k(self, stats: SessionStats, min_k: int, max_k: int, prefill_rows: int = 0) -> int:
        """k for the next round; `prefill_rows`: tokens the target takes in that round's forward
        besides the drafts (a turn's new prompt; 1 in a steady round; 0: unknown, or a round
        whose k does not size a verify)."""


@dataclass
class FixedPolicy:
    k: int = 4
    name: str = "fixed"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int, prefill_rows: int = 0) -> int:
        return _clamp(self.k, min_k, max_k)


@dataclass
class HeuristicPolicy:
    """Hugging Face's schedule: +2 when all drafts were accepted, else -1 (floor 1)."""
    initial_k: int = 4
    name: str = "heuristic"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int, prefill_rows: int = 0) -> int:
        if max_k == 0:
            return 0
        if stats.rounds == 0:
            return _clamp(self.initial_k, max(min_k, 1), max_k)
        k = stats.last_k + 2 if stats.last_accepted >= stats.last_k else stats.last_k - 1
        return _clamp(max(k, 1), max(min_k, 1), max_k)


@dataclass
class CostModelPolicy:
    """Maximise expected tokens per second E(k) / (k*t_draft + t_verify(k) + rtt).

    Picks k = 0 (target-only) when no k > 0 beats plain decoding, e.g. when the draft is slow or
    acceptance is low. While at k = 0 nothing new is learned about acceptance, so after
    `probe_every` target-only rounds it drafts one token to refresh the estimate; each probe after
    which speculation still loses doubles that wait (up to 16x), so a pair that cannot win pays for
    ever fewer probes.

    Pipelined rounds (`pipelined`): with probability h = a^k * b (all k accepted, and the draft's
    guess of the bonus right, measured as b) the next round's drafts are ready when its verify may
    start, having run during this verify; the round then costs t_verify + rtt + whatever of the
    pre-draft outlasted the verify (it drafts predraft_depth(k) tokens: the bonus guess and one
    more than k). With `branches` B, a rejection at one of the first B positions (the likeliest
    ones, about) also hits when the branch's guess of the correction was right, measured as m:
    h += (1 - a^min(B, k)) * m. All k accepted but the bonus guessed wrong (a^k * (1 - b)): the
    guess is known only when the pre-draft returns, so that round waits for it too, then drafts as
    a serial one does. Otherwise it costs what a serial round does.
    """
    probe_every: int = 16
    pipelined: bool = False
    branches: int = 0
    name: str = "cost"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int, prefill_rows: int = 0) -> int:
        best = self._argmax(stats, min_k, max_k)
        if best > 0 and prefill_rows > 1:
            rate = self.tokens_per_ms(stats, best, self.pipelined, self.branches, max_k)
            best = prefill_round_k(stats, max(1, min_k), best, prefill_rows, rate)
        if best > 0:
            if stats.rounds_since_draft == 0:
                stats.failed_probes = 0  # the last round drafted, and with its outcome drafting still pays
            else:
                # Back from target-only on an estimate no drafting round has confirmed (it relaxed
                # towards the session's long-run rate): that is a probe, and counts as one until a
                # drafting round confirms it. So a stale long-run rate buys one round, not one per relax.
                stats.failed_probes += 1
            return best
        if max_k > 0 and self.probe_every:
            if stats.rounds_since_draft >= self.probe_every * 2 ** min(stats.failed_probes, 4):
                stats.failed_probes += 1  # reset as soon as a probe shows that drafting pays
                return max(1, min_k)
        return best

    def _argmax(self, stats: SessionStats, min_k: int, max_k: int) -> int:
        best_k, best_rate = min_k, -1.0
        for k in range(min_k, max_k + 1):
            rate = self.tokens_per_ms(stats, k, self.pipelined, self.branches, max_k)
            if rate > best_rate + 1e-12:
                best_k, best_rate = k, rate
        return best_k

    @staticmethod
    def tokens_per_ms(stats: SessionStats, k: int, pipelined: bool = False, branches: int = 0,
                      max_k: int = MAX_K) -> float:
        t = stats.timing
        draft_ms, verify_ms, rtt = k * t.draft_ms_per_token.value, t.verify_ms(k), t.rtt_ms.value
        draft_rtt = t.draft_rtt_ms.value
        # A speculative round makes two calls (draft, then target), target-only one.
        serial = draft_ms + verify_ms + rtt + (draft_rtt if k > 0 else 0.0)
        cost = serial
        if pipelined and k > 0:
            # Hit: the pre-draft ran during the previous verify; the round waits for whichever of
            # the two calls ends last: max(draft, verify) + rtt.
            depth = predraft_depth(k, max_k, t)
            a, b = stats.acceptance.value, branch_budget(t, k, depth, branches)  # the branches it would run
            all_accepted = a ** k
            hit = all_accepted * stats.bonus_match.value + (1.0 - a ** min(b, k)) * stats.branch_match.value
            wrong_guess = all_accepted * (1.0 - stats.bonus_match.value)
            overhang = max(0.0, depth * t.draft_ms_per_token.value + draft_rtt - verify_ms - rtt)
            cost = (hit * (verify_ms + rtt + overhang) + wrong_guess * (serial + overhang)
                    + max(0.0, 1.0 - hit - wrong_guess) * serial)
        return expected_tokens(stats.acceptance.value, k) / max(cost, 1e-6)


@dataclass
class BanditPolicy:
    """UCB over k whose arm values start at the cost model's prediction.

    The cost model assumes geometric acceptance (each position accepted independently with a).
    Real acceptance is bursty (easy stretches, hard stretches, position effects), so the bandit
    measures tokens per ms for each k it plays and moves away from the model where it is wrong.
    `prior_weight` is how many rounds the model's prediction counts as; `exploration` scales the
    UCB bonus relative to the best predicted rate.
    """
    exploration: float = 0.3
    prior_weight: float = 2.0
    pipelined: bool = False
    branches: int = 0
    name: str = "bandit"

    def next_k(self, stats: SessionStats, min_k: int, max_k: int, prefill_rows: int = 0) -> int:
        arms = range(min_k, max_k + 1)
        prior = {k: CostModelPolicy.tokens_per_ms(stats, k, self.pipelined, self.branches, max_k) for k in arms}
        scale = max(prior.values()) or 1e-9
        total = sum(stats.arms.get(k, [0, 0])[0] for k in arms) + self.prior_weight * len(arms)
        best_k, best_score, values = min_k, -math.inf, {}
        for k in arms:
            n, mean = stats.arms.get(k, [0.0, 0.0])
            values[k] = (self.prior_weight * prior[k] + n * mean) / (self.prior_weight + n)
            # (total < 1 before any round where prior_weight * arms < 1: no bonus yet, not a log < 0)
            bonus = self.exploration * scale * math.sqrt(math.log(max(total, 1.0)) / (self.prior_weight + n))
            if values[k] + bonus > best_score:
                best_k, best_score = k, values[k] + bonus
        if best_k > 0 and prefill_rows > 1:
            # A prompt's round is no arm's typical round (arms learn steady rounds only): at most
            # the arm's k, priced for the prompt's forward against the arm's learned rate.
            return prefill_round_k(stats, max(1, min_k), best_k, prefill_rows, values[best_k])
        return best_k


def prefill_round_k(stats: SessionStats, lo: int, best: int, prefill_rows: int, rate: float) -> int:
    """k for a round whose verify also prefills `prefill_rows` tokens (a turn's new prompt), given
    the steady rounds' best k and their rate (tokens per ms).

    The prompt is paid at any k, and so is the draft's own prefill (now or, at k = 0, when it
    catches up in the next round). What the drafts add is k draft forwards and k rows in a forward
    that is already large, where a row costs what a prefill row does (compute-bound), not the near
    nothing it adds to a one-token decode step. So a steady k is too large here: each draft must
    bring more tokens than the steady rounds would make in its time. k maximises
    E(k) - rate * (k * t_draft + T(P + k) - T(P)) over lo..best, T the target's rows curve.
    Without a curve: best.
    """
    t = stats.timing
    base = t.load.forward_ms(prefill_rows)
    if base is None or best <= lo:
        return best
    a = stats.acceptance.value

    def gain(k: int) -> float:
        extra_rows = (t.load.forward_ms(prefill_rows + k) or base) - base
        return expected_tokens(a, k) - rate * (k * t.draft_ms_per_token.value + extra_rows)
    return max(range(lo, best + 1), key=gain)  # ties: the smaller k


@dataclass(frozen=True)
class OverlapPrice:
    """What the two ways of running a turn's first round cost (ms), as prefill_overlap_price prices
    them: `serial` makes E(k1) tokens, `overlap` one, and `make_up` is what the steady rounds take
    for the tokens the overlap's round did not make."""
    serial: float
    overlap: float
    make_up: float
    k_serial: int

    @property
    def pays(self) -> bool:
        return self.overlap + self.make_up < self.serial


def prefill_overlap_price(stats: SessionStats, prefill_rows: int, min_k: int, max_k: int,
                          pipelined: bool = False, branches: int = 0,
                          remaining: int | None = None) -> OverlapPrice | None:
    """Price the prefill overlap for a turn's first round over `prefill_rows` new prompt tokens
    (rounds.Round, overlap_prefill "auto"). None where there is nothing to price: no k > 0 pays, or
    no forward-cost curve of either worker (calibration skipped).

    Serial, the round drafts k1 (prefill_round_k) after the draft's prefill, then the target
    verifies them with the prompt: D(P) + (k1 - 1)·t_draft + T(P + k1) + both RTTs, for E(k1)
    tokens. (The draft's prefill forward yields its first draft.) With the overlap the target
    prefills alone, for one token, while the draft prefills and pre-drafts round 2's k + 1 tokens
    beside it; round 2 waits for the later of the two: max(T(P) + rtt, D(P) + k·t_draft + draft
    rtt). The overlap pays where that, plus the time the steady rounds need for the E(k1) - 1
    tokens it did not make (at the steady rate of the best k), is less than the serial round: where
    the draft's prefill and drafts are dear against the target's prefill. k is the steady best k
    (the policy's pick for the overlapped round, which only sizes the pre-draft), k1 and k within
    the turn's `remaining` tokens as the rounds clamp them. T is the target's rows curve (as
    measured in service where seen), D the draft's startup curve scaled by how its per-token cost
    now compares with the curve's one-row cost (a draft slowed by a neighbour is slower at prefill
    too). Left out, both in the serial round's favour: round 2 after the overlap is a pre-draft hit
    when the guess of one token was right, while after a serial round it needs all k1 accepted and
    the bonus guessed; and where the draft's side is the longer, its k drafts are round 2's, which
    then drafts nothing, while the steady rate that prices the make-up assumes rounds that draft."""
    t = stats.timing
    lo = max(1, min_k)
    if max_k < lo:
        return None
    best = CostModelPolicy(pipelined=pipelined, branches=branches)._argmax(stats, min_k, max_k)
    rate = CostModelPolicy.tokens_per_ms(stats, best, pipelined, branches, max_k)
    draft_prompt = t.draft_prefill_ms(prefill_rows, slowdown=(0.5, 2.0))
    target_prompt = t.load.forward_ms(prefill_rows)
    if best < lo or draft_prompt is None or target_prompt is None or rate <= 0:
        return None
    per_token = t.draft_ms_per_token.value
    k_serial = prefill_round_k(stats, lo, best, prefill_rows, rate)
    depth = best
    if remaining is not None:  # as the rounds clamp them: a round's k + 1 tokens, the pre-draft's k + 1
        k_serial, depth = max(1, min(k_serial, remaining - 1)), max(0, min(best, remaining - 2))
    target_serial = t.load.forward_ms(prefill_rows + k_serial) or target_prompt
    serial = (draft_prompt + (k_serial - 1) * per_token + t.draft_rtt_ms.value
              + target_serial + t.rtt_ms.value)
    overlap = max(target_prompt + t.rtt_ms.value, draft_prompt + depth * per_token + t.draft_rtt_ms.value)
    make_up = (expected_tokens(stats.acceptance.value, k_serial) - 1.0) / rate
    return OverlapPrice(serial, overlap, make_up, k_serial)


def _running_max(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points sorted by x, each y raised to the largest before it: a non-decreasing cost curve."""
    curve, highest = [], 0.0
    for x, y in sorted(points):
        highest = max(highest, y)
        curve.append((x, highest))
    return curve


_ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 192, 256)


def _rows_bucket(rows: float) -> int:
    """The nearest of a fixed grid (exact up to 10 rows, then about 15 % apart)."""
    return min(_ROW_BUCKETS, key=lambda b: (abs(b - rows), b))


def _clamp(k: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, k))


def speedup_bound(a: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected speedup S(k) = (1 - a^(k+1)) / ((1 - a)(k*c + 1))."""
    return expected_tokens(a, k) / (k * c + 1.0)
