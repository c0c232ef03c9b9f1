"""The pair guard (orchestrator/guard.py): driven by synthetic rounds (no gRPC, no clock), then on a\nreal pair over gRPC with co-located workers emulated."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import time
from typing import Any

import pytest

from orchestrator.config import SpeculationConfig, SpeculationConfigError, SpeculationOverride
from orchestrator.guard import (MEASUREMENT_COST, SPECULATE, TARGET_ONLY, TURN_MEMORY, FirstRounds, GuardSettings,
                               PairGuard, per_turn_rates, prompt_extra_ms, without_prompt_rows)
from tests.stack import Stack, start_stack
from tests.test_e2e_generate import reference_greedy

def play(guard: PairGuard, rounds: int, spec_round: tuple[int, float], off_round: tuple[int, float],
         proposed_k: int = 4, zero_in_spec_epoch: tuple[int, float] | None = None) -> list[int]:
    """One round after another; a round at k > 0 makes spec_round = (tokens, ms), one at k = 0
    off_round (or zero_in_spec_epoch, when given, in a speculating epoch). Returns the k each round ran."""
    ks = []
    for _ in range(rounds):
        ticket = guard.decide()
        k = 0 if ticket.mode == TARGET_ONLY else proposed_k
        tokens, ms = spec_round if k > 0 else off_round
        if k == 0 and ticket.mode == SPECULATE and zero_in_spec_epoch is not None:
            tokens, ms = zero_in_spec_epoch
        guard.observe(ticket, tokens, ms, steady=True, drafted=k > 0)
        ks.append(k)
    return ks


def test_where_speculation_wins_the_pair_keeps_it_and_measures_target_only_ever_more_rarely() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    ks = play(guard, 6000, spec_round=(3, 100.0), off_round=(1, 50.0))  # 30 against 20 tokens per second
    assert guard.speculation_wins and guard.flips == 0 and guard.decisions >= 4
    assert guard.rates[SPECULATE] == pytest.approx(0.03) and guard.rates[TARGET_ONLY] == pytest.approx(0.02)
    # 32 speculating rounds, 8 target-only, then speculating epochs of at least 4x (and at least
    # loss 1/3 / MEASUREMENT_COST = 11x) the time of the last target-only one (400 ms), the 4x doubled
    # per confirmation up to 64x: 45, 45, 64, 128, then 256 rounds for ever.
    assert ks[:48] == [4] * 32 + [0] * 8 + [4] * 8
    off = ks.count(0)
    assert 0 < off < 0.05 * len(ks), off
    late = ks[3000:]
    assert late.count(0) <= 8 * (len(late) // 256 + 1)


def test_where_target_only_wins_the_pair_stops_speculating_after_one_measurement() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    # Speculating, 3 tokens in 200 ms: 15 tokens/s against 20 target-only.
    ks = play(guard, 3000, spec_round=(3, 200.0), off_round=(1, 50.0))
    assert not guard.speculation_wins and guard.flips == 1
    # The first speculating epoch and one measurement decide it. Then target-only holds for the time
    # of the last speculating epoch (6400 ms) x max(4, loss 25 % / MEASUREMENT_COST) = 53.3 s, 1067
    # rounds; then a probe of 32 rounds.
    hold = math.ceil(6400.0 * 0.25 / MEASUREMENT_COST / 50.0)
    assert hold == 1067
    assert ks[:32] == [4] * 32 and ks[32:32 + 8 + hold] == [0] * (8 + hold)
    assert ks[40 + hold:72 + hold] == [4] * 32
    spec_ms = 200.0 * ks[32:].count(4)
    off_ms = 50.0 * ks[32:].count(0)
    # The losing mode's share of the pair's time, about MEASUREMENT_COST / loss at most, falling.
    assert 0 < spec_ms / (spec_ms + off_ms) < MEASUREMENT_COST / 0.25, (spec_ms, off_ms)


def test_a_probes_uncounted_rounds_count_in_what_it_cost() -> None:
    """The winner's hold is sized on the loser's last epoch. A speculating probe's catch-up rounds
    (each session's draft prefilling its backlog after target-only epochs) are not in its rate, but
    they are its cost: sized on its counted rounds alone, probes came as often with a backlog to
    catch up on as without one."""
    def hold_after_probe(catch_up_ms: float) -> float:
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
        play(guard, 40, spec_round=(3, 200.0), off_round=(1, 50.0))  # 32 speculating, 8 target-only
        assert not guard.speculation_wins and guard.mode == TARGET_ONLY
        needed = guard._needed_ms
        while guard.mode == TARGET_ONLY:  # the hold, up to the next probe
            play(guard, 1, spec_round=(3, 200.0), off_round=(1, 50.0))
        guard.observe(guard.decide(), 2, catch_up_ms, steady=False, drafted=True, catching_up=True)
        late = guard.decide()
        guard.abandon(late)  # a round abandoned measures nothing
        play(guard, 32, spec_round=(3, 200.0), off_round=(1, 50.0))
        assert guard.mode == TARGET_ONLY and guard._last_ms[SPECULATE] == pytest.approx(6400.0 + catch_up_ms)
        return guard._needed_ms / needed
    # Both holds are the loss's factor (25 % / MEASUREMENT_COST, above 4x and 8x) times the probe.
    assert hold_after_probe(0.0) == pytest.approx(1.0)
    assert hold_after_probe(3200.0) == pytest.approx(1.5)


def speculating_runs(ks: list[int]) -> list[int]:
    """The lengths of the runs of consecutive rounds at k > 0."""
    return [len(list(group)) for speculating, group in itertools.groupby(ks, key=bool) if speculating]


def test_a_speculating_probe_that_clearly_loses_ends_at_half_its_rounds() -> None:
    """A probe of speculation while target-only leads ends once it has counted half its rounds and
    trails by guard cut_loss (25 %) or more; the comparison runs on what it counted, and does not
    confirm target-only (no longer next hold on half a probe)."""
    def probes(spec_ms: float, cut_loss: float) -> tuple[list[int], PairGuard]:
        # max_stretch 1: target-only holds 4x the last probe, so that many probes come in the rounds played
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8, max_stretch=1, cut_loss=cut_loss))
        ks = play(guard, 6000, spec_round=(3, spec_ms), off_round=(1, 50.0))
        assert not guard.speculation_wins and guard.flips == 1  # every probe confirmed the loss
        runs = speculating_runs(ks)
        return (runs if ks[-1] == 0 else runs[:-1]), guard  # not a probe that the end of play cut
    # 7.5 tok/s against 20: the first epoch is speculation's own as the pair's winner, never cut (32);
    # every probe after it is, at 16 of its 32 rounds.
    (lost, cut), (uncut_runs, uncut) = probes(400.0, 0.25), probes(400.0, 0.0)  # cut_loss 0: off
    assert lost[0] == 32 and len(lost) > 3 and set(lost[1:]) == {16}, lost
    assert uncut_runs[0] == 32 and set(uncut_runs[1:]) == {32}
    # Target-only holds as long after a cut probe as after an uncut one (sized on the probe it would
    # have been): probes come as often and cost half.
    assert len(lost) == len(uncut_runs), (lost, uncut_runs)
    # Each probe's outcome confirmed target-only, after the first decision (which switched the pair
    # off), cut or not: each agreed with the comparison before it at this load.
    assert cut.decisions == uncut.decisions and cut.streak == uncut.streak == cut.decisions - 1
    # 15.4 and 15.8 against 20 tok/s are 23 % and 21 % behind: full probes; 14.0 (30 %) is cut.
    assert set(probes(195.0, 0.25)[0][1:]) == {32}
    assert set(probes(190.0, 0.25)[0][1:]) == {32}
    assert set(probes(215.0, 0.25)[0][1:]) == {16}


def test_under_a_sustained_loss_cut_probes_come_ever_more_rarely() -> None:
    """Cut probes confirm target-only where the comparison before them at this load agreed, so the
    holds between them grow as uncut probes' do (default max_stretch)."""
    def holds(cut_loss: float) -> list[int]:
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8, cut_loss=cut_loss))
        ks = play(guard, 60000, spec_round=(3, 400.0), off_round=(1, 50.0))
        assert guard.streak >= 3
        return [len(list(group)) for speculating, group in itertools.groupby(ks, key=bool) if not speculating][:-1]
    cut, uncut = holds(0.25), holds(0.0)
    # 20.8x the probe (loss 62.5 % / MEASUREMENT_COST) until 4 x 2^streak passes it, then up to 64x.
    assert len(cut) >= 5 and cut[4] > 2 * cut[1], cut
    assert cut[:len(uncut)] == uncut[:len(cut)]  # as long as after uncut probes (sized on the full probe)


