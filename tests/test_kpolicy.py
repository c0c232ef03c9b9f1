"""Adaptive-k policies decide from synthetic statistics (no gRPC)."""
from __future__ import annotations

import pytest

from orchestrator.config import SpeculationConfig
from orchestrator.kpolicy import (PAIR_ACCEPTANCE_ALPHA, SESSION_ACCEPTANCE_ALPHA, BanditPolicy, CostModelPolicy,
                             DecayingLine, Ewma, FixedPolicy, HeuristicPolicy, SessionStats, TargetLoad,
                             expected_tokens, prefill_overlap_price, speedup_bound)


def stats_with(acceptance: float, draft_ms: float = 10.0, verify_base: float = 50.0, verify_slope: float = 2.0,
               rtt: float = 1.0) -> SessionStats:
    s = SessionStats()
    s.acceptance.value = s.typical.value = acceptance  # a session whose long-run rate is this too
    s.timing.draft_ms_per_token.value = draft_ms
    s.timing.verify_line.intercept, s.timing.verify_line.slope = verify_base, verify_slope
    s.timing.rtt_ms.value = rtt
    return s


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup_bound(0.8, 3, 0.0) == pytest.approx(expected_tokens(0.8, 3))


def test_fixed_policy_clamps() -> None:
    assert FixedPolicy(4).next_k(SessionStats(), 0, 8) == 4
    assert FixedPolicy(12).next_k(SessionStats(), 0, 8) == 8


def test_heuristic_policy() -> None:
    policy, s = HeuristicPolicy(initial_k=4), SessionStats()
    assert policy.next_k(s, 0, 10) == 4
    s.observe_round(4, 4)
    assert policy.next_k(s, 0, 10) == 6  # all accepted: +2
    s.observe_round(6, 2)
    assert policy.next_k(s, 0, 10) == 5  # a rejection: -1
    s.observe_round(1, 0)
    assert policy.next_k(s, 0, 10) == 1  # floor 1


