"""The pair guard: a measured check that speculation beats target-only on a worker pair as a whole.

The k policies (kpolicy.py) price each session's k from a model of the pair's costs. What no
per-session model sees is what the sessions do to each other:
- co-located workers: while any session drafts, the draft's forwards take the cores that every
  session's verify needs, a k = 0 verify included;
- under load, the rows one session's drafts add to everyone's batched forward, and whatever else
  slows forwards.
So the guard measures instead of modelling. It runs the pair in epochs, either speculating (each
session's policy picks k) or target-only (k = 0 for every guarded session of the pair at once, so
the draft's load is really gone), and compares the tokens per millisecond that the sessions' steady
rounds made in each. Most of the time the pair runs the mode that won; short epochs of the other
mode re-measure it. The winner's epochs last 4x the time of the other's, doubled per decision that
confirms it (up to 4 x `max_stretch`), and long enough that the loser's epochs cost about
MEASUREMENT_COST of the throughput: a clear winner is re-checked ever more rarely.

How many rounds an epoch needs grows with the pair's concurrency: at least rounds_per_session (4)
per round in flight at once, so that at 8 streams a target-only probe is not one batched step, whose
rate a single neighbour's prompt chunk in the batch decides (seen on a 2-core CPU: one such probe measured
target-only 20 % low and kept a losing speculation on for another 40 s).

A decision holds for the load it was measured at. When the pair's concurrency (the most guarded
rounds in flight over the last LOAD_WINDOW decisions) moves LOAD_SHIFT times above or below what it
was when the epoch began, and by at least MIN_LOAD_CHANGE rounds, the rates compared so far are of
another load: the guard drops them and measures both modes again, the current winner first, in
short epochs, instead of holding the old decision through a winner's epoch that may be 64x a probe
long. Being a peak over a window, the load sees a rise at once and a fall only after LOAD_WINDOW
decisions: an epoch that straddles a fall can still be decided on mixed rates. Sessions that the
guard does not steer (fixed k, heuristic, min_k > 0) are not counted in the load.

What a round counts for: only steady rounds (a prompt's prefill would swamp the per-token rates),
decided in the current epoch after every round of earlier epochs had ended. A steady round whose
target forward also ran other sessions' prompt rows counts with that forward's time scaled to its
decode rows alone, on the target's rows curve (`without_prompt_rows`): prompts arrive as they do in
either mode, and in a closed loop they arrive in waves, so a short probe that caught one measured
the wave rather than the mode (seen on a 2-core CPU: a target-only probe during 8 arrivals measured
0.79 tok/s per session against 1.2 steady, and kept a losing speculation on for the rest of the
load). What only speculation costs around prompts (the draft prefilling them on shared cores, which
slows every forward beside it) is not removed: it is no row of the target's forward. Not counted in
either mode: prompts, and the draft's catch-up on the tokens of a target-only epoch (the first speculating
round of each session after one; in a target-only epoch the draft is not fed). Pure Python, no
clock: rates come from the rounds' own times, so tests drive it with synthetic rounds.

Lossless by construction: the guard only chooses k, before a round runs, from earlier rounds' times.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SPECULATE, TARGET_ONLY = "spec", "off"
MEASUREMENT_COST = 0.03  # what the losing mode's re-measurements may cost, as a fraction of throughput
LOAD_SHIFT = 2.0         # concurrency this many times higher or lower than when the epoch began: measure anew
LOAD_WINDOW = 32         # decisions over which the pair's concurrency is taken (their most rounds in flight)
MIN_LOAD_CHANGE = 2      # ... and by at least this many rounds in flight


def without_prompt_rows(round_ms: float, verify_ms: float, rows: float, prompt_rows: float,
                        forward_ms: Callable[[float], float | None]) -> float:
    """A round's time with its target forward's prompt rows taken out: the verify's compute scaled
    by T(rows - prompt_rows) / T(rows) on the target's cost curve `forward_ms`. Unchanged where no
    prompt shared the forward or the curve cannot tell."""
    if prompt_rows <= 0 or rows <= prompt_rows or verify_ms <= 0:
        return round_ms
    full, decode = forward_ms(rows), forward_ms(rows - prompt_rows)
    if not full or decode is None or full <= 0:
        return round_ms
    return max(0.0, round_ms - verify_ms * (1.0 - min(1.0, decode / full)))


@dataclass(frozen=True)
class GuardSettings:
    spec_rounds: int = 32   # fewest counted rounds of a speculating epoch
    off_rounds: int = 8     # fewest counted rounds of a target-only epoch (they vary little: one token each)
    margin: float = 0.03    # the other mode must win by this fraction to flip the decision
    max_stretch: int = 16   # the winner's epochs last 4x the other mode's last epoch, x2 per confirmation, up to 4x this
    rounds_per_session: int = 4  # an epoch counts at least this many rounds per round in flight at once (0: off)

    def validate(self) -> "GuardSettings":
        counts = (self.spec_rounds, self.off_rounds, self.max_stretch)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"guard epochs need at least one round and max_stretch >= 1 (integers), got {counts}")
        per_session = self.rounds_per_session
        if isinstance(per_session, bool) or not isinstance(per_session, int) or per_session < 0:
            raise ValueError(f"guard rounds_per_session must be an integer >= 0, got {per_session!r}")
        if not 0.0 <= self.margin < 1.0:  # also rejects NaN
            raise ValueError(f"guard margin must be in [0, 1), got {self.margin}")
        return self


@dataclass(frozen=True)
class GuardTicket:
    """What the guard decided for one round; handed back with the round's outcome (or abandoned)."""
    epoch: int
    mode: str
    clean: bool  # no round of an earlier epoch was still running when this one was decided


