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
MEASUREMENT_COST of the throughput: a clear winner is re-checked ever more rarely. The other's time
is that of every round its epoch decided, not only those its rate counts: a speculating probe
after target-only epochs begins with each session's draft catching up on its whole backlog, and
turns that begin in it pay their prompts on the draft (loadtest run 63, 2-core Zen 5, 8 streams:
a probe of 28 rounds prefilled 531 tokens on the draft, its first rounds ran 3-5 s for 1-2 tokens).

A speculating probe that trails target-only by GuardSettings.cut_loss (25 %) at half its rounds
ends there (`_probe_clearly_lost`); target-only epochs never end early (target-only is the safe mode).

How many rounds an epoch needs grows with the pair's concurrency: at least rounds_per_session (4)
per round in flight at once, so that at 8 streams a target-only probe is not one batched step, whose
rate a single neighbour's prompt chunk in the batch decides (seen on a 2-core CPU: one such probe measured
target-only 20 % low and kept a losing speculation on for another 40 s).

A decision holds for the load it was measured at. When the pair's concurrency (the most guarded
rounds in flight over the last LOAD_WINDOW decisions) moves LOAD_SHIFT times above or below what it
was when the epoch began, and by at least MIN_LOAD_CHANGE rounds, the rates compared so far are of
another load, and the old decision's epoch may be 64x a probe long. If the pair was decided at
about the new load before, that decision comes back, once (`_take_back_decision`). After a rise
above a load where speculating lost (the highest lower load decided), target-only holds for a
winner's epoch, as if that loss had been confirmed here once, one such epoch per load over all its
visits (`_assume_loss_from_below`): speculation that lost at a load rarely wins at a higher one.
Otherwise the guard drops the rates and measures both modes again in short epochs: after a rise target-only
first (the mode that batching favours, and the safe one while the new sessions' prompts arrive;
provisionally, with no hysteresis in the comparison that follows), after a fall the current winner
first. Being a peak over a window, the load sees a rise at once and a fall only after LOAD_WINDOW
decisions: an epoch that straddles a fall can still be decided on mixed rates. Sessions that the
guard does not steer (fixed k, heuristic, min_k > 0) are not counted in the load.
A turn counts in the load from its arrival (`arrive`), not only once its first round is decided;
and, while the pair speculates, its first round waits a moment for turns arriving with it
(`arrival_wait_ms`), so that a burst of turns decides at the burst's load, not each at the load
before the next one arrived.

What a round counts for: only steady rounds (a prompt's prefill would swamp the per-token rates),
decided in the current epoch after every round of earlier epochs had ended, bar long ones (still
running after LONG_ROUND_DECISIONS decisions per round in flight in this epoch: a first round over
a long prompt would otherwise run the new epoch's mode uncounted for all its length). A steady round whose
target forward also ran other sessions' prompt rows counts with that forward's time scaled to its
decode rows alone, on the target's rows curve (`without_prompt_rows`): prompts arrive as they do in
either mode, and in a closed loop they arrive in waves, so a short probe that caught one measured
the wave rather than the mode (seen on a 2-core CPU: a target-only probe during 8 arrivals measured
0.79 tok/s per session against 1.2 steady, and kept a losing speculation on for the rest of the
load). What only speculation costs around prompts (the draft prefilling them on shared cores, which
slows every forward beside it) is not removed: it is no row of the target's forward. Not counted in
the steady rates: prompts (they enter per turn, below), and the draft's catch-up on the tokens of a
target-only epoch (the first speculating round of each session after one; in a target-only epoch the
draft is not fed).

Then whole turns: a turn's first round costs more speculating than target-only (the draft prefills
the prompt and drafts on the critical path) and makes a few more tokens. Under load on shared
cores that decides the comparison (loadtest run 27, 2-core Zen 5, 4 streams: steady speculating
rounds made 5.7 tok/s per session against target-only's 5.4, but a first round took 1.8 s for 2.9
tokens against 1.0 s for one, and 32-token turns came out 3 % slower speculating). So the guard
compares the modes per turn of the pair's mean length L (over the last 1 / (1 - TURN_MEMORY) or so
turns that ended): a turn costs its first round plus the rest of L at the mode's steady rate. The
first rounds are read from turns that began speculating: the whole round is what speculating paid,
for the tokens it made. What target-only would have paid for the same prompt, for one token, is
priced beside it: a steady target-only round plus what the prompt adds to that step on the target's
rows curve (`prompt_extra_ms`), with the prompt's own size and the forward's sessions. Not the
round's own target call, as it was priced until loadtest run 62 (2-core Zen 5, 4 streams): that
call ran beside the other sessions' drafting and draft prefills on the shared cores,
and took 2.1-2.7 s where target-only's first rounds arriving apart took 0.6-0.9 s, so target-only's turns were
priced as dear as speculating's and a 7 % loss went on. Where the curve cannot tell (fewer than
two points), the target call's wall time stands in. A first round counts if it was decided clean
(as above) and its draft had no backlog to catch up on (a session back from a target-only epoch:
that is the epoch's cost, not a turn's). Two errors remain: target-only's first round is priced
as one forward, without the wait for a step in flight, a wave of other prompts in its forward, or the
prompt's split into chunks beside other sessions (a few steps of each stream) (low: the error is
towards target-only, the safe mode; it is never priced above the speculating round itself); and while target-only wins, first rounds are sampled
in speculating probes, beside the other sessions' catch-ups, which prices speculating's high. Until
about three turns (MIN_FIRST_ROUNDS) have begun speculating at the current load, the steady rates
alone decide.