def test_a_cut_probe_alone_does_not_lengthen_a_hold_taken_on_a_loss_below() -> None:
    """After a rise above a load where speculating lost, target-only holds as if confirmed once
    (streak 1). The first probe at the new load, cut, is the only comparison there: it does not
    confirm; a full probe would."""
    def after_rise(cut_loss: float) -> int:
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8, cut_loss=cut_loss))
        play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
        play_batched(guard, 40, 4, spec_round=(3, 400.0), off_round=(1, 60.0))  # speculation lost at 4
        play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
        decisions = guard.decisions
        play_batched(guard, 600, 8, spec_round=(3, 500.0), off_round=(1, 55.0))  # held, then probed at 8
        assert guard.decisions == decisions + 1 and not guard.speculation_wins
        return guard.streak
    assert after_rise(0.25) == 1 and after_rise(0.0) == 2


def test_the_cut_reads_the_per_turn_comparison_once_first_rounds_price_turns() -> None:
    """Where turns are priced (first rounds known), the cut reads the rates the decision will. Steady
    speculating rounds 37.5 % behind (3 tokens in 240 ms against 1 in 50), turns of 8 tokens:
    - first rounds of 4 tokens in 400 ms (target call 300): 9.7 % behind per turn. Target-only wins
      every decision, and its probes run in full;
    - first rounds of 1 token in 900 ms: 55 % behind per turn, and the probes are cut at half."""
    def probe_lengths(first: tuple[int, float, float]) -> list[int]:
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8, max_stretch=1))
        ks = play_turns(guard, 1500, 8, spec_round=(3, 240.0), off_round=(1, 50.0), spec_first=first,
                        off_first_ms=300.0)
        assert not guard.speculation_wins and guard.first_rounds.turns >= 2.5
        return speculating_runs(ks)[1:-1]  # not the pair's first epoch (speculation's own), nor one play cut
    level = probe_lengths((4, 400.0, 300.0))
    assert level and set(level) == {32}, level
    costly = probe_lengths((1, 900.0, 300.0))
    assert costly and set(costly) == {16}, costly


def test_a_target_only_epoch_is_never_cut_short_however_far_behind() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    ks = play(guard, 400, spec_round=(3, 50.0), off_round=(1, 500.0))  # target-only at a tenth of speculating
    assert ks[:48] == [4] * 32 + [0] * 8 + [4] * 8 and guard.speculation_wins


def play_turns(guard: PairGuard, turns: int, turn_tokens: int, spec_round: tuple[int, float],
               off_round: tuple[int, float], spec_first: tuple[int, float, float], off_first_ms: float) -> list[int]:
    """One session, turn after turn of `turn_tokens` tokens. A turn's first round makes, speculating,
    spec_first = (tokens, round ms, its target call's ms), target-only one token in off_first_ms;
    then steady rounds as in play(). Returns the k of each steady round."""
    ks = []
    for _ in range(turns):
        ticket = guard.decide()
        if ticket.mode == SPECULATE:
            made, ms, target_ms = spec_first
        else:
            made, ms, target_ms = 1, off_first_ms, off_first_ms
        guard.observe(ticket, made, ms, steady=False, drafted=ticket.mode == SPECULATE, first=True,
                      target_ms=target_ms)
        while made < turn_tokens:
            ticket = guard.decide()
            k = 0 if ticket.mode == TARGET_ONLY else 4
            tokens, ms = spec_round if k > 0 else off_round
            made += tokens
            guard.observe(ticket, tokens, ms, steady=True, drafted=k > 0,
                          turn_tokens=made if made >= turn_tokens else None)
            ks.append(k)
    return ks


def test_prompt_extra_ms_is_what_a_prompt_adds_to_a_target_only_step() -> None:
    def curve(rows: float) -> float:
        return 100.0 + 10.0 * rows
    # 3 sessions in the forward: 2 others' decode rows, plus 48 prompt rows instead of one.
    assert prompt_extra_ms(48, 3.0, curve) == pytest.approx(curve(50) - curve(3))
    assert prompt_extra_ms(48, 1.0, curve) == pytest.approx(curve(48) - curve(1))  # alone
    assert prompt_extra_ms(1, 4.0, curve) == 0.0 and prompt_extra_ms(0, 4.0, curve) == 0.0  # no prompt to price
    assert prompt_extra_ms(48, 3.0, lambda rows: None) is None  # a curve that cannot tell


def test_per_turn_rates_price_target_onlys_first_round_on_its_steady_rate_and_the_prompts_extra() -> None:
    # Loadtest run 62 (2-core Zen 5, 4 streams, first rounds of turns arriving apart): speculating
    # 2.6 s for 2.75 tokens; the round's own target call took 2.2 s beside the others' drafting, where
    # target-only's first rounds took 0.6-0.9 s. Steady: speculating 5.0, target-only 4.4 tok/s per session.
    paired, modelled = FirstRounds(), FirstRounds()
    paired.add(2600.0, 2200.0, 2.75)
    modelled.add(2600.0, 2200.0, 2.75, prompt_ms=450.0)  # T(2.5 + 48) - T(3.5) on the target's curve
    spec_rate, off_rate = 0.0050, 0.0044
    spec, off = per_turn_rates(spec_rate, off_rate, 32.0, paired)
    assert spec > off  # priced against its target call, speculating's turns looked the faster (wrongly)
    spec, off = per_turn_rates(spec_rate, off_rate, 32.0, modelled)
    assert spec * 1000 == pytest.approx(32 / (2600 + 29.25 / spec_rate) * 1000)
    assert off * 1000 == pytest.approx(32 / (450 + 32 / off_rate) * 1000)  # the prompt's extra, then 32 steady rounds
    assert off > spec
    # Rounds priced either way mix, each with its own price, decayed alike.
    modelled.add(1000.0, 700.0, 3)
    assert modelled.target_only_ms(off_rate) == pytest.approx(
        ((450 + 1 / off_rate) * TURN_MEMORY + 700) / (1 + TURN_MEMORY))
    # Never above the speculating rounds themselves, which held a target call over the same prompt.
    quick = FirstRounds()
    quick.add(300.0, 250.0, 4, prompt_ms=200.0)  # 200 + 227 ms > the whole 300 ms round
    assert quick.target_only_ms(off_rate) == pytest.approx(300.0)
    with pytest.raises(ValueError):
        FirstRounds().target_only_ms(off_rate)