class PairGuard:
    """One worker pair's measured choice between speculating and target-only (see the module doc).

    Shared by every session on the pair (deepcopy returns it), like the pair's TargetLoad."""

    def __init__(self, settings: GuardSettings = GuardSettings(), name: str = "pair") -> None:
        self.settings = settings.validate()
        self.name = name
        self.speculation_wins = True  # what the last comparison found (a new pair starts speculating)
        self.streak = 0               # decisions in a row that confirmed it
        self.epoch = 0
        self.mode = SPECULATE         # what the current epoch runs
        self.rates: dict[str, float | None] = {SPECULATE: None, TARGET_ONLY: None}  # tokens per ms
        self.decisions = 0
        self.flips = 0
        self._outstanding: dict[int, int] = {}  # epoch -> rounds decided in it and still running
        self._last_ms = {SPECULATE: 0.0, TARGET_ONLY: 0.0}  # counted round time of each mode's last epoch
        self._needed_rounds, self._needed_ms = self._length(SPECULATE)
        self._in_flight_peak = 0  # most rounds of this pair running at once during this epoch
        self._recent_in_flight: deque[int] = deque(maxlen=LOAD_WINDOW)  # rounds in flight at each decision
        self._epoch_load = 0      # the pair's concurrency when the current epoch began (0: not yet known)
        self.load_restarts = 0
        self._counted = 0
        self._drafting = 0    # counted rounds that drafted
        self._tokens = 0.0
        self._ms = 0.0

    def __deepcopy__(self, memo: dict) -> "PairGuard":
        return self

    # ------------------------------------------------------------------ rounds
    def decide(self) -> GuardTicket:
        """Before a round: TARGET_ONLY means it runs k = 0 (the policy is not asked), SPECULATE that
        the session's policy picks k. Hand the ticket back to observe() or abandon()."""
        self._recent_in_flight.append(self.in_flight + 1)
        if not self._epoch_load:
            self._epoch_load = self.load  # the pair's first round
        elif self._load_shifted():
            if self._counted == 0 and all(rate is None for rate in self.rates.values()):
                self._epoch_load = self.load  # already measuring afresh, nothing counted yet: a ramp
            else:
                self._restart_for_load()
        clean = all(epoch == self.epoch for epoch in self._outstanding)
        self._outstanding[self.epoch] = self._outstanding.get(self.epoch, 0) + 1
        self._in_flight_peak = max(self._in_flight_peak, self.in_flight)
        return GuardTicket(self.epoch, self.mode, clean)

    @property
    def load(self) -> int:
        """The pair's concurrency: the most rounds in flight at any of the last LOAD_WINDOW decisions
        (a peak, since sessions of one batched step decide their next rounds one after another)."""
        return max(self._recent_in_flight, default=0)

    def _load_shifted(self) -> bool:
        """The load is LOAD_SHIFT times above or below the epoch's start, and by at least
        MIN_LOAD_CHANGE rounds (so that 1 <-> 2 sessions, common at low load, does not count)."""
        now, then = self.load, self._epoch_load
        if abs(now - then) < MIN_LOAD_CHANGE:
            return False
        return not 1.0 / LOAD_SHIFT < now / then < LOAD_SHIFT

    def _restart_for_load(self) -> None:
        """The load moved by LOAD_SHIFT or more since the epoch began: the rates compared so far
        were measured at another load. Measure both modes anew, the current winner first, in
        short epochs, rather than hold the old decision for the rest of a long epoch."""
        log.info("pair %s: up to %d guarded rounds in flight lately, against %d when the epoch began: "
                 "measuring both modes again",
                 self.name, self.load, self._epoch_load)
        self.load_restarts += 1
        self.streak = 0
        self.rates = {SPECULATE: None, TARGET_ONLY: None}
        self._begin_epoch(self.winner)

    def abandon(self, ticket: GuardTicket) -> None:
        """The round failed or was cancelled: it measured nothing."""
        left = self._outstanding.get(ticket.epoch, 0) - 1
        if left > 0:
            self._outstanding[ticket.epoch] = left
        else:
            self._outstanding.pop(ticket.epoch, None)

    def observe(self, ticket: GuardTicket, tokens: int, round_ms: float, steady: bool, drafted: bool) -> None:
        """The round decided under `ticket` made `tokens` tokens in `round_ms` (drafted: it ran k > 0).

        It counts only if it is steady, of the current epoch, and was decided after every round of
        earlier epochs had ended: a target-only round beside another session's speculating round
        still shares the draft's load, and the other way round."""
        self.abandon(ticket)
        if ticket.epoch != self.epoch or not ticket.clean or not steady or round_ms <= 0:
            return
        self._counted += 1
        self._drafting += int(drafted)
        self._tokens += tokens
        self._ms += round_ms
        if self._counted >= self.needed_rounds and self._ms >= self._needed_ms:
            self._end_epoch()

    @property
    def in_flight(self) -> int:
        """Rounds decided and not yet observed or abandoned: the pair's current concurrency."""
        return sum(self._outstanding.values())

    @property
    def needed_rounds(self) -> int:
        """Counted rounds the current epoch needs: its mode's base count, and rounds_per_session per
        round in flight at once during the epoch."""
        return max(self._needed_rounds, self.settings.rounds_per_session * self._in_flight_peak)

    # ------------------------------------------------------------------ epochs
    @property
    def winner(self) -> str:
        return SPECULATE if self.speculation_wins else TARGET_ONLY

    def _length(self, mode: str) -> tuple[int, float]:
        """(fewest counted rounds, fewest counted ms) of an epoch of `mode`. The other mode's epochs
        only measure: their base rounds. The winner's also last 4x the time of the other mode's last
        epoch, doubled per confirming decision, and at least loss / MEASUREMENT_COST times it: the
        losing mode never takes more than a fifth of the pair's time, less the further it is behind,
        and ever less while the decision holds."""
        rounds = self.settings.spec_rounds if mode == SPECULATE else self.settings.off_rounds
        loser = TARGET_ONLY if mode == SPECULATE else SPECULATE
        if mode != self.winner or self.rates[loser] is None:  # measuring, or nothing yet to compare with
            return rounds, 0.0
        factor = 4.0 * min(2 ** self.streak, self.settings.max_stretch)
        won, lost = self.rates[mode], self.rates[loser]
        if won:
            # The further behind the loser, the more its epochs cost: long enough that they cost
            # about MEASUREMENT_COST of the pair's throughput (a loser at 0.6x: 13x its time).
            factor = max(factor, max(0.0, 1.0 - lost / won) / MEASUREMENT_COST)
        return rounds, min(factor, 4.0 * self.settings.max_stretch) * self._last_ms[loser]

    def _end_epoch(self) -> None:
        self.rates[self.mode] = self._tokens / self._ms
        self._last_ms[self.mode] = self._ms
        measured = self.mode != self.winner  # the short epoch of the other mode just ended
        if measured:
            self._decide()
        # After a measurement the winner runs; after the winner's epoch, the other mode measures.
        self._begin_epoch(self.winner if measured else (TARGET_ONLY if self.mode == SPECULATE else SPECULATE))

    def _begin_epoch(self, mode: str) -> None:
        self.mode = mode
        self.epoch += 1
        self._needed_rounds, self._needed_ms = self._length(mode)
        self._in_flight_peak = self.in_flight
        self._epoch_load = self.load
        self._counted, self._drafting, self._tokens, self._ms = 0, 0, 0.0, 0.0

    def _decide(self) -> None:
        spec, off = self.rates[SPECULATE], self.rates[TARGET_ONLY]
        if spec is None or off is None:
            return
        margin = self.settings.margin
        # Hysteresis: the current winner keeps its place unless the other mode beats it by the margin.
        wins = spec >= off * (1.0 - margin) if self.speculation_wins else spec > off * (1.0 + margin)
        if wins and not self.speculation_wins and 2 * self._drafting < self._counted:
            # The policies themselves ran target-only through most of the probe: its rate is that of
            # k = 0 again, and says nothing for drafting.
            wins = False
        self.decisions += 1
        log.debug("pair %s: decision %d, speculating %.3f tok/s per session, target-only %.3f: %s", self.name,
                  self.decisions, spec * 1000.0, off * 1000.0, "speculate" if wins else "target-only")
        if wins == self.speculation_wins:
            self.streak += 1
        else:
            self.flips += 1
            self.streak = 0
            self.speculation_wins = wins
            # Speculation switched off on a pair is a degraded mode an operator wants to see.
            log.log(logging.INFO if wins else logging.WARNING,
                    "pair %s: %s now (speculating %.2f tok/s per session, target-only %.2f)", self.name,
                    "speculating" if wins else "target-only", spec * 1000.0, off * 1000.0)