Pure Python, no clock: rates come from the rounds' own times, so tests drive it with synthetic rounds.

Lossless by construction: the guard only chooses k, before a round runs, from earlier rounds' times.

Over 300 lines: the epochs, the load restarts with their memory and the per-turn prices are one
state machine over the same rates, and a fifth of the lines are this description.
"""
from __future__ import annotations

import copy
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

log = logging.getLogger(__name__)

SPECULATE, TARGET_ONLY = "spec", "off"
MEASUREMENT_COST = 0.03  # what the losing mode's re-measurements may cost, as a fraction of throughput
LOAD_SHIFT = 2.0         # concurrency this many times higher or lower than when the epoch began: measure anew
LOAD_WINDOW = 32         # decisions over which the pair's concurrency is taken (their most rounds in flight)
MIN_LOAD_CHANGE = 2      # ... and by at least this many rounds in flight
TURN_MEMORY = 0.9        # per new turn, the weight left to older turns in the per-turn figures
MIN_FIRST_ROUNDS = 2.5   # decayed count of first rounds (about 3) before turns are priced with them
LONG_ROUND_DECISIONS = 3  # per round in flight: decisions of an epoch after which its predecessors' rounds are long ones
ARRIVAL_SHARE = 0.02     # of a turn's expected prompt forward: how long it waits for turns arriving with it


def same_load(a: int, b: int) -> bool:
    """Two concurrencies (rounds in flight) are one load: within LOAD_SHIFT of each other, or less
    than MIN_LOAD_CHANGE apart (so that 1 <-> 2 sessions, common at low load, does not count)."""
    return abs(a - b) < MIN_LOAD_CHANGE or 1.0 / LOAD_SHIFT < a / max(b, 1) < LOAD_SHIFT


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
    cut_loss: float = 0.25  # a speculating probe this far behind target-only at half its rounds ends there (0: off)
    arrival_window_ms: float = 20.0  # most a turn about to speculate waits for turns arriving with it (0: off)

    def validate(self) -> "GuardSettings":
        counts = (self.spec_rounds, self.off_rounds, self.max_stretch)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"guard epochs need at least one round and max_stretch >= 1 (integers), got {counts}")
        per_session = self.rounds_per_session
        if isinstance(per_session, bool) or not isinstance(per_session, int) or per_session < 0:
            raise ValueError(f"guard rounds_per_session must be an integer >= 0, got {per_session!r}")
        if not 0.0 <= self.margin < 1.0:  # also rejects NaN
            raise ValueError(f"guard margin must be in [0, 1), got {self.margin}")
        if not 0.0 <= self.cut_loss < 1.0:
            raise ValueError(f"guard cut_loss must be in [0, 1), got {self.cut_loss}")
        window = self.arrival_window_ms
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0.0 <= window <= 1000.0:
            raise ValueError(f"guard arrival_window_ms must be in [0, 1000], got {window!r}")
        return self


def prompt_extra_ms(prompt_rows: float, sessions: float, forward_ms: Callable[[float], float | None]) -> float | None:
    """What a prompt of `prompt_rows` adds to a target-only step beside `sessions` - 1 other
    sessions' single decode rows, on the target's rows curve: T(others + prompt) - T(others + 1).
    None where the curve cannot tell."""
    if prompt_rows <= 1:
        return 0.0
    others = max(0.0, sessions - 1.0)
    with_prompt, steady = forward_ms(others + prompt_rows), forward_ms(others + 1.0)
    if with_prompt is None or steady is None:
        return None
    return max(0.0, with_prompt - steady)


@dataclass
class FirstRounds:
    """Decayed sums over the first rounds of turns that began speculating (see the module doc)."""
    turns: float = 0.0
    round_ms: float = 0.0   # the whole round: what speculating paid
    tokens: float = 0.0     # what speculating made (target-only: one token)
    # What target-only would have paid for each: a steady target-only round plus the prompt's extra
    # on the target's rows curve (`prompt_extra_ms`), where the curve could tell ...
    modelled: float = 0.0   # (decayed count of those rounds)
    prompt_ms: float = 0.0
    modelled_round_ms: float = 0.0  # those rounds' whole time: target-only is never priced above it
    target_ms: float = 0.0  # ... else the round's target call's wall time (the pairing)

    def add(self, round_ms: float, target_ms: float, tokens: int, prompt_ms: float | None = None) -> None:
        self.turns = self.turns * TURN_MEMORY + 1.0
        self.round_ms = self.round_ms * TURN_MEMORY + round_ms
        self.tokens = self.tokens * TURN_MEMORY + tokens
        self.modelled *= TURN_MEMORY
        self.prompt_ms *= TURN_MEMORY
        self.modelled_round_ms *= TURN_MEMORY
        self.target_ms *= TURN_MEMORY
        if prompt_ms is not None:
            self.modelled += 1.0
            self.prompt_ms += min(prompt_ms, round_ms)
            self.modelled_round_ms += round_ms
        else:
            self.target_ms += min(target_ms, round_ms)

    def target_only_ms(self, off_rate: float) -> float:
        """The mean price of target-only's first round, at its steady rate `off_rate` (tokens per ms).
        Never above what the speculating rounds themselves took, which held a target call over the
        same prompt and more (the pairing's bound too)."""
        if self.turns <= 0 or off_rate <= 0:
            raise ValueError(f"no first rounds ({self.turns}) or no target-only rate ({off_rate})")
        modelled = min(self.prompt_ms + self.modelled / off_rate, self.modelled_round_ms)
        return (modelled + self.target_ms) / self.turns


def per_turn_rates(spec_rate: float, off_rate: float, turn_tokens: float,
                   first: FirstRounds) -> tuple[float, float] | None:
    """(speculating, target-only) tokens per ms over a whole turn of `turn_tokens` tokens: its first
    round as `first` measured it, the rest at the mode's steady rate. None where it cannot tell."""
    n = first.turns
    if n <= 0 or spec_rate <= 0 or off_rate <= 0 or turn_tokens <= 0:
        return None
    spec_ms = first.round_ms / n + max(0.0, turn_tokens - first.tokens / n) / spec_rate
    off_ms = first.target_only_ms(off_rate) + max(0.0, turn_tokens - 1.0) / off_rate
    if spec_ms <= 0 or off_ms <= 0:
        return None
    return turn_tokens / spec_ms, turn_tokens / off_ms


class Decision(NamedTuple):
    """A comparison's outcome, as remembered for the load it was measured at."""
    speculation_wins: bool
    rates: dict[str, float | None]
    first_rounds: FirstRounds
    last_ms: dict[str, float]
    taken_back: bool = False  # taken back once since (kept: a loss still stands for higher loads)


@dataclass(frozen=True)
class GuardTicket:
    """What the guard decided for one round; handed back with the round's outcome (or abandoned)."""
    epoch: int
    mode: str
    clean: bool  # no round of an earlier epoch was still running when this one was decided (bar long ones)
    load_era: int = 0  # which load the guard was measuring at (counts the load restarts)


class PairGuard:
    """One worker pair's measured choice between speculating and target-only (see the module doc).

    Shared by every session on the pair (deepcopy returns it), like the pair's TargetLoad."""

    def __init__(self, settings: GuardSettings = GuardSettings(), name: str = "pair") -> None:
        self.settings = settings.validate()
        self.name = name
        # What the last comparison found (a new pair starts speculating). After a rise in load with
        # nothing remembered for the new load: target-only provisionally, until the comparison.
        self.speculation_wins = True
        self._provisional_from: bool | None = None  # what was found before a provisional target-only
        self.streak = 0               # decisions in a row that confirmed it
        self.epoch = 0
        self.mode = SPECULATE         # what the current epoch runs
        self.rates: dict[str, float | None] = {SPECULATE: None, TARGET_ONLY: None}  # tokens per ms
        self.decisions = 0
        self.flips = 0
        self._outstanding: dict[int, int] = {}  # epoch -> rounds decided in it and still running
        # Round time of each mode's last epoch: its counted rounds, and the rest it decided (a
        # speculating probe's catch-ups and first rounds cost as much, uncounted in its rate).
        self._last_ms = {SPECULATE: 0.0, TARGET_ONLY: 0.0}
        self._needed_rounds, self._needed_ms = self._length(SPECULATE)
        self._in_flight_peak = 0  # most rounds of this pair running at once during this epoch
        self._recent_in_flight: deque[int] = deque(maxlen=LOAD_WINDOW)  # rounds in flight at each decision
        self._arriving = 0        # turns begun whose first round is not decided yet (arrive / depart)
        self._epoch_load = 0      # the pair's concurrency when the current epoch began (0: not yet known)
        self.load_restarts = 0
        self._load_era = 0        # +1 at every move of the load: tickets of another era price no first rounds here
        self._epoch_decisions = 0  # rounds decided in the current epoch
        self.first_rounds = FirstRounds()  # turns begun speculating at the current load
        # The last decision at each load it was measured at (rounds in flight); taken back at most once.
        self._decided_at: dict[int, Decision] = {}
        # Loads held target-only for a loss below them (_assume_loss_from_below), not compared at
        # since: the counted ms held there so far, over all visits; and the hold now running, if any.
        self._held_at: dict[int, float] = {}
        self._holding: int | None = None
        self._next_hold: int | None = None
        self._turns = 0.0        # decayed count of the turns that ended ...
        self._turn_tokens = 0.0  # ... and of their tokens: the pair's mean turn length
        self._counted = 0
        self._drafting = 0    # counted rounds that drafted
        self._tokens = 0.0
        self._ms = 0.0
        self._uncounted_ms = 0.0

    def __deepcopy__(self, memo: dict) -> "PairGuard":
        return self

    # ------------------------------------------------------------------ rounds
    def decide(self) -> GuardTicket:
        """Before a round: TARGET_ONLY means it runs k = 0 (the policy is not asked), SPECULATE that
        the session's policy picks k. Hand the ticket back to observe() or abandon()."""
        self._recent_in_flight.append(self.in_flight + 1 + self._arriving)
        if not self._epoch_load:
            self._epoch_load = self.load  # the pair's first round
        elif self._load_shifted():
            self._load_era += 1
            if self._counted == 0 and all(rate is None for rate in self.rates.values()):
                # Already measuring afresh, nothing counted yet: a ramp. It may reach a load decided
                # before, or one above a load where speculation lost.
                rise = self.load > self._epoch_load
                self._epoch_load = self.load
                if self._take_back_decision() or (rise and self._assume_loss_from_below()):
                    self._begin_epoch(self.winner)
                else:
                    self.first_rounds = FirstRounds()  # those of the ramp's lower load
            else:
                self._restart_for_load()
        self._epoch_decisions += 1
        # A round of an earlier epoch still running after every round in flight was decided about
        # LONG_ROUND_DECISIONS times in this one is a long one (a first round over a long prompt):
        # waiting for it would run this epoch's mode, uncounted, for all its length (a 20 s prompt
        # round kept a losing probe on for 20 s). Rounds beside it count.
        long_ones_only = self._epoch_decisions > LONG_ROUND_DECISIONS * max(1, self._in_flight_peak)
        clean = long_ones_only or all(epoch == self.epoch for epoch in self._outstanding)
        self._outstanding[self.epoch] = self._outstanding.get(self.epoch, 0) + 1
        self._in_flight_peak = max(self._in_flight_peak, self.in_flight)
        return GuardTicket(self.epoch, self.mode, clean, self._load_era)

    def arrive(self) -> None:
        """A turn began on the pair: it counts in the load from now until its first round's decide()
        (call depart() just before that, or when the turn ends without one)."""
        self._arriving += 1

    def depart(self) -> None:
        self._arriving = max(0, self._arriving - 1)

    def arrival_wait_ms(self, prompt_forward_ms: float | None) -> float:
        """How long a turn's first round waits before its decide() for turns arriving with it:
        ARRIVAL_SHARE of its prompt's expected target forward (`prompt_forward_ms`, from the target's
        rows curve), at most `arrival_window_ms`; 0 unless the pair is speculating (only speculating
        first rounds cost more than target-only's) or where the curve cannot tell.
        Why: turns that arrive together (here 4 within 3 ms) decided one after another, each before
        the next one arrived, so all but the last saw the old load and speculated over their prompts
        at a load where speculating lost (loadtest runs 63-65, 2-core Zen 5, 4 streams: 1.5-3.1 s
        first rounds for 1-4 tokens, beside 0.6 s target-only ones). Waiting a fiftieth of the
        prompt's forward costs a lone turn about that share of its first token's latency."""
        window = self.settings.arrival_window_ms
        if self.mode != SPECULATE or window <= 0 or prompt_forward_ms is None or prompt_forward_ms <= 0:
            return 0.0
        return min(window, ARRIVAL_SHARE * prompt_forward_ms)

    @property
    def load(self) -> int:
        """The pair's concurrency: the most rounds in flight at any of the last LOAD_WINDOW decisions
        (a peak, since sessions of one batched step decide their next rounds one after another),
        turns that arrived and have not decided their first round included."""
        return max(self._recent_in_flight, default=0)

    def _load_shifted(self) -> bool:
        """The load is no longer the one the epoch began at (`same_load`)."""
        return not same_load(self.load, self._epoch_load)

    def _restart_for_load(self) -> None:
        """The load moved by LOAD_SHIFT or more since the epoch began: the rates compared so far
        were measured at another load, and the old decision's epoch may be long. If the pair was
        decided at about this load before (`same_load`) and has not taken that decision back since,
        it comes back with its rates, and its winner runs a winner's epoch (`_length`) before the
        other mode is measured again (a load that moves between two levels pays for exploring each
        level every other visit, not at every move; taken back once only, so that a load that moves
        faster than a winner's epoch still gets its loser measured).
        After a rise above a load where speculating lost, target-only holds for a winner's epoch
        first, counted over all visits to this load, so that here too the loser is measured in
        the end (`_assume_loss_from_below`). Otherwise both modes are measured anew in short
        epochs: after a fall the current winner first, after a rise target-only first. A rise is
        where speculation stops paying (batching makes each target-only token cheaper, the drafts'
        rows make each forward dearer), and the turns that raised the load begin in the safe mode
        instead of paying for speculating prompts."""
        rise = self.load > self._epoch_load
        self.load_restarts += 1
        self.streak = 0
        log.info("pair %s: up to %d guarded rounds in flight lately, against %d when the epoch began",
                 self.name, self.load, self._epoch_load)
        recalled = self._take_back_decision() or (rise and self._assume_loss_from_below())
        if not recalled:
            self.rates = {SPECULATE: None, TARGET_ONLY: None}
            self.first_rounds = FirstRounds()
            if rise and self.speculation_wins:
                self._provisional_from, self.speculation_wins = True, False  # until the comparison
            elif not rise and self._provisional_from is not None:  # a fall before the comparison
                self.speculation_wins, self._provisional_from = self._provisional_from, None
            log.info("pair %s: measuring both modes again, %s first", self.name, self.winner_name)
        self._begin_epoch(self.winner)

    def _take_back_decision(self) -> bool:
        """Take back (once) the last decision taken at about the current load, if any (see
        _restart_for_load). A change of mode this way is logged like a decision's."""
        near = [load for load, decision in self._decided_at.items()
                if same_load(load, self.load) and not decision.taken_back]
        if not near:
            return False
        load = min(near, key=lambda load: abs(math.log(load / max(self.load, 1))))
        decision = self._decided_at[load]
        self._decided_at[load] = decision._replace(taken_back=True)
        was = self._settled_winner
        self._provisional_from = None
        self.speculation_wins = decision.speculation_wins
        self.rates, self.first_rounds = dict(decision.rates), copy.copy(decision.first_rounds)
        self._last_ms = dict(decision.last_ms)
        self.streak = 0
        log.log(self._level_of(was), "pair %s: %s, as decided at %d rounds in flight before", self.name,
                self.winner_name, load)
        if was != self.speculation_wins:
            self.flips += 1
        return True

    def _assume_loss_from_below(self) -> bool:
        """After a rise to a load with no decision of its own to take back: if speculating lost the
        last comparison at the highest lower load decided (taken back since or not), target-only
        holds, as if that loss had been confirmed here once: a winner's epoch (`_length` with one
        confirmation: 8x the lower load's last speculating probe, or longer by its loss there, at
        most 4 x max_stretch), not a provisional short one, before speculating is probed at this
        load. Batching makes each target-only token cheaper as load grows and drafts add rows to
        every forward, so speculation that lost at a load rarely wins at a higher one, while a probe
        at the new load costs a short burst its throughput (loadtest run 51, 2-core Zen 5: 8 streams
        after 4 had been decided target-only, a 10 s probe in a 23 s block, 0.92x).

        The hold is one winner's epoch per load in all, not per visit: what earlier visits held at
        about this load counts towards it, so a load that moves faster than the epoch still gets
        speculation measured there, later. Not where speculating won at about this load itself
        (that decision is newer evidence than a loss below). The lower load's rates only size the
        hold: both modes are measured at this load before the comparison there (which keeps its
        hysteresis, and counts as a second confirmation if it agrees), and its first rounds start
        empty. The lower load keeps its decision."""
        if any(same_load(load, self.load) and decision.speculation_wins for load, decision in self._decided_at.items()):
            return False
        below = [load for load in self._decided_at if load < self.load]
        if not below:
            return False
        load = max(below)
        decision = self._decided_at[load]
        if decision.speculation_wins:
            return False
        here = next((held for held in self._held_at if same_load(held, self.load)), self.load)
        held_ms = self._held_at.get(here, 0.0)
        if held_ms >= self._winner_ms(TARGET_ONLY, decision.rates, decision.last_ms, 1):
            log.info("pair %s: target-only held at about %d rounds in flight for a winner's epoch already "
                     "(speculating lost at %d): measuring here", self.name, self.load, load)
            return False
        was = self._settled_winner
        self._provisional_from = None
        self.speculation_wins = False
        self.rates, self._last_ms = dict(decision.rates), dict(decision.last_ms)
        self.first_rounds = FirstRounds()
        self.streak = 1
        self._next_hold = here
        log.log(self._level_of(was), "pair %s: target-only holds, as speculating lost at %d rounds in flight "
                "(to be measured at %d)", self.name, load, self.load)
        if was:
            self.flips += 1
        return True

    @property
    def _settled_winner(self) -> bool:
        """Whether speculation won the last comparison (a provisional target-only is not one)."""
        return self._provisional_from if self._provisional_from is not None else self.speculation_wins

    def _level_of(self, was: bool) -> int:
        """Speculation switched off on a pair is a degraded mode an operator wants to see."""
        if was and not self.speculation_wins:
            return logging.WARNING
        return logging.INFO

    def abandon(self, ticket: GuardTicket) -> None:
        """The round failed or was cancelled: it measured nothing."""
        left = self._outstanding.get(ticket.epoch, 0) - 1
        if left > 0:
            self._outstanding[ticket.epoch] = left
        else:
            self._outstanding.pop(ticket.epoch, None)

    def observe(self, ticket: GuardTicket, tokens: int, round_ms: float, steady: bool, drafted: bool,
                first: bool = False, target_ms: float = 0.0, catching_up: bool = False,
                turn_tokens: int | None = None, prompt_ms: float | None = None) -> None:
        """The round decided under `ticket` made `tokens` tokens in `round_ms` (drafted: it ran k > 0).
        first: it was its turn's first round, whose target call took `target_ms`; catching_up: its
        draft also prefilled tokens of earlier rounds; turn_tokens: it ended its turn, which made
        that many tokens; prompt_ms: what its prompt would have added to a target-only step
        (`prompt_extra_ms`; None where unknown).

        Towards the steady rates it counts only if it is steady, of the current epoch, and was decided
        after every round of earlier epochs had ended: a target-only round beside another session's
        speculating round still shares the draft's load, and the other way round. A first round run
        speculating counts towards the per-turn prices if it was decided so too and its draft had no
        backlog to catch up on (a session back from a target-only epoch: that is the epoch's cost,
        not a turn's)."""
        self.abandon(ticket)
        if (first and ticket.mode == SPECULATE and ticket.clean and not catching_up
                and ticket.load_era == self._load_era and round_ms > 0 and target_ms > 0):
            self.first_rounds.add(round_ms, target_ms, tokens, prompt_ms)
        if turn_tokens is not None and turn_tokens > 0:
            self._turns = self._turns * TURN_MEMORY + 1.0
            self._turn_tokens = self._turn_tokens * TURN_MEMORY + turn_tokens
        if ticket.epoch != self.epoch or not ticket.clean or not steady or round_ms <= 0:
            if ticket.epoch == self.epoch and round_ms > 0:
                self._uncounted_ms += round_ms
            return
        self._counted += 1
        self._drafting += int(drafted)
        self._tokens += tokens
        self._ms += round_ms
        if self._counted >= self.needed_rounds and self._ms >= self._needed_ms:
            self._end_epoch()
        elif self._probe_clearly_lost():
            log.info("pair %s: speculating probe cut at %d of %d rounds, %.2f tok/s per session against "
                     "target-only's %.2f", self.name, self._counted, self.needed_rounds,
                     self._tokens / self._ms * 1000.0, self.rates[TARGET_ONLY] * 1000.0)
            # The winner's next epoch is sized on the probe it would have been (_length): probes come
            # as often as uncut ones would, and each costs half.
            self._end_epoch(as_ms=self._ms * self.needed_rounds / self._counted, cut=True)

    def _probe_clearly_lost(self) -> bool:
        """A speculating probe (target-only leads, or holds provisionally after a rise in load) that
        has counted half its rounds and whose rate so far trails target-only's by `cut_loss` or more,
        on the comparison the decision will make (`_priced`, as `compared_rates`: per turn once first
        rounds are known): it has lost, and the rest of it would only add to what the probe costs, which is
        the guard's whole cost where target-only wins. It ends there and the comparison runs on what
        it counted. Its outcome confirms target-only (lengthening the next hold) only where an
        earlier comparison at about this load agreed (`_decide`): half a probe at 8 streams is two
        batched steps. One way only: a target-only epoch is never cut, as target-only is the safe
        mode, and a wrong cut here costs speculation's gain, never more than target-only's rate."""
        off, cut = self.rates[TARGET_ONLY], self.settings.cut_loss
        if (cut <= 0.0 or self.mode != SPECULATE or self.speculation_wins or off is None or self._ms <= 0.0
                or 2 * self._counted < self.needed_rounds):
            return False
        spec, off = self._priced(self._tokens / self._ms, off)
        return spec < off * (1.0 - cut)

    @property
    def turn_tokens(self) -> float | None:
        """The pair's mean turn length in tokens, over the turns that ended (None before one did)."""
        return self._turn_tokens / self._turns if self._turns > 0 else None

    def compared_rates(self) -> dict[str, float | None]:
        """What the modes are compared on: tokens per ms over whole turns where about three turns
        have begun speculating at this load (see the module doc), else the steady rates."""
        spec, off = self.rates[SPECULATE], self.rates[TARGET_ONLY]
        if spec is None or off is None:
            return dict(self.rates)
        spec, off = self._priced(spec, off)
        return {SPECULATE: spec, TARGET_ONLY: off}

    def _priced(self, spec: float, off: float) -> tuple[float, float]:
        """Steady rates (speculating, target-only) as compared: per turn where the first rounds
        price turns, else as they are."""
        length = self.turn_tokens
        if length is None or self.first_rounds.turns < MIN_FIRST_ROUNDS:
            return spec, off
        return per_turn_rates(spec, off, length, self.first_rounds) or (spec, off)

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

    @property
    def winner_name(self) -> str:
        return "speculating" if self.speculation_wins else "target-only"

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
        return rounds, self._winner_ms(mode, self.compared_rates(), self._last_ms, self.streak)

    def _winner_ms(self, mode: str, compared: dict[str, float | None], last_ms: dict[str, float],
                   streak: int) -> float:
        """Counted ms of a winner's epoch of `mode` (see _length), from the compared rates, the
        modes' last epochs and the confirmations so far."""
        loser = TARGET_ONLY if mode == SPECULATE else SPECULATE
        factor = 4.0 * min(2 ** streak, self.settings.max_stretch)
        won, lost = compared[mode], compared[loser]
        if won and lost is not None:
            # The further behind the loser, the more its epochs cost: long enough that they cost
            # about MEASUREMENT_COST of the pair's throughput (a loser at 0.6x: 13x its time).
            factor = max(factor, max(0.0, 1.0 - lost / won) / MEASUREMENT_COST)
        return min(factor, 4.0 * self.settings.max_stretch) * last_ms[loser]

    def _end_epoch(self, as_ms: float | None = None, cut: bool = False) -> None:
        """`as_ms`: the counted ms the epoch counts as in the sizing of later ones; `cut`: a probe
        ended early (_probe_clearly_lost)."""
        self.rates[self.mode] = self._tokens / self._ms
        self._last_ms[self.mode] = (self._ms if as_ms is None else as_ms) + self._uncounted_ms
        measured = self.mode != self.winner  # the short epoch of the other mode just ended
        if measured:
            self._decide(cut=cut)
        # After a measurement the winner runs; after the winner's epoch, the other mode measures.
        self._begin_epoch(self.winner if measured else (TARGET_ONLY if self.mode == SPECULATE else SPECULATE))

    def _begin_epoch(self, mode: str) -> None:
        if self._holding is not None:  # an assumed hold ended, run out or cut short: its time counts at its load
            self._held_at[self._holding] = self._held_at.get(self._holding, 0.0) + self._ms
        self._holding, self._next_hold = self._next_hold, None
        self.mode = mode
        self.epoch += 1
        self._needed_rounds, self._needed_ms = self._length(mode)
        if self._holding is not None:  # what earlier visits held there counts towards this one
            self._needed_ms = max(0.0, self._needed_ms - self._held_at.get(self._holding, 0.0))
        self._in_flight_peak = self.in_flight
        self._epoch_load = self.load
        self._epoch_decisions = 0
        self._counted, self._drafting, self._tokens, self._ms = 0, 0, 0.0, 0.0
        self._uncounted_ms = 0.0  # rounds decided in this epoch and not counted in its rate

    def _decide(self, cut: bool = False) -> None:
        """Compare the modes' latest rates. An outcome that agrees with the current winner lengthens
        its next epoch (a confirmation); a cut probe's (`cut`, half a probe) only where an earlier
        comparison at about this load agreed too."""
        compared = self.compared_rates()
        spec, off = compared[SPECULATE], compared[TARGET_ONLY]
        if spec is None or off is None:
            return
        provisional = self._provisional_from is not None
        was = self._settled_winner
        # Hysteresis: the current winner keeps its place unless the other mode beats it by the margin
        # (none against a provisional target-only: no mode has won at this load yet).
        margin = 0.0 if provisional else self.settings.margin
        wins = spec >= off * (1.0 - margin) if self.speculation_wins else spec > off * (1.0 + margin)
        if wins and not self.speculation_wins and 2 * self._drafting < self._counted:
            # The policies themselves ran target-only through most of the probe: its rate is that of
            # k = 0 again, and says nothing for drafting.
            wins = False
        self.decisions += 1
        log.debug("pair %s: decision %d, speculating %.3f tok/s per session, target-only %.3f (steady rounds "
                  "%.3f against %.3f; turns of %s tokens): %s", self.name, self.decisions, spec * 1000.0,
                  off * 1000.0, self.rates[SPECULATE] * 1000.0, self.rates[TARGET_ONLY] * 1000.0,
                  f"{self.turn_tokens:.1f}" if self.turn_tokens is not None else "?",
                  "speculate" if wins else "target-only")
        agreed_before = any(same_load(load, self._epoch_load) and decision.speculation_wins == wins
                            for load, decision in self._decided_at.items())
        # Remembered for this load, in place of what was decided at about the same load before.
        for load in [load for load in self._decided_at if same_load(load, self._epoch_load)]:
            del self._decided_at[load]
        for load in [load for load in self._held_at if same_load(load, self._epoch_load)]:
            del self._held_at[load]  # compared here now: no longer held on a lower load's word
        self._decided_at[self._epoch_load] = Decision(wins, dict(self.rates), copy.copy(self.first_rounds),
                                                      dict(self._last_ms))
        if wins != self.speculation_wins or provisional:
            self.streak = 0
        elif not cut or agreed_before:
            self.streak += 1
        self._provisional_from = None
        self.speculation_wins = wins
        if wins != was:
            self.flips += 1
            log.log(self._level_of(was), "pair %s: %s now (speculating %.2f tok/s per session, target-only %.2f)",
                    self.name, self.winner_name, spec * 1000.0, off * 1000.0)