def test_per_turn_rates_price_a_turns_first_round_against_its_target_call_where_no_curve_can_tell() -> None:
    # Loadtest run 27, 4 streams: a first round speculating 1793 ms for 2.9 tokens, target-only's
    # 1028 ms (here: its target call), steady 5.68 against 5.43 tok/s per session, 32-token turns.
    first = FirstRounds()
    first.add(1793.0, 1028.0, 2.9)
    spec, off = per_turn_rates(0.00568, 0.00543, 32.0, first)
    assert spec * 1000 == pytest.approx(4.627, abs=0.001)  # 32 / (1793 + 29.1 / 0.00568) ms
    assert off * 1000 == pytest.approx(4.750, abs=0.001)   # 32 / (1028 + 31 / 0.00543) ms
    # Nothing to tell from: no first round, no steady rate, no turn.
    assert per_turn_rates(0.00568, 0.00543, 32.0, FirstRounds()) is None
    assert per_turn_rates(0.0, 0.00543, 32.0, first) is None and per_turn_rates(0.00568, 0.00543, 0.0, first) is None
    # The sums decay per turn: the last ~10 turns weigh.
    first.add(1000.0, 1000.0, 1)
    assert first.turns == pytest.approx(1 + TURN_MEMORY)
    assert first.round_ms / first.turns == pytest.approx((1793 * TURN_MEMORY + 1000) / (1 + TURN_MEMORY))
    # A target call is never priced above the round that contained it.
    first.add(100.0, 150.0, 1)
    assert first.target_ms == pytest.approx((1028 * TURN_MEMORY + 1000) * TURN_MEMORY + 100)


def test_speculation_that_wins_steady_rounds_but_loses_whole_turns_is_switched_off(
        caplog: pytest.LogCaptureFixture) -> None:
    steady_only = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play(steady_only, 600, spec_round=(3, 100.0), off_round=(1, 40.0))  # 20 % ahead in steady rounds
    assert steady_only.speculation_wins
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    with caplog.at_level(logging.INFO, logger="orchestrator.guard"):
        ks = play_turns(guard, 40, 32, spec_round=(3, 100.0), off_round=(1, 40.0), spec_first=(3, 2000.0, 800.0),
                        off_first_ms=800.0)
    assert guard.turn_tokens == pytest.approx(32.5, abs=0.5)  # 33 speculating (3 + 10 x 3), 32 target-only
    assert not guard.speculation_wins and guard.flips == 1
    assert any(r.levelno == logging.WARNING and "target-only now" in r.message for r in caplog.records)
    compared = guard.compared_rates()
    assert compared[SPECULATE] < compared[TARGET_ONLY] and guard.rates[SPECULATE] > guard.rates[TARGET_ONLY]
    assert ks[-200:].count(0) > 150


def test_the_winners_epoch_is_sized_on_the_per_turn_comparison() -> None:
    """Target-only's lead per turn, not the steady rates' (by which target-only is behind, and its
    epoch would be the minimum 4x the last speculating epoch)."""
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    for _ in range(40):  # turn by turn, up to the switch
        play_turns(guard, 1, 32, spec_round=(3, 100.0), off_round=(1, 40.0), spec_first=(3, 2000.0, 800.0),
                   off_first_ms=800.0)
        if guard.flips:
            break
    assert guard.flips == 1 and guard.mode == TARGET_ONLY and guard.streak == 0
    compared = guard.compared_rates()
    loss = 1.0 - compared[SPECULATE] / compared[TARGET_ONLY]
    assert loss / MEASUREMENT_COST > 4.0 and guard.rates[SPECULATE] > guard.rates[TARGET_ONLY]
    # (The turn went on after the decision, which moved the mean turn length a little since.)
    assert guard._needed_ms == pytest.approx(loss / MEASUREMENT_COST * guard._last_ms[SPECULATE], rel=0.02)
    assert guard._needed_ms > 8.0 * guard._last_ms[SPECULATE]


def test_first_rounds_that_cost_what_target_onlys_do_leave_the_steady_comparison_to_decide() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_turns(guard, 40, 32, spec_round=(3, 100.0), off_round=(1, 40.0), spec_first=(3, 850.0, 800.0),
               off_first_ms=800.0)
    assert guard.speculation_wins and guard.flips == 0 and guard.decisions >= 2
    # Over whole turns the margin is smaller than in steady rounds, and still speculation's.
    compared = guard.compared_rates()
    assert 1.0 < compared[SPECULATE] / compared[TARGET_ONLY] < guard.rates[SPECULATE] / guard.rates[TARGET_ONLY]


def test_only_clean_first_rounds_without_a_draft_backlog_price_turns_and_three_are_needed() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=1, off_rounds=1, rounds_per_session=0))
    guard.observe(guard.decide(), 3, 100.0, steady=True, drafted=True)  # the first epoch: speculating
    old = guard.decide()  # a target-only round, left running
    off_first = guard.decide()
    assert off_first.mode == TARGET_ONLY
    # A turn that began target-only prices nothing: its first round is no speculating one.
    guard.observe(off_first, 1, 900.0, steady=False, drafted=False, first=True, target_ms=900.0)
    guard.observe(guard.decide(), 1, 40.0, steady=False, drafted=False)  # a prompt round: not counted
    guard.observe(guard.decide(), 1, 40.0, steady=True, drafted=False, turn_tokens=32)  # target-only
    assert guard.speculation_wins and guard.mode == SPECULATE and guard.turn_tokens == 32
    # Decided while `old`, a round of an earlier epoch, still runs: it shares that epoch's load.
    unclean = guard.decide()
    assert unclean.mode == SPECULATE and not unclean.clean
    guard.observe(unclean, 3, 5000.0, steady=False, drafted=True, first=True, target_ms=800.0)
    guard.abandon(old)
    # A session back from a target-only epoch: its draft caught up on the backlog. Not a turn's cost.
    guard.observe(guard.decide(), 3, 5000.0, steady=False, drafted=True, first=True, target_ms=800.0,
                  catching_up=True)
    # No target call time (a worker that did not say): cannot be paired.
    guard.observe(guard.decide(), 3, 5000.0, steady=False, drafted=True, first=True, target_ms=0.0)
    assert guard.first_rounds.turns == 0 and guard.compared_rates() == guard.rates
    for expected in (1.0, 1.0 + TURN_MEMORY):  # one or two first rounds: not yet
        ticket = guard.decide()
        assert ticket.mode == SPECULATE and ticket.clean
        guard.observe(ticket, 3, 2000.0, steady=False, drafted=True, first=True, target_ms=800.0)
        assert guard.first_rounds.turns == pytest.approx(expected) and guard.compared_rates() == guard.rates
    guard.observe(guard.decide(), 3, 2000.0, steady=False, drafted=True, first=True, target_ms=800.0)
    compared = guard.compared_rates()  # the third does: 32 / (2000 + 29 / 0.03) against 32 / (800 + 31 / 0.025)
    assert compared[SPECULATE] == pytest.approx(32 / (2000 + 29 / 0.03))
    assert compared[TARGET_ONLY] == pytest.approx(32 / (800 + 31 / 0.025))


