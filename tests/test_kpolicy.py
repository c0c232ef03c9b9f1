"""Adaptive-k policies decide from synthetic statistics (no gRPC)."""
from __future__ import annotations

import pytest

from orchestrator.config import SpeculationConfig
from orchestrator.kpolicy import (CostModelPolicy, DecayingLine, FixedPolicy, HeuristicPolicy, SessionStats,
                             expected_tokens, speedup_bound)


def stats_with(acceptance: float, draft_ms: float = 10.0, verify_base: float = 50.0, verify_slope: float = 2.0,
               rtt: float = 1.0) -> SessionStats:
    s = SessionStats()
    s.acceptance.value = acceptance
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