def test_cost_model_picks_larger_k_as_acceptance_rises() -> None:
    policy = CostModelPolicy()
    ks = [policy.next_k(stats_with(a), 0, 16) for a in (0.3, 0.6, 0.8, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


def test_cost_model_picks_larger_k_as_rtt_rises() -> None:
    policy = CostModelPolicy()
    ks = [policy.next_k(stats_with(0.8, rtt=rtt), 0, 16) for rtt in (0.0, 20.0, 100.0)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


def test_cost_model_picks_zero_when_draft_too_slow_or_useless() -> None:
    policy = CostModelPolicy()
    assert policy.next_k(stats_with(0.8, draft_ms=80.0, verify_base=50.0), 0, 8) == 0
    assert policy.next_k(stats_with(0.05), 0, 8) == 0
    assert policy.next_k(stats_with(0.05), 2, 8) == 2  # min_k wins over the model


def test_cost_model_probes_after_long_target_only_stretch_and_backs_off() -> None:
    """Probes after 4 target-only rounds; each probe that finds drafting still losing doubles the
    wait (4, 8, 16, ...), so a pair that cannot win pays for ever fewer probes."""
    policy = CostModelPolicy(probe_every=4)
    s = stats_with(0.05)
    decisions = []
    for _ in range(31):
        k = policy.next_k(s, 0, 8)
        decisions.append(k)
        s.observe_round(k, 0)
    assert [i for i, k in enumerate(decisions) if k] == [4, 13, 30]
    # A probe that shows drafting pays again resets the back-off.
    s.acceptance.value = 0.95
    assert policy.next_k(s, 0, 8) > 0 and s.failed_probes == 0


def test_acceptance_is_the_ratio_of_accepted_to_tried_positions_not_a_mean_of_round_ratios() -> None:
    """Rounds of k = 4 on text the draft matches with probability 0.6 per token. The mean of each
    round's own ratio (1 for a fully accepted round, 0 for a first-token rejection) is biased low,
    about 0.41 here; accepted / tried positions is the geometric model's estimate."""
    import random
    rng = random.Random(7)
    s, round_ratios, estimates = SessionStats(), [], []
    for i in range(600):
        accepted = 0
        while accepted < 4 and rng.random() < 0.6:
            accepted += 1
        s.observe_round(4, accepted)
        round_ratios.append(accepted / (accepted + (1 if accepted < 4 else 0)))
        if i >= 50:
            estimates.append(s.acceptance.value)
    assert sum(round_ratios) / len(round_ratios) < 0.45  # what the estimate was before
    assert sum(estimates) / len(estimates) == pytest.approx(0.6, abs=0.04)


def test_a_dip_does_not_keep_a_session_off_until_the_next_probe() -> None:
    """Two first-token rejections in a row take a session whose text is usually drafted well to
    k = 0. Target-only rounds show nothing new, so its estimate drifts back to its long-run rate and
    it drafts again after a few rounds, long before the probe (16 rounds)."""
    policy = CostModelPolicy(probe_every=16)
    s = stats_with(0.8, draft_ms=20.0, verify_base=50.0, verify_slope=2.0)
    s.acceptance.value = 0.2  # a hard stretch (or bad luck) just now
    target_only_rounds = 0
    while policy.next_k(s, 0, 8) == 0 and target_only_rounds < 16:
        s.observe_round(0, 0)
        target_only_rounds += 1
    assert 1 <= target_only_rounds <= 4
    # A session whose long-run rate is that low too stays off until the probe.
    low = stats_with(0.2, draft_ms=20.0, verify_base=50.0, verify_slope=2.0)
    ks = []
    for _ in range(16):
        ks.append(policy.next_k(low, 0, 8))
        low.observe_round(ks[-1], 0)
    assert ks == [0] * 16


def test_a_stale_long_run_rate_buys_one_round_not_one_per_relax() -> None:
    """A session whose long-run rate (0.7) is stale meets text the draft never matches. Relaxing
    towards 0.7 takes it back to drafting once; that round counts as a probe, and after it fails
    only the doubling probes draft (without the gating: drafts at rounds 2, 3, 5, 7, 9, 13, 18, 27)."""
    policy = CostModelPolicy(probe_every=4)
    s = stats_with(0.7)
    s.acceptance.value = 0.05  # typical stays 0.7
    drafted = []
    for i in range(31):
        k = policy.next_k(s, 0, 8)
        if k:
            drafted.append(i)
        s.observe_round(k, 0)
    assert 1 <= len(drafted) <= 4, drafted
    assert s.failed_probes >= 2


def test_a_long_easy_stretch_does_not_make_the_estimate_deaf_to_a_hard_one() -> None:
    """After 30 fully accepted rounds at k = 8 the text turns hard: every first draft is rejected.
    A round adds the positions it tried, so the easy rounds (8 each) would outweigh the hard ones
    (1 each) for a dozen rounds; the session's evidence is capped, and it stops drafting sooner."""
    policy = CostModelPolicy()
    s = stats_with(0.9, draft_ms=150.0, verify_base=315.0, verify_slope=2.0, rtt=4.0)
    for _ in range(30):
        s.observe_round(8, 8)
    assert policy.next_k(s, 0, 8) == 8
    rounds = 0
    while (k := policy.next_k(s, 0, 8)) > 0 and rounds < 30:
        s.observe_round(k, 0)
        rounds += 1
    assert rounds <= 8, rounds


def test_a_guessed_start_gives_way_to_the_first_measurements_and_a_trusted_one_does_not() -> None:
    guess = Ewma(0.2, 1.0, prior_weight=0.0)
    guess.update(60.0)
    assert guess.value == 60.0  # the first measurement replaces the guess
    guess.update(40.0)
    assert guess.value == pytest.approx(50.0)  # the first few are averaged ...
    for _ in range(3):
        guess.update(40.0)
    assert guess.value == pytest.approx(44.0)  # (60 + 4 * 40) / 5
    guess.update(140.0)
    assert guess.value == pytest.approx(0.8 * 44.0 + 0.2 * 140.0)  # ... then weight alpha
    seeded = Ewma(0.2, 30.0, prior_weight=1.0)  # a start measured once (a startup ping)
    seeded.update(60.0)
    assert seeded.value == pytest.approx(45.0)
    trusted = Ewma(0.2, 1.0)  # a plain EWMA: the start weighs (1 - alpha) from the first update
    trusted.update(60.0)
    assert trusted.value == pytest.approx(0.8 * 1.0 + 0.2 * 60.0)


def test_one_measured_draft_rtt_is_enough_to_stop_drafting_to_a_far_draft() -> None:
    """Before: the 1 ms guess weighed 4 observations, so a draft 60 ms away looked 13 ms away after
    its first call and drafting went on. A cheap draft (1 ms per token), a 30 ms target."""
    s = stats_with(0.7, draft_ms=1.0, verify_base=30.0, verify_slope=0.5, rtt=0.5)
    policy = CostModelPolicy()
    assert policy.next_k(s, 0, 8) > 0
    s.timing.observe_draft_rtt(60.0)
    assert s.timing.draft_rtt_ms.value == 60.0 and policy.next_k(s, 0, 8) == 0


def test_a_new_session_starts_from_the_pairs_typical_acceptance_not_its_last_three_rounds() -> None:
    """The pair's prior sees every round of every session. Acceptance is bimodal per prompt: a few
    fully accepted rounds in one session said little about the next session's text, yet at a
    session's pace (0.3) they set its first k (loadtest run 17: first rounds at k = 7-8, accepting 1-2)."""
    def history(stats: SessionStats) -> SessionStats:
        for _ in range(40):
            stats.observe_round(4, 1)  # the pair's typical text: 1 of 4 accepted, a = 0.5
        for _ in range(3):
            stats.observe_round(8, 8)  # then three fully accepted rounds in another session
        return stats

    fresh = SessionStats().as_pair_prior()
    for _ in range(10):
        fresh.observe_round(4, 4)  # a fresh pair whose first rounds accept everything
    kept = (1 - PAIR_ACCEPTANCE_ALPHA) ** 10  # the 0.7 guess weighs 4 positions, decayed like the rounds
    rounds = sum(4 * (1 - PAIR_ACCEPTANCE_ALPHA) ** i for i in range(10))
    assert fresh.acceptance.value == pytest.approx((0.7 * 4 * kept + rounds) / (4 * kept + rounds))
    assert fresh.acceptance.value > 0.9
    prior = history(SessionStats().as_pair_prior())
    # The three rounds are 24 accepted positions against the pair's 40 rounds of 2 tried each (about
    # 40 positions at the pair's pace): they move it, but only to about 0.7.
    assert prior.acceptance.alpha == PAIR_ACCEPTANCE_ALPHA and 0.6 < prior.acceptance.value < 0.75
    session = prior.new_session()
    assert session.acceptance.alpha == SESSION_ACCEPTANCE_ALPHA and session.acceptance.value == prior.acceptance.value
    at_session_pace = history(SessionStats())
    assert at_session_pace.acceptance.value > 0.8
    policy = CostModelPolicy()
    for stats in (session, at_session_pace):  # a loaded co-located pair: 180 ms per draft token, flat verify
        stats.timing.draft_ms_per_token.value = 180.0
        stats.timing.verify_by_k = {k: Ewma(0.3, 800.0) for k in range(9)}
    assert policy.next_k(session, 0, 8) <= 3 < 5 <= policy.next_k(at_session_pace, 0, 8)
    # The session then follows its own text at its own pace, and the prior is not touched.
    session.observe_round(4, 4)
    keep = 1 - SESSION_ACCEPTANCE_ALPHA  # the prior's value weighs SESSION_PRIOR_POSITIONS (4) positions
    assert session.acceptance.value == pytest.approx((keep * 4 * prior.acceptance.value + 4) / (keep * 4 + 4))
    assert prior.acceptance.value < session.acceptance.value


def test_acceptance_ewma_tracks_rounds() -> None:
    s = SessionStats()
    for _ in range(40):
        s.observe_round(4, 4)
    assert s.acceptance.value > 0.95
    for _ in range(40):
        s.observe_round(4, 0)
    assert s.acceptance.value < 0.05


def test_verify_line_fits_slope() -> None:
    line = DecayingLine(0.0, 0.0)
    for k in (1, 2, 3, 4, 1, 2, 3, 4):
        line.update(k, 30.0 + 5.0 * k)
    assert line(6) == pytest.approx(60.0, rel=1e-6)


def test_make_policy() -> None:
    assert SpeculationConfig(policy="heuristic").make_policy().name == "heuristic"
    with pytest.raises(ValueError, match="unknown k policy"):
        SpeculationConfig(policy="nope").make_policy()  # type: ignore[arg-type]


def test_cost_model_learns_a_step_in_verify_cost() -> None:
    """Verify cost flat up to 3 tokens, doubling from 4 (as fp32 GEMMs on CPU): k=2 wins."""
    s = stats_with(0.85, draft_ms=100.0, rtt=1.0)
    for _ in range(3):
        for k in range(0, 7):
            s.timing.observe_verify(k, 260.0 if k + 1 <= 3 else 500.0)
    assert CostModelPolicy().next_k(s, 0, 6) == 2


# ----------------------------------------------------------------------------- load (batched target)

def loaded_stats(batch: float, waiting: int = 0) -> SessionStats:
    """A target whose forward is memory-bound (flat) up to 16 rows and compute-bound (linear) past it,
    as a CPU or GPU forward is; acceptance 0.8, a cheap draft."""
    s = stats_with(0.8, draft_ms=4.0)
    s.timing.load = TargetLoad(((1, 100.0), (9, 104.0), (16, 108.0), (32, 268.0), (64, 588.0)))
    s.timing.seed(4.0, {k: 100.0 + 0.5 * k for k in range(9)})
    s.timing.load.target_batch.value = batch + waiting
    return s


def test_k_falls_as_the_batch_grows_and_reaches_zero_at_saturation() -> None:
    policy = CostModelPolicy(probe_every=0)
    chosen = [policy.next_k(loaded_stats(b), 0, 8) for b in (1, 2, 4, 8, 16)]
    assert chosen[0] >= 4, chosen                   # alone: the verify is nearly free, speculate
    assert all(a >= b for a, b in zip(chosen, chosen[1:])), chosen   # never more k under more load
    assert chosen[-1] == 0, chosen                  # 16 sessions: every extra row costs, k = 0
    # Calls waiting for a slot count as load too.
    assert policy.next_k(loaded_stats(8, waiting=8), 0, 8) == 0


def test_a_prompts_round_drafts_less_where_its_forward_is_compute_bound() -> None:
    """A turn's first round verifies its drafts in the prompt's forward, where each row costs what a
    prefill row does: its k is the one that finishes the turn soonest, smaller than the steady k.
    Where rows are nearly free (a flat curve, as on a GPU), the steady k stands."""
    policy = CostModelPolicy(probe_every=0)
    s = loaded_stats(1)
    s.timing.draft_ms_per_token.value = 30.0
    steady = policy.next_k(s, 0, 8)
    assert steady >= 3 and policy.next_k(s, 0, 8, prefill_rows=1) == steady
    rate = CostModelPolicy.tokens_per_ms(s, steady)
    curve = s.timing.load.forward_ms

    def turn_ms(k: int, prompt: int = 48, tokens: int = 32) -> float:
        """The first round at k, then the rest of the turn at the steady rate."""
        first = k * 30.0 + curve(prompt + k)
        return first + (tokens - expected_tokens(s.acceptance.value, k)) / rate
    first = policy.next_k(s, 0, 8, prefill_rows=48)
    assert 1 <= first < steady, (first, steady)
    assert turn_ms(first) == min(turn_ms(k) for k in range(1, steady + 1)) < turn_ms(steady)
    assert BanditPolicy().next_k(s, 0, 8, prefill_rows=48) == first  # the bandit uses the same rule
    assert FixedPolicy(5).next_k(s, 0, 8, prefill_rows=48) == 5      # a pinned k is the caller's
    s.timing.load = TargetLoad(((1, 100.0), (16, 101.0), (64, 104.0), (128, 108.0)))  # rows nearly free
    assert policy.next_k(s, 0, 8, prefill_rows=48) == policy.next_k(s, 0, 8)
    s.timing.load = TargetLoad(((1, 100.0), (9, 104.0), (16, 108.0), (32, 268.0), (64, 588.0)))
    assert policy.next_k(s, 3, 8, prefill_rows=48) >= 3          # never below min_k
    assert policy.next_k(s, first, first, prefill_rows=48) == first  # nothing to choose from
    s.timing.load = TargetLoad()                                   # no rows curve: the steady k
    assert policy.next_k(s, 0, 8, prefill_rows=48) == policy.next_k(s, 0, 8)
    # A bandit that learned k = 0 is best keeps it for a prompt's round too (its own pick, not the
    # cost model's).
    s.arms = {k: [50.0, 0.02 if k == 0 else 0.001] for k in range(9)}
    learned = BanditPolicy(exploration=0.0)
    assert learned.next_k(s, 0, 8) == 0 and learned.next_k(s, 0, 8, prefill_rows=48) == 0


def test_load_factor_follows_the_curve() -> None:
    s = loaded_stats(4)
    assert s.timing.load_factor(0) == pytest.approx(101.5 / 100.0)   # 4 rows: still flat
    assert s.timing.load_factor(7) == pytest.approx(268.0 / 104.0, rel=0.01)             # 32 rows
    assert s.timing.load.forward_ms(128) == pytest.approx(588.0 + 10.0 * 64)                   # extended
    assert loaded_stats(1).timing.load_factor(7) == 1.0
    assert SessionStats().timing.load_factor(3, batch=8) == 1.0  # no curve: no load pricing


def test_verify_observed_in_a_batch_is_stored_as_its_cost_alone() -> None:
    s = loaded_stats(1)
    s.timing.verify_by_k.clear()
    s.timing.observe_verify(3, 268.0, rows=32)   # a k=3 verify in a 32-row forward
    assert s.timing.solo_verify_ms(3) == pytest.approx(268.0 * 102.0 / 268.0, rel=0.01)


def test_round_records_feed_the_load_estimate() -> None:
    from orchestrator.record import RoundRecord
    s = loaded_stats(1)
    record = RoundRecord("s", 1, 10, "cost", 3, (1, 2, 3), (0.9,) * 3, (0.9,) * 3, 3, (1, 2, 3, 4), "", None,
                         False, True, 12.0, 4.0, 150.0, 152.0, 170.0, 0, 0, 10, 0,
                         target_batch=6.0, target_rows=24.0, target_waiting=2)
    for _ in range(20):
        s.observe(record)
    assert s.timing.load.target_batch.value == pytest.approx(8.0, rel=0.01)
    # A fixed k ignores load: every request can still pin its own k.
    assert FixedPolicy(5).next_k(s, 0, 8) == 5


def test_rows_measured_in_service_replace_the_startup_curve() -> None:
    s = loaded_stats(8)
    flat_choice = CostModelPolicy(probe_every=0).next_k(s, 0, 8)
    assert flat_choice > 0  # the startup curve says 8 sessions x (k+1) rows are nearly free
    # In service, forwards over 16..64 rows turn out to cost far more than the calibration said
    # (prefills sharing them, a co-located draft): the same load now prices speculation out.
    for rows, ms in ((8, 110.0), (16, 300.0), (24, 450.0), (32, 600.0), (40, 750.0), (48, 900.0), (64, 1200.0)):
        for _ in range(5):
            s.timing.load.observe_forward(rows, ms)
    assert dict(s.timing.load.rows_curve())[32] == pytest.approx(600.0, rel=0.01)
    assert s.timing.load.forward_ms(1) == pytest.approx(100.0)    # not observed: the startup point stays
    assert s.timing.load.forward_ms(9) == pytest.approx(110.0)    # ... lifted to stay monotone
    assert CostModelPolicy(probe_every=0).next_k(s, 0, 8) == 0
    # The curve stays non-decreasing whatever the measurements say.
    s.timing.load.observe_forward(12, 50.0)
    values = [ms for _, ms in s.timing.load.rows_curve()]
    assert values == sorted(values)


def test_sessions_of_a_pair_share_one_live_load() -> None:
    import copy
    prior = loaded_stats(1)
    sessions = [copy.deepcopy(prior) for _ in range(3)]
    sessions[0].timing.load.target_batch.update(8.0)
    sessions[1].timing.load.observe_forward(32, 999.0)
    # Every session (and the prior new sessions copy) sees the others' observations at once ...
    assert all(s.timing.load.target_batch.value == prior.timing.load.target_batch.value > 1.0 for s in sessions)
    assert all(dict(s.timing.load.rows_curve())[32] == 999.0 for s in sessions)
    # ... while their own statistics stay their own.
    sessions[2].acceptance.update(4, 0)
    assert prior.acceptance.value != sessions[2].acceptance.value
    # A new worker pair starts from the calibration, not from another pair's load.
    other = prior.timing.load.fresh()
    assert other.target_batch.value == 1.0 and not other.observed_rows
    assert other.target_curve == prior.timing.load.target_curve


def test_heuristic_policy_drafts_nothing_at_max_k_0_and_each_session_starts_at_initial_k() -> None:
    assert HeuristicPolicy(initial_k=4).next_k(SessionStats(), 0, 0) == 0
    prior = SessionStats()
    for _ in range(5):
        prior.observe_round(8, 8)  # another session's rounds, which the pair's prior learns from
    fresh = prior.new_session()
    assert HeuristicPolicy(initial_k=2).next_k(fresh, 0, 8) == 2  # not that session's last k + 2
    assert (fresh.rounds, fresh.last_k, fresh.last_accepted) == (0, 0, 0)
    assert fresh.acceptance.value == pytest.approx(prior.acceptance.value)  # what the pair learned stays


def test_bandit_with_a_prior_weight_below_one_round_per_arm_picks_a_k() -> None:
    """prior_weight x arms < 1 before any round: the UCB's log(total) was negative (ValueError)."""
    s = stats_with(0.8)
    assert 0 <= BanditPolicy(prior_weight=0.1).next_k(s, 0, 8) <= 8


def test_verify_cost_is_monotone_in_k_when_the_rows_curve_and_the_per_k_costs_disagree() -> None:
    """Per-k costs measured flat, a rows curve with a step at 5 rows, 2 sessions per forward: the load
    factor T(2(k+1)) / T(k+1) is 2 at k = 2, 3 and 1 at k = 4, which priced 4 drafts at half of 3."""
    s = stats_with(0.6)
    s.timing.seed(2.0, {k: 10.0 for k in range(9)})
    s.timing.load = TargetLoad(((1, 10.0), (4, 10.0), (5, 20.0), (16, 20.0), (32, 40.0)))
    s.timing.load.target_batch = Ewma(0.3, 2.0)
    costs = [s.timing.verify_ms(k) for k in range(9)]
    assert costs == sorted(costs) and costs[4] == pytest.approx(20.0)
    assert s.timing.load.forward_ms(16) == pytest.approx(20.0)
    s.timing.load.observe_forward(16, 80.0)  # the curve as measured in service replaces the cached one
    assert s.timing.load.forward_ms(16) == pytest.approx(80.0)


def _round(k: int, accepted: int, draft_token_ms: float, verify_ms: float):
    """A steady round alone on the pair (record fields as the rounds write them)."""
    from orchestrator.record import RoundRecord
    drafts = tuple(range(1, k + 1))
    return RoundRecord("s", 2, 40, "cost", k, drafts, (0.9,) * k, (0.9,) * k, accepted,
                       drafts[:accepted] + (99,), "", None, False, True, draft_token_ms * k,
                       draft_token_ms if k else 0.0, verify_ms, verify_ms + 1.0,
                       draft_token_ms * k + verify_ms + 2.0, 0, 1 if k == 0 else 0, 40, 0)


def _drive(policy: CostModelPolicy, s: SessionStats, rounds: int, draft_ms, verify_ms, acceptance: float,
           seed: int = 0) -> list[int]:
    """Rounds chosen by `policy` on `s`, each observed as SessionStats.observe sees a live one;
    draft_ms(r) / verify_ms(r, k) give round r's true costs, acceptance is geometric."""
    import random
    rnd, ks = random.Random(seed), []
    for r in range(rounds):
        k = policy.next_k(s, 0, 8)
        accepted = 0
        while accepted < k and rnd.random() < acceptance:
            accepted += 1
        s.observe(_round(k, accepted, draft_ms(r), verify_ms(r, k)))
        ks.append(k)
    return ks


def test_one_slow_target_only_round_does_not_price_every_k_alike_for_good() -> None:
    """One k = 0 verify 10x its cost (a GC pause, a neighbour's burst) raised k = 0's price, and the
    envelope carried it to every k: k = 0 never looked cheaper than drafting again and, re-measured
    only when chosen, it stayed so. Here the verify grows with k (a CPU) so that target-only wins,
    and the stuck policy drafted k = 5 at about 60 % of target-only's rate."""
    def true_verify(r: int, k: int) -> float:
        return 100.0 * (1 + 0.5 * k)
    s = stats_with(0.6, draft_ms=10.0)
    s.timing.seed(10.0, {k: true_verify(0, k) for k in range(9)})
    policy = CostModelPolicy()
    assert policy.next_k(s, 0, 8) == 0
    s.timing.observe_verify(0, 1000.0)
    assert s.timing.verify_ms(0) == pytest.approx(s.timing.verify_ms(1)) and policy.next_k(s, 0, 8) > 0
    ks = _drive(policy, s, 200, lambda r: 10.0, true_verify, acceptance=0.6)
    assert ks[0] > 0  # it drafts while k = 0 looks dear...
    # ...and is back within 30 rounds: target-only, or k = 1 (its probes, and here as fast: 1.6 tokens
    # in 160 ms), never the dear k >= 2 it was stuck at before.
    assert max(ks[30:]) <= 1 and ks[30:].count(0) >= 150
    assert s.timing.verify_ms(0) == pytest.approx(100.0, rel=0.05)


def test_the_draft_cost_after_a_slow_spell_follows_the_first_probe() -> None:
    """The draft is 40x slower for 20 rounds, then fast again. Its cost is only seen while drafting,
    so the estimate from the slow spell is as old as the target-only stretch after it: the probe's
    measurement replaces most of it. (Before: each probe moved it 20 % of the way, failed, and
    doubled the wait for the next; 95 target-only rounds after the spell ended.)"""
    s = stats_with(0.8, draft_ms=5.0)
    s.timing.seed(5.0, {k: 100.0 + 2 * k for k in range(9)})
    ks = _drive(CostModelPolicy(), s, 200, lambda r: 200.0 if r < 20 else 5.0, lambda r, k: 100.0 + 2 * k,
                acceptance=0.8)
    assert ks[0] > 0 and ks[5:20].count(0) >= 13  # it drafts, then stops while the draft is slow
    back = next(i for i, k in enumerate(ks[20:]) if k > 1)
    assert back <= 40, ks  # one probe's wait (16 rounds, doubled per failed probe), not 95 rounds
    assert s.timing.draft_ms_per_token.value == pytest.approx(5.0, rel=0.2)
    # While drafting, one slow sample still moves the estimate only its usual 20 %.
    fresh = stats_with(0.8, draft_ms=5.0)
    fresh.timing.seed(5.0, {})
    fresh.observe(_round(3, 3, 5.0, 100.0))
    fresh.observe(_round(3, 3, 105.0, 100.0))
    assert fresh.timing.draft_ms_per_token.value == pytest.approx(25.0)


def test_ks_in_use_keep_their_measured_cost_and_unseen_ones_follow_the_calibrated_shape() -> None:
    """Only a k not measured lately drifts towards its startup cost at the machine's current speed:
    rounds alternating between k = 3 and 4 across a GEMM step the calibration missed keep the step
    (relaxing them too settled at 221 / 284 for 200 / 300), while k = 8, never measured, follows
    the calibrated shape at the speed k = 3 and 4 show."""
    t = SessionStats().timing
    t.seed(10.0, {k: 100.0 + 10 * k for k in range(9)})
    for r in range(200):
        t.observe_verify(3 if r % 2 == 0 else 4, 200.0 if r % 2 == 0 else 300.0)
    assert t.verify_by_k[3].value == pytest.approx(200.0) and t.verify_by_k[4].value == pytest.approx(300.0)
    assert 180.0 * 200.0 / 130.0 < t.verify_by_k[8].value < 180.0 * 300.0 / 140.0


def overlap_stats(draft_curve: tuple[tuple[int, float], ...], a: float = 0.8, draft_ms: float = 45.0) -> SessionStats:
    """A CPU-like pair: the target's prefill dear (compute-bound past 16 rows), 45 ms a drafted token."""
    s = stats_with(a, draft_ms=draft_ms)
    s.timing.load = TargetLoad(((1, 500.0), (9, 540.0), (16, 700.0), (32, 1300.0), (64, 2500.0)))
    s.timing.seed(draft_ms, {k: 500.0 + 5.0 * k for k in range(9)})
    s.timing.draft_curve = draft_curve
    return s


def test_the_prefill_overlap_is_priced_against_the_serial_first_round() -> None:
    """"auto" overlaps a turn's first round where the draft's prefill and drafts on the critical path
    cost more than the overlap's round (the target's prefill alone) plus the time the steady rounds
    need for the tokens that round did not make; not where the draft prefills cheaply."""
    dear = overlap_stats(((1, 45.0), (2, 48.0), (16, 80.0), (64, 600.0)))   # the draft's prefill: 427 ms at 48
    cheap = overlap_stats(((1, 45.0), (2, 46.0), (64, 60.0)))               # ... 56 ms (a GPU-like draft)
    for pipelined in (False, True):
        price = prefill_overlap_price(dear, 48, 0, 8, pipelined, 2)
        assert price is not None and price.pays, price
        rate = max(CostModelPolicy.tokens_per_ms(dear, k, pipelined, 2) for k in range(9))
        d48 = 80.0 + (600.0 - 80.0) * 32 / 48
        t = dear.timing
        assert price.serial == pytest.approx(d48 + (price.k_serial - 1) * 45.0 + t.draft_rtt_ms.value
                                             + t.load.forward_ms(48 + price.k_serial) + t.rtt_ms.value)
        assert price.overlap == pytest.approx(t.load.forward_ms(48) + t.rtt_ms.value)  # the draft ends first
        assert price.make_up == pytest.approx((expected_tokens(0.8, price.k_serial) - 1) / rate)
        assert not prefill_overlap_price(cheap, 48, 0, 8, pipelined, 2).pays
    # A draft running twice as slow as its startup curve (a neighbour on its device) prefills slower
    # too: the same k's serial round costs the prompt's draft forward twice (and its drafts twice).
    slowed = overlap_stats(((1, 45.0), (2, 46.0), (64, 60.0)), draft_ms=90.0)
    fast, slow = prefill_overlap_price(cheap, 48, 0, 8), prefill_overlap_price(slowed, 48, 0, 8, remaining=3)
    d48 = 46.0 + (60.0 - 46.0) * 46 / 62
    assert slow.k_serial == 2 and slow.serial == pytest.approx(
        2 * d48 + 90.0 + slowed.timing.draft_rtt_ms.value + slowed.timing.load.forward_ms(50)
        + slowed.timing.rtt_ms.value)
    # The turn's token budget clamps the serial round's k1 (a round makes k + 1) and the pre-draft's k.
    short = prefill_overlap_price(dear, 48, 0, 8, remaining=2)
    assert fast.k_serial > 1 and short.k_serial == 1
    assert short.overlap == pytest.approx(dear.timing.load.forward_ms(48) + 1.0)  # the pre-draft: 0 past the guess
    rate = max(CostModelPolicy.tokens_per_ms(dear, k) for k in range(9))
    assert short.make_up == pytest.approx(0.8 / rate)  # E(1) - 1 = a tokens not made by the overlap's round
    # Nothing to price: no curve (calibration skipped), or no k > 0 pays (the first round is k = 0 anyway).
    assert prefill_overlap_price(overlap_stats(()), 48, 0, 8) is None
    no_rows = overlap_stats(((1, 45.0), (64, 600.0)))
    no_rows.timing.load = TargetLoad()
    assert prefill_overlap_price(no_rows, 48, 0, 8) is None
    assert prefill_overlap_price(overlap_stats(((1, 45.0), (64, 600.0)), a=0.02), 48, 0, 8) is None
    assert prefill_overlap_price(dear, 48, 0, 0) is None


def test_an_overlapped_first_round_is_not_the_policy_choosing_target_only() -> None:
    """The prefill overlap runs a turn's first round at k = 0; the policy had chosen to draft. Its
    record must not relax the acceptance towards the long-run rate nor make round 2 a probe."""
    from types import SimpleNamespace
    s = stats_with(0.9)
    s.typical.value = 0.5
    record = SimpleNamespace(draft_token_ms=0.0, target_prefilled=48, verify_ms=900.0, target_rows=48.0,
                             target_batch=1.0, target_waiting=0, verify_wall_ms=901.0, draft_wall_ms=0.0,
                             draft_ms=0.0, predraft_hit=None, predraft_branch_hit=None, drafted=0, accepted=0,
                             round_ms=901.0, steady=False, k=0, overlapped=True)
    s.observe(record)
    assert s.acceptance.value == pytest.approx(0.9) and s.rounds_since_draft == 0 and s.rounds == 1
    CostModelPolicy(probe_every=0).next_k(s, 0, 8)
    assert s.failed_probes == 0
    s.observe(SimpleNamespace(**{**vars(record), "overlapped": False}))  # a k = 0 round the policy chose
    assert s.acceptance.value < 0.9 and s.rounds_since_draft == 1


def _learned_pair(a: float = 0.73, rounds: int = 200) -> SessionStats:
    prior = SessionStats().as_pair_prior()
    accepted_per_round = [(3, 0, 4, 1)[i % 4] for i in range(rounds)]  # 8 of 11 positions at k = 4
    for accepted in accepted_per_round:
        prior.observe_round(4, accepted)
    assert prior.acceptance.value == pytest.approx(a, abs=0.08)
    return prior


def test_a_new_sessions_long_run_rate_carries_the_pairs_evidence() -> None:
    """Seeded as a 4-position guess, one first-token rejection took a new session's long-run rate
    from 0.75 to 0.59: the fast estimate then relaxed towards a rate its own dip had pulled down."""
    prior = _learned_pair()
    session = prior.new_session()
    before = session.typical.value
    session.observe_round(4, 0)
    assert session.acceptance.value < before - 0.1  # the session's pace: it follows its own text
    assert session.typical.value > before - 0.03    # the pair's long-run rate barely moves
    fresh = SessionStats().as_pair_prior().new_session()  # a fresh pair's 0.7 is only a guess
    fresh.observe_round(4, 0)
    assert fresh.typical.value < 0.6


def test_rounds_that_drafted_nothing_not_by_choice_do_not_count_as_target_only() -> None:
    """A clamped, early-stopped or fallen-back k = 0 round bumped rounds_since_draft: the next
    drafting round counted as a probe, and a rejection there froze the session at k = 0 for the
    doubled wait (117 of 120 rounds, against 16)."""
    from orchestrator.record import RoundRecord
    s = stats_with(0.75, draft_ms=10.0)
    s.observe_round(4, 4)
    s.observe_round(0, 0, chosen_k=3)  # asked for 3: an early stop at the first token
    assert s.rounds_since_draft == 0
    s.observe_round(0, 0)  # the policy's own k = 0
    assert s.rounds_since_draft == 1
    fields = {f: 0 for f in RoundRecord.__dataclass_fields__} | {
        "session_id": "s", "policy": "cost", "drafts": (), "draft_probs": (), "draft_confidences": (),
        "emitted": (5,), "text_delta": "", "finish": None, "fallback": False, "greedy": True, "steady": True}
    fields = {k: v for k, v in fields.items() if k in RoundRecord.__init__.__code__.co_varnames}
    capped = RoundRecord(**{**fields, "budget_capped": True})
    value = s.acceptance.value
    s.observe(capped, timing=False)
    assert s.rounds_since_draft == 1 and s.acceptance.value == value and s.rounds == 4


def test_a_request_pinned_to_k_0_is_not_the_policy_choosing_target_only() -> None:
    assert SpeculationConfig(policy="cost", min_k=0, max_k=8).picks_target_only
    assert not SpeculationConfig(policy="cost", min_k=0, max_k=0).picks_target_only
    assert not SpeculationConfig(policy="cost", min_k=0, max_k=0).guarded