def test_a_shift_in_load_forgets_the_first_rounds_measured_at_the_old_load() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_turns(guard, 3, 32, spec_round=(3, 100.0), off_round=(1, 40.0), spec_first=(3, 2000.0, 800.0),
               off_first_ms=800.0)
    assert guard.first_rounds.turns > 0 and guard.turn_tokens == pytest.approx(33.0)  # 3 + 10 rounds of 3
    play_batched(guard, 2, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert guard.load_restarts == 1 and guard.first_rounds.turns == 0
    assert guard.turn_tokens == pytest.approx(33.0)  # the turns' length is not a matter of load: kept


def _line_curve(rows: float) -> float:
    return 8.0 + rows  # T(8) = 16, T(24) = 32: a forward's cost grows with its rows (a CPU)


def test_a_round_is_priced_without_the_prompt_rows_that_shared_its_forward() -> None:
    # 24 rows, 16 of them prompts: the forward would have cost half as much; 5 ms of the round were not the forward.
    assert without_prompt_rows(105.0, 100.0, 24.0, 16.0, _line_curve) == pytest.approx(55.0)
    assert without_prompt_rows(105.0, 100.0, 8.0, 0.0, _line_curve) == 105.0   # no prompt beside it
    assert without_prompt_rows(105.0, 100.0, 16.0, 16.0, _line_curve) == 105.0  # its own prompt: not steady anyway
    assert without_prompt_rows(105.0, 100.0, 24.0, 16.0, lambda rows: None) == 105.0  # no curve yet
    flat = without_prompt_rows(105.0, 100.0, 24.0, 16.0, lambda rows: 50.0)
    assert flat == 105.0  # a GPU's flat curve: the prompt rows cost nothing, nothing to take out


def test_a_target_only_probe_that_caught_a_wave_of_prompts_is_priced_without_them() -> None:
    """Seen on a 2-core CPU at 8 closed-loop streams: the target-only probe ran while every stream's
    next request arrived, its forwards carried their prompt chunks, it measured 0.79 tok/s per session
    against 1.2 steady, and speculation (0.95) stayed on. Speculating here makes 2 tokens per 130 ms,
    target-only 1 per 50 ms steady; during the probe each forward also ran 16 prompt rows (105 ms)."""
    def run(adjusted: bool) -> PairGuard:
        guard = PairGuard(GuardSettings(spec_rounds=16, off_rounds=8, rounds_per_session=0))
        for _ in range(200):
            ticket = guard.decide()
            if ticket.mode == SPECULATE:
                guard.observe(ticket, 2, 130.0, steady=True, drafted=True)
                continue
            round_ms = without_prompt_rows(105.0, 100.0, 24.0, 16.0, _line_curve) if adjusted else 105.0
            guard.observe(ticket, 1, round_ms, steady=True, drafted=False)
        return guard
    assert not run(adjusted=True).speculation_wins  # 1 per 55 ms beats 2 per 130 ms
    assert run(adjusted=False).speculation_wins     # the wave's 1 per 105 ms would not have


def test_a_guarded_round_hands_the_guard_its_time_without_the_prompt_rows() -> None:
    """The wiring: Round.run_guarded takes the record's target_prompt_rows out on the pair's rows
    curve before the guard sees the round (a 105 ms round whose 100 ms verify ran 24 rows, 16 of
    them prompts, on a curve where 8 rows cost half of 24: 55 ms)."""
    from orchestrator.kpolicy import TargetLoad
    from orchestrator.record import RoundRecord
    from orchestrator.rounds import Round
    from orchestrator.sessions import OrchestratorSession

    record = RoundRecord(
        session_id="s", index=3, position=40, policy="cost", k=0, drafts=(), draft_probs=(), draft_confidences=(),
        accepted=0, emitted=(7,), text_delta="x", finish=None, fallback=False, greedy=True, draft_ms=0.0,
        draft_token_ms=0.0, verify_ms=100.0, verify_wall_ms=101.0, round_ms=105.0, draft_prefilled=0,
        target_prefilled=1, target_cached=39, reprefills=0, target_batch=3.0, target_rows=24.0,
        target_prompt_rows=16.0)
    session = OrchestratorSession("s", ephemeral=True)
    session.stats.timing.load = TargetLoad(target_curve=((1, 9.0), (64, 72.0)))  # 8 + rows: T(8) = 16, T(24) = 32
    round_ = object.__new__(Round)  # only what run_guarded touches
    round_.session = session
    round_.turn_tokens = 0

    async def run(k: int) -> RoundRecord:
        return record
    round_.run = run
    seen = []

    class Spy(PairGuard):
        def observe(self, ticket, tokens, round_ms, steady, drafted, first=False, target_ms=0.0,
                    catching_up=False, turn_tokens=None, prompt_ms=None):
            seen.append((tokens, round_ms, steady, drafted, first, catching_up, turn_tokens, prompt_ms))
            super().observe(ticket, tokens, round_ms, steady, drafted, first, target_ms, catching_up, turn_tokens,
                            prompt_ms)
    guard = Spy(GuardSettings(spec_rounds=1, off_rounds=1))
    out = asyncio.run(round_.run_guarded(0, guard, guard.decide()))
    assert seen == [(1, pytest.approx(55.0), True, False, False, False, None, None)]
    assert out.round_ms == 105.0 and out.guard == SPECULATE  # the record itself keeps the measured time
    # A turn's first round goes to the guard whole, with what its 40-token prompt would add to a
    # target-only step beside the forward's 2 other sessions: T(2 + 40) - T(2 + 1) = 50 - 11 ms.
    record = dataclasses.replace(record, index=1, k=3, drafts=(1, 2, 3), target_prefilled=40, draft_prefilled=40,
                                 round_ms=900.0, verify_ms=500.0, verify_wall_ms=520.0, emitted=(1, 2, 5))
    asyncio.run(round_.run_guarded(3, guard, guard.decide()))
    assert seen[-1] == (3, 900.0, False, True, True, False, None, pytest.approx(39.0))
    first = guard.first_rounds
    assert (first.turns, first.round_ms, first.tokens, first.modelled, first.target_ms) == (1.0, 900.0, 3.0, 1.0, 0.0)
    assert first.prompt_ms == pytest.approx(39.0)
    # A draft that also prefilled a backlog is catching up; the round that ends the turn says how long it was.
    record = dataclasses.replace(record, draft_prefilled=60, finish="length")
    asyncio.run(round_.run_guarded(3, guard, guard.decide()))
    assert seen[-1] == (3, 900.0, False, True, True, True, 1 + 3 + 3, pytest.approx(39.0))
    # With no rows curve to price the prompt on, the round's target call's wall time stands in.
    session.stats.timing.load = TargetLoad()
    record = dataclasses.replace(record, draft_prefilled=40, finish=None)
    asyncio.run(round_.run_guarded(3, guard, guard.decide()))
    assert seen[-1][-1] is None
    assert first.target_ms == pytest.approx(520.0) and first.modelled == pytest.approx(TURN_MEMORY)


def test_the_guard_follows_a_change_of_winner_both_ways(caplog: pytest.LogCaptureFixture) -> None:
    guard = PairGuard(GuardSettings(spec_rounds=16, off_rounds=4))
    caplog.set_level(logging.INFO, logger="orchestrator.guard")
    play(guard, 400, spec_round=(3, 200.0), off_round=(1, 50.0))
    assert not guard.speculation_wins
    play(guard, 4000, spec_round=(3, 60.0), off_round=(1, 50.0))  # the load went away: speculation wins
    assert guard.speculation_wins and guard.flips == 2
    assert "target-only now" in caplog.text and "speculating now" in caplog.text


def test_epochs_count_rounds_per_session_in_flight_so_a_probe_is_not_one_batched_step() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    modes = []
    for _ in range(12):  # 8 sessions, their rounds decided together and ending together (one batch)
        tickets = [guard.decide() for _ in range(8)]
        assert guard.in_flight == 8
        for ticket in tickets:
            spec = ticket.mode == SPECULATE
            guard.observe(ticket, 3 if spec else 1, 100.0 if spec else 50.0, steady=True, drafted=spec)
        modes.append({t.mode for t in tickets})
    # 32 speculating rounds (4 batches), then a target-only probe of 4 rounds per session in flight
    # (32, not the base 8: one batch would be a single sample), then speculation again (30 against 20 tok/s).
    assert modes[:8] == [{SPECULATE}] * 4 + [{TARGET_ONLY}] * 4
    assert guard.speculation_wins and guard.decisions == 1 and guard.in_flight == 0


def play_batched(guard: PairGuard, batches: int, width: int, spec_round: tuple[int, float],
                 off_round: tuple[int, float]) -> list[str]:
    """`width` sessions whose rounds are decided together and end together; the mode of each batch."""
    modes = []
    for _ in range(batches):
        tickets = [guard.decide() for _ in range(width)]
        for ticket in tickets:
            spec = ticket.mode == SPECULATE
            tokens, ms = spec_round if spec else off_round
            guard.observe(ticket, tokens, ms, steady=True, drafted=spec)
        modes.append(tickets[-1].mode)
    return modes


def test_a_shift_in_load_starts_a_new_comparison_instead_of_holding_the_old_decision() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    # One session: speculating wins (30 against 20 tok/s) and the winner's epochs grow long.
    play_batched(guard, 2000, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins and guard.streak >= 3 and guard.load_restarts == 0
    # Eight sessions at once: drafting now costs everyone (7.5 against 16.7 tok/s). The long epoch
    # is cut short at the batch's third decision: both modes are measured again at this load,
    # target-only first after a rise (4 batches: 32 rounds, 4 per session in flight), then
    # speculating, whose probe is cut at half (2 batches: 55 % behind), and target-only stays, not the
    # old decision for the rest of its epoch.
    modes = play_batched(guard, 12, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert guard.load_restarts == 1 and not guard.speculation_wins and guard.decisions >= 1
    assert guard.flips == 1  # from speculating; the provisional target-only after the rise was no decision
    # The restart's first batch is not clean (two of its rounds speculate, decided before the restart).
    assert modes == [TARGET_ONLY] * 5 + [SPECULATE] * 2 + [TARGET_ONLY] * 5
    # Back to one session: after LOAD_WINDOW decisions at the lower load, the decision taken at one
    # session before comes back (no decision, no flip), and the next measurement confirms it.
    decisions = guard.decisions
    modes = play_batched(guard, 200, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.load_restarts == 2 and guard.speculation_wins and guard.flips == 2
    assert guard.decisions > decisions and modes[-100:].count(SPECULATE) > 90
    # A steady load never restarts, nor does one that moves between 1 and 2 sessions (a change by
    # one round in flight is noise at low load, not a shift).
    play_batched(guard, 3000, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    for _ in range(20):
        play_batched(guard, 40, 2, spec_round=(3, 100.0), off_round=(1, 50.0))
        play_batched(guard, 40, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.load_restarts == 2


def test_a_shift_in_load_during_the_pairs_first_epoch_restarts_it_too() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 28, 1, spec_round=(3, 100.0), off_round=(1, 50.0))  # 28 of the first epoch's 32 rounds
    assert guard.epoch == 0 and guard.load_restarts == 0
    modes = play_batched(guard, 12, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    # Not decided on 28 rounds at one session and 4 at eight: measured again at eight (target-only
    # first, after a rise), and target-only stays.
    assert guard.load_restarts == 1 and not guard.speculation_wins and guard.decisions == 1, modes
    assert modes[1:5] == [TARGET_ONLY] * 4 and SPECULATE in modes[5:], modes


def test_after_a_rise_in_load_target_only_measures_first_and_speculation_that_still_wins_returns() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 2000, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins and guard.load_restarts == 0
    # Eight sessions, and drafting still pays (3 tokens in 150 ms against 1 in 60).
    modes = play_batched(guard, 40, 8, spec_round=(3, 150.0), off_round=(1, 60.0))
    assert guard.load_restarts == 1 and guard.speculation_wins and guard.flips == 0  # never switched off
    # Target-only 4 batches (32 rounds) after the unclean first, speculating 4 to measure, then its epoch.
    assert modes[:18] == [TARGET_ONLY] * 5 + [SPECULATE] * 13 and modes.count(SPECULATE) > 0.6 * len(modes)


def test_turns_count_in_the_load_from_their_arrival_so_a_burst_decides_at_its_own_load() -> None:
    """Four turns arriving together on a pair that speculates at two sessions: counted from their
    arrival, the first of them to decide already sees four rounds in flight (a rise), and every
    first round of the burst runs target-only. Counted only once decided, the first three saw the
    old load and speculated over their prompts (loadtest runs 63-65)."""
    def burst(counted_on_arrival: bool) -> list[str]:
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
        play_batched(guard, 400, 2, spec_round=(3, 100.0), off_round=(1, 50.0))
        assert guard.speculation_wins and guard.mode == SPECULATE and guard.load == 2
        if counted_on_arrival:
            for _ in range(4):
                guard.arrive()
        tickets = []
        for _ in range(4):
            if counted_on_arrival:
                guard.depart()  # (just before the turn's first decide)
            tickets.append(guard.decide())
        assert guard.in_flight == 4 and guard._arriving == 0
        return [ticket.mode for ticket in tickets]

    assert burst(counted_on_arrival=True) == [TARGET_ONLY] * 4
    assert burst(counted_on_arrival=False) == [SPECULATE] * 3 + [TARGET_ONLY]
    guard = PairGuard()
    guard.depart()  # a depart without an arrival never counts below zero
    assert guard._arriving == 0


def test_a_turn_waits_for_arrivals_only_while_the_pair_speculates_and_a_share_of_its_prompts_forward() -> None:
    guard = PairGuard(GuardSettings(arrival_window_ms=20.0))
    assert guard.mode == SPECULATE
    assert guard.arrival_wait_ms(500.0) == pytest.approx(10.0)   # 2 % of the prompt's forward
    assert guard.arrival_wait_ms(5000.0) == 20.0                 # at most the window
    assert guard.arrival_wait_ms(None) == 0.0                    # no curve: no wait
    assert PairGuard(GuardSettings(arrival_window_ms=0.0)).arrival_wait_ms(500.0) == 0.0  # off
    play(guard, 200, spec_round=(1, 300.0), off_round=(1, 50.0))  # speculating loses: target-only
    assert guard.mode == TARGET_ONLY and guard.arrival_wait_ms(500.0) == 0.0
    for bad in (-1.0, 1001.0, float("nan"), True):
        with pytest.raises(ValueError):
            GuardSettings(arrival_window_ms=bad).validate()


def test_a_load_that_comes_back_gets_the_decision_taken_at_it_instead_of_a_new_exploration() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    first_visit = play_batched(guard, 40, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert not guard.speculation_wins and SPECULATE in first_visit[5:9]  # explored: target-only, then a probe
    play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins and guard.load_restarts == 2
    # Eight again: target-only at once (the ramp reaches 6 in flight, near enough to 8), and for a
    # winner's epoch: the last speculating probe's 32 x 400 ms x (loss 55 % / MEASUREMENT_COST),
    # some 490 batches of 8 x 60 ms. No speculating probe.
    restarts, decisions = guard.load_restarts, guard.decisions
    second_visit = play_batched(guard, 100, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert guard.load_restarts == restarts + 1 and not guard.speculation_wins
    assert second_visit[1:] == [TARGET_ONLY] * 99 and guard.decisions == decisions


def test_a_rise_above_a_load_where_speculation_lost_holds_target_only_before_probing_it(
        caplog: pytest.LogCaptureFixture) -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 40, 4, spec_round=(3, 400.0), off_round=(1, 60.0))  # explored at 4: target-only won
    assert not guard.speculation_wins and [d.speculation_wins for d in guard._decided_at.values()] == [True, False]
    play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins
    # Eight sessions, a load never decided: without the loss at 4 it would be a provisional
    # target-only epoch of 4 batches and a speculating probe of 4. With it, target-only holds for a
    # winner's epoch as if confirmed once: the probe at 4's 32 x 400 ms x max(8, loss 55 % /
    # MEASUREMENT_COST), some 530 batches of 8 x 55 ms. (The batch ramps: at 3 in flight the
    # decision taken at 4 comes back; at 6 it holds.) At 8 both modes cost differently than at 4.
    at_eight = {"spec_round": (3, 500.0), "off_round": (1, 55.0)}
    restarts, decisions, flips = guard.load_restarts, guard.decisions, guard.flips
    with caplog.at_level(logging.INFO, logger="orchestrator.guard"):
        first_visit = play_batched(guard, 300, 8, **at_eight)
    assert first_visit == [TARGET_ONLY] * 300 and guard.decisions == decisions and guard.flips == flips + 1
    assert guard.load_restarts == restarts + 2 and guard.streak == 1 and guard.first_rounds.turns == 0
    assert [(r.levelno, r.message) for r in caplog.records if "speculating lost" in r.message] == [
        (logging.INFO, "pair pair: target-only holds, as speculating lost at 4 rounds in flight (to be measured at 6)")]
    assert sorted(guard._decided_at) == [1, 4]  # no decision at 8 yet; the one at 4 is kept
    # Then speculating is measured at 8 and the comparison is taken there, on rates measured there
    # (with hysteresis, as after any decision). Agreeing, it would be the second confirmation, but the
    # probe, 67 % behind, was cut at half, and no comparison at 8 came before it: no confirmation.
    later = play_batched(guard, 300, 8, **at_eight)
    assert SPECULATE in later[200:250] and SPECULATE not in later[:200]
    assert guard.decisions == decisions + 1 and not guard.speculation_wins and guard.streak == 1
    assert guard._decided_at[8].rates == {SPECULATE: 3 / 500.0, TARGET_ONLY: 1 / 55.0}
    assert guard._held_at == {}  # compared at 8 now: nothing held there on 4's word any more


def test_a_load_where_speculation_won_is_not_held_off_by_a_loss_below_it() -> None:
    """At 4 sessions target-only won; at 8 speculating was measured and won (3 tokens in 150 ms
    against 1 in 60). A return to 8 takes that back once; later returns, with nothing to take back,
    measure 8 afresh rather than hold it target-only on 4's word."""
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 40, 4, spec_round=(3, 400.0), off_round=(1, 60.0))
    play_batched(guard, 1200, 8, spec_round=(3, 150.0), off_round=(1, 60.0))
    assert guard.speculation_wins and guard._decided_at[8].speculation_wins and not guard._decided_at[4].speculation_wins
    spec_at_eight = []
    for _ in range(6):
        play_batched(guard, 150, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
        modes = play_batched(guard, 150, 8, spec_round=(3, 150.0), off_round=(1, 60.0))
        spec_at_eight.append(modes.count(SPECULATE) / len(modes))
    assert min(spec_at_eight) > 0.5, spec_at_eight


def test_a_hold_on_a_loss_below_is_one_winners_epoch_over_all_visits_to_the_load() -> None:
    """Speculating lost at 4; at 8 it would win (3 tokens in 150 ms
    against 1 in 60), and the load moves 1 <-> 8 every 100 batched steps, shorter than the hold
    (about 530 batches). The hold's time adds up over the visits, so 8 is measured in the end and
    speculates from then on."""
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 40, 4, spec_round=(3, 400.0), off_round=(1, 60.0))
    spec_at_eight = []
    for _ in range(12):
        play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
        modes = play_batched(guard, 100, 8, spec_round=(3, 150.0), off_round=(1, 60.0))
        spec_at_eight.append(modes.count(SPECULATE) / len(modes))
    assert spec_at_eight[0] == 0.0  # held on 4's word at first
    assert min(spec_at_eight[-4:]) > 0.5, spec_at_eight  # measured since, and speculating


def test_a_loss_remembered_at_a_lower_load_holds_target_only_after_a_rise_from_speculating(
        caplog: pytest.LogCaptureFixture) -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 40, 4, spec_round=(3, 400.0), off_round=(1, 60.0))  # target-only won at 4 (ramp: 3)
    play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 20, 4, spec_round=(3, 400.0), off_round=(1, 60.0))  # ... taken back: due a measurement
    play_batched(guard, 200, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins and guard._decided_at[4].taken_back and not guard._decided_at[4].speculation_wins
    # Eight: at 3 in flight nothing to take back (provisional target-only, to measure both); at 6,
    # above the load where speculating lost, target-only holds for a winner's epoch instead.
    decisions = guard.decisions
    with caplog.at_level(logging.INFO, logger="orchestrator.guard"):
        modes = play_batched(guard, 300, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert modes == [TARGET_ONLY] * 300 and guard.decisions == decisions and guard.streak == 1
    assert [r.message for r in caplog.records if "speculating lost" in r.message] == [
        "pair pair: target-only holds, as speculating lost at 4 rounds in flight (to be measured at 6)"]


def test_a_rise_above_a_load_where_speculation_won_is_measured_at_once() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 60, 4, spec_round=(3, 150.0), off_round=(1, 60.0))  # speculating still wins at 4
    assert guard.speculation_wins and all(d.speculation_wins for d in guard._decided_at.values())
    modes = play_batched(guard, 12, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    # Provisional target-only, then the speculating probe within a few batches.
    assert SPECULATE in modes[2:10] and not guard.speculation_wins, modes


def test_a_decision_taken_back_once_is_measured_again_before_it_is_trusted_again() -> None:
    """A load that moves faster than a winner's epoch must not keep an old decision for ever: at 8
    sessions target-only won, then speculation gets cheaper there (3 tokens in 150 ms against 1 in 60);
    the load moves 8 <-> 1 every 150 batched steps, shorter than a target-only winner's epoch."""
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    play_batched(guard, 40, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert not guard.speculation_wins and guard._decided_at[8].first_rounds == guard.first_rounds
    spec_at_eight = []
    for _ in range(12):
        play_batched(guard, 150, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
        modes = play_batched(guard, 150, 8, spec_round=(3, 150.0), off_round=(1, 60.0))
        spec_at_eight.append(modes.count(SPECULATE) / len(modes))
    assert spec_at_eight[0] < 0.1  # the first return: the old decision, taken back
    assert min(spec_at_eight[-4:]) > 0.5, spec_at_eight  # measured since, and speculating


def test_taking_a_decision_back_restores_its_rates_and_first_rounds_and_warns_when_it_switches_off(
        caplog: pytest.LogCaptureFixture) -> None:
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play_batched(guard, 400, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    with caplog.at_level(logging.INFO, logger="orchestrator.guard"):
        play_batched(guard, 40, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    # The provisional target-only after the rise, confirmed: a switch-off, and said so.
    assert [r.levelno for r in caplog.records if "target-only now" in r.message] == [logging.WARNING]
    remembered = guard._decided_at[8]
    remembered.first_rounds.add(2000.0, 800.0, 3)  # as if turns had begun speculating at 8
    play_batched(guard, 100, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    assert guard.speculation_wins and 8 in guard._decided_at
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orchestrator.guard"):
        play_batched(guard, 2, 8, spec_round=(3, 400.0), off_round=(1, 60.0))
    assert not guard.speculation_wins and guard._decided_at[8].taken_back  # taken back, once
    assert guard.rates == remembered.rates and guard.first_rounds == remembered.first_rounds
    assert [r.levelno for r in caplog.records if "as decided at" in r.message] == [logging.WARNING]


def test_hysteresis_keeps_the_winner_within_the_margin() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=16, off_rounds=4, margin=0.05))
    play(guard, 2000, spec_round=(98, 100.0 * 50), off_round=(1, 50.0))  # 2 % slower speculating
    assert guard.speculation_wins and guard.flips == 0 and guard.decisions > 0
    guard = PairGuard(GuardSettings(spec_rounds=16, off_rounds=4, margin=0.0))
    play(guard, 2000, spec_round=(98, 100.0 * 50), off_round=(1, 50.0))
    assert not guard.speculation_wins


def test_only_steady_rounds_decided_after_the_last_epochs_rounds_ended_count() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=2, off_rounds=2, rounds_per_session=0))
    catch_up, first, second, late = guard.decide(), guard.decide(), guard.decide(), guard.decide()
    assert all(t.mode == SPECULATE and t.clean for t in (catch_up, first, second, late))
    guard.observe(catch_up, 50, 10.0, steady=False, drafted=True)  # the draft caught up: not counted
    guard.observe(first, 3, 10.0, steady=True, drafted=True)
    assert guard.epoch == 0
    guard.observe(second, 5, 30.0, steady=True, drafted=True)  # the second counted round ends the epoch
    assert guard.epoch == 1 and guard.mode == TARGET_ONLY and guard.rates[SPECULATE] == pytest.approx(8 / 40)
    # `late` (speculating, decided in epoch 0) is still running: rounds decided now share its load.
    beside = guard.decide()
    assert beside.mode == TARGET_ONLY and not beside.clean
    guard.observe(late, 100, 1.0, steady=True, drafted=True)  # epoch 0's: says nothing about epoch 1
    failed = guard.decide()
    assert failed.clean
    guard.abandon(failed)  # a round that raised: released, measured nothing
    after = [guard.decide() for _ in range(2)]
    guard.observe(beside, 100, 1.0, steady=True, drafted=False)  # ran beside `late`: not counted
    assert guard.epoch == 1
    for ticket in after:
        guard.observe(ticket, 1, 50.0, steady=True, drafted=False)
    assert guard.epoch == 2 and guard.rates[TARGET_ONLY] == pytest.approx(0.02) and guard.speculation_wins
    assert guard._outstanding == {}


def test_a_long_round_of_the_last_epoch_does_not_keep_the_next_one_from_counting() -> None:
    """A turn's first round over a long prompt, decided in the winner's epoch, still runs when the
    probe of the loser begins: rounds beside it did not count until it ended, so the pair ran the
    losing mode for all its length (20 s of target-only at 2/3 of speculation's rate, then 60 s for a
    60 s round). After LONG_ROUND_DECISIONS decisions per round in flight it no longer holds them."""
    from orchestrator.guard import LONG_ROUND_DECISIONS
    for long_ms in (0.0, 20_000.0, 60_000.0):
        guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
        play(guard, 3000, spec_round=(3, 100.0), off_round=(1, 50.0))  # speculation wins, confirmed
        while not (guard.mode == SPECULATE and guard._ms >= guard._needed_ms - 150):
            play(guard, 1, spec_round=(3, 100.0), off_round=(1, 50.0))  # the winner's epoch nearly over
        long_round = guard.decide() if long_ms else None
        elapsed = probe_rounds = 0.0
        while True:
            modes = play(guard, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
            elapsed += 100.0 if modes[0] else 50.0
            if modes[0] == 0:
                probe_rounds += 1
            elif probe_rounds:
                break  # speculating again: the probe ended
            if long_round is not None and elapsed >= long_ms:
                guard.observe(long_round, 1, long_ms, steady=False, drafted=True, first=True, target_ms=long_ms)
                long_round = None
        assert guard.speculation_wins
        # 8 counted rounds, after at most LONG_ROUND_DECISIONS x 2 rounds in flight uncounted.
        assert probe_rounds <= 8 + LONG_ROUND_DECISIONS * 2, (long_ms, probe_rounds)


def test_first_rounds_begun_at_another_load_do_not_price_this_ones_turns() -> None:
    """First rounds decided at the old load that end after a rise restarted the comparison were
    added to the new load's per-turn prices (1.9 of the 2.5 turns needed)."""
    guard = PairGuard(GuardSettings(spec_rounds=32, off_rounds=8))
    play(guard, 200, spec_round=(3, 100.0), off_round=(1, 50.0))
    while guard.mode != SPECULATE:
        play(guard, 1, spec_round=(3, 100.0), off_round=(1, 50.0))
    early = [guard.decide(), guard.decide()]  # two turns begin speculating at about one session
    others = [guard.decide() for _ in range(6)]  # six more sessions: the load rises to 8
    assert guard.load_restarts == 1 and all(t.mode == SPECULATE and t.clean for t in early)
    for ticket in early:
        guard.observe(ticket, 3, 900.0, steady=False, drafted=True, first=True, target_ms=400.0)
    assert guard.first_rounds.turns == 0
    for ticket in others:
        guard.abandon(ticket)


def test_a_probe_in_which_the_policies_hardly_drafted_cannot_restart_speculation() -> None:
    guard = PairGuard(GuardSettings(spec_rounds=4, off_rounds=4, margin=0.0))
    play(guard, 200, spec_round=(3, 200.0), off_round=(1, 50.0))
    assert not guard.speculation_wins and guard.flips == 1
    # The policies now run k = 0 themselves in the probes, 10 % faster there by noise: no flip back.
    epoch = guard.epoch
    play(guard, 1000, spec_round=(3, 200.0), off_round=(1, 50.0), proposed_k=0, zero_in_spec_epoch=(1, 45.0))
    assert guard.epoch >= epoch + 4 and guard.rates[SPECULATE] == pytest.approx(1 / 45)
    assert not guard.speculation_wins and guard.flips == 1
    # A probe that drafts and wins does.
    play(guard, 3000, spec_round=(3, 60.0), off_round=(1, 50.0))
    assert guard.speculation_wins and guard.flips == 2


def test_sessions_of_a_pair_share_one_guard() -> None:
    guard = PairGuard()
    assert copy.deepcopy(guard) is guard


def test_the_guard_applies_to_policies_that_choose_k_zero_themselves() -> None:
    config = SpeculationConfig()
    assert config.guard and config.guarded  # on by default: the cost policy, min_k = 0
    assert not config.with_override(SpeculationOverride(fixed_k=3)).guarded
    assert not config.with_override(SpeculationOverride(min_k=1)).guarded
    assert not config.with_override(SpeculationOverride(policy="heuristic")).guarded
    assert config.with_override(SpeculationOverride(policy="bandit")).guarded
    assert not config.with_values({"guard": False}, "test").guarded
    settings = config.with_values({"guard_spec_rounds": 5, "guard_off_rounds": 2, "guard_margin": 0.1,
                                   "guard_rounds_per_session": 0, "guard_cut_loss": 0.4,
                                   "guard_arrival_window_ms": 5}, "test").guard_settings()
    assert (settings.spec_rounds, settings.off_rounds, settings.margin, settings.rounds_per_session,
            settings.cut_loss, settings.arrival_window_ms) == (5, 2, 0.1, 0, 0.4, 5)
    assert SpeculationConfig().guard_settings().cut_loss == 0.25
    for bad in ({"guard_spec_rounds": 0}, {"guard_off_rounds": 0}, {"guard_margin": 1.0},
                {"guard_rounds_per_session": -1}, {"guard_rounds_per_session": 2.5},
                {"guard_margin": float("nan")}, {"guard": 1}, {"guard_cut_loss": 1.0}, {"guard_cut_loss": -0.1},
                {"guard_cut_loss": float("nan")}, {"guard_arrival_window_ms": -1.0},
                {"guard_arrival_window_ms": 2000.0}, {"guard_arrival_window_ms": float("inf")}):
        with pytest.raises(SpeculationConfigError):
            config.with_values(bad, "test")
    with pytest.raises(ValueError):
        GuardSettings(margin=-0.1).validate()


# ----------------------------------------------------------------------------- on a real pair over gRPC

@contextlib.contextmanager
def shared_cores(stack: Stack, target_ms: float, contention_ms: float, window_ms: float = 300.0):
    """Co-located workers, emulated: each target forward takes `target_ms` (a target much larger than
    the draft), plus `contention_ms` when the draft ran a forward in the last `window_ms` (the draft
    has the cores). The extra slows every session's verify, at k = 0 too, while any session of the
    pair drafts. So each session's own cost model finds k = 0 no cheaper than speculating (a k = 0
    round of its own is slowed by the others' drafts) and keeps speculating; only all sessions
    stopping at once shows the pair is faster target-only."""
    draft, target = stack.draft.scheduler, stack.target.scheduler
    draft_forward, target_forward = draft._forward, target._forward
    last_draft = [-1e9]

    def on_draft(steps):
        try:
            return draft_forward(steps)
        finally:
            last_draft[0] = time.monotonic()

    def on_target(steps):
        contended = (time.monotonic() - last_draft[0]) * 1000.0 < window_ms
        time.sleep((target_ms + (contention_ms if contended else 0.0)) / 1000.0)
        return target_forward(steps)
    draft._forward, target._forward = on_draft, on_target
    try:
        yield
    finally:
        draft._forward, target._forward = draft_forward, target_forward


@pytest.mark.parametrize("contention_ms, guard", [(0.0, True), (300.0, True), (300.0, False)],
                         ids=["separate-devices", "shared-cores", "shared-cores-unguarded"])
async def test_the_pair_guard_stops_speculation_that_slows_the_pair_as_a_whole(contention_ms: float,
                                                                               guard: bool) -> None:
    speculation = SpeculationConfig(max_k=4, guard=guard, guard_spec_rounds=8, guard_off_rounds=4)
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.02", speculation=speculation)
    try:
        # The pair's prior, as sessions that ran before on this pair learned it: every k, k = 0 too,
        # costs the verify it measured (with shared cores: the contention included, because those
        # sessions' k = 0 rounds ran beside other sessions' drafts). So the policy speculates from
        # round one, and only the guard's pair-wide measurement can show that k = 0 for all is faster.
        engine = stack.orch.engine
        engine.prior_for("any").timing.seed(2.0, {k: 42.0 + contention_ms + k for k in range(5)})
        prompts = [[5 + i, 6, 7, 8 + i] for i in range(3)]
        with shared_cores(stack, target_ms=40.0, contention_ms=contention_ms):
            replies = await asyncio.gather(*(stack.generate(prompt_ids=p, max_new_tokens=48) for p in prompts))
        assert [list(r.token_ids) for r in replies] == [reference_greedy(p, 48) for p in prompts]
        ks = [list(r.stats.k_per_round) for r in replies]
        off_rounds = sum(r.stats.guard_off_rounds for r in replies)
        if not guard:  # the policy alone keeps drafting: its prior says k = 0 costs as much
            assert engine.guards == {} and off_rounds == 0
            assert all(sum(1 for k in session if k > 0) > len(session) // 2 for session in ks), ks
            return
        pair_guard = engine.guards[engine.pair_key("any")]
        assert engine.guard_for("another session") is pair_guard  # one guard per worker pair
        # Rounds the guard forced to k = 0 are not the policies' choice: the pair's prior (which every
        # session's every round teaches) has not learned from them.
        assert engine.prior_for("any").rounds == sum(r.stats.rounds for r in replies) - off_rounds
        assert pair_guard.decisions >= 1, (pair_guard.rates, pair_guard.epoch)
        if contention_ms:
            # Speculating, at most 5 tokens per 340+ ms; target-only, 1 per 40-50 ms: the first
            # measurement stops drafting for the whole pair, and the hold (4x the time of the
            # speculating epoch) outlasts the run.
            assert not pair_guard.speculation_wins and pair_guard.flips == 1, (pair_guard.rates, ks)
            assert off_rounds > 12 and all(session[-3:] == [0, 0, 0] for session in ks), ks
        else:  # up to 5 tokens per ~60 ms against 1 per 40-90 ms: it keeps speculating, measuring k = 0 briefly
            spec, off = pair_guard.rates[SPECULATE], pair_guard.rates[TARGET_ONLY]
            assert pair_guard.speculation_wins and spec > off and pair_guard.flips == 0, (spec, off, ks)
            assert 0 < off_rounds < sum(r.stats.rounds for r in replies) // 2
    finally:
        await stack.close()


async def test_a_round_that_fails_before_it_runs_hands_its_ticket_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's ticket was taken before the policy picked k: a policy that raised left it in
    flight for good (the pair's load too high and every later round unclean, for ever)."""
    import grpc

    from orchestrator.kpolicy import CostModelPolicy
    stack = await start_stack(speculation=SpeculationConfig(policy="cost", guard=True))
    try:
        calls = 0
        real_next_k = CostModelPolicy.next_k

        def failing_once(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:
                raise ZeroDivisionError("a bug in the policy")
            return real_next_k(self, *args, **kwargs)

        monkeypatch.setattr(CostModelPolicy, "next_k", failing_once)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=20)
        assert failed.value.code() == grpc.StatusCode.INTERNAL  # a bug stays one
        # Its kind and a log id reach the caller, not its text.
        assert "ZeroDivisionError" in failed.value.details() and "a bug in the policy" not in failed.value.details()
        assert "logged as " in failed.value.details()
        guard = stack.orch.engine.guard_for("any")
        assert guard.in_flight == 0 and guard._outstanding == {}
    finally:
        await stack.close()


@pytest.mark.parametrize("window_ms", [400.0, 0.0], ids=["gathered", "no-wait"])
async def test_a_burst_of_turns_on_a_real_pair_is_counted_before_its_first_rounds_decide(
        monkeypatch: pytest.MonkeyPatch, window_ms: float) -> None:
    """Over gRPC: a pair that speculated at one session gets four turns 10 ms apart. Each waits its
    share of its prompt's forward on the target's curve (here all of the 400 ms window: the share
    raised for a tiny target) for the others, so the burst is seen as a rise and every first round
    runs target-only (without the wait, the first turn decides before the second arrives, and
    speculates). A turn cancelled while it waits, or refused before its first round, leaves the
    count."""
    import grpc

    from orchestrator import guard as guard_module
    monkeypatch.setattr(guard_module, "ARRIVAL_SHARE", 1000.0)  # the tiny target's forward is ~1 ms
    # A target call 30 ms slower than the draft's: speculating pays (the draft and target are one model).
    stack = await start_stack(speculation=SpeculationConfig(max_k=4, guard_arrival_window_ms=window_ms),
                              target_call_delay_ms=30.0)
    try:
        guard = stack.orch.engine.guard_for("any")
        warm = await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=12)
        assert warm.stats.k_per_round[0] > 0, list(warm.stats.k_per_round)
        assert guard.mode == SPECULATE and guard.load == 1 and guard._arriving == 0
        if window_ms:  # a turn cancelled while it waits leaves the count
            waiting = asyncio.ensure_future(stack.generate(prompt_ids=[9, 6, 7], max_new_tokens=12))
            for _ in range(200):
                if guard._arriving:
                    break
                await asyncio.sleep(0.005)
            assert guard._arriving == 1
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            for _ in range(200):
                if not guard._arriving:
                    break
                await asyncio.sleep(0.005)
            assert guard._arriving == 0 and guard.in_flight == 0
        prompts = [[5 + i, 6, 7, 8 + i] for i in range(4)]

        async def arriving(index: int, prompt: list[int]) -> Any:
            await asyncio.sleep(0.01 * index)
            return await stack.generate(prompt_ids=prompt, max_new_tokens=12)

        replies = await asyncio.gather(*(arriving(i, p) for i, p in enumerate(prompts)))
        assert [list(r.token_ids) for r in replies] == [reference_greedy(p, 12) for p in prompts]
        first_ks = [r.stats.k_per_round[0] for r in replies]
        if window_ms:
            assert first_ks == [0] * 4, [list(r.stats.k_per_round) for r in replies]
        else:
            assert first_ks[0] > 0, [list(r.stats.k_per_round) for r in replies]
        assert guard.load_restarts >= 1 and guard._arriving == 0
        # A turn whose first round cannot speculate (one token to make) does not wait.
        from orchestrator.engine import GenerationEngine
        waits: list[int] = []
        real_wait = GenerationEngine._wait_for_arrivals

        async def counted_wait(*args: Any) -> None:
            waits.append(1)
            await real_wait(*args)

        monkeypatch.setattr(GenerationEngine, "_wait_for_arrivals", staticmethod(counted_wait))
        await stack.generate(prompt_ids=[5, 6, 8], max_new_tokens=1)
        assert waits == []
        await stack.generate(prompt_ids=[5, 6, 8], max_new_tokens=3)
        assert waits == [1]
        too_long = stack.orch.engine.target_info.max_context
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stack.generate(prompt_ids=[5] * too_long, max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert guard._arriving == 0 and guard.in_flight == 0
    finally:
        await stack.close()
