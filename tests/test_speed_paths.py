"""Decode speed machinery, on CPU with tiny models: GEMM path choice, self-calibration, seeding the k
policy from it, and the guard rail that drops to target-only when the draft cannot pay for itself.
(Speed itself is measured by `specdec bench`, never asserted here.)"""
from __future__ import annotations

import itertools

import pytest
import torch

from orchestrator.backends import WorkerDescription
from orchestrator.engine import seeded_stats
from orchestrator.kpolicy import CostModelPolicy, SessionStats
from specdec import linear_path
from specdec.calibration import calibrate, measure_cost_curve, measurement_order
from specdec.contract import CostCurve
from specdec.models import load_model
from specdec.v1 import common_pb2
from specdec.worker_core import WorkerCore
from target_worker.servicer import TargetServicer
from tests.stack import start_stack
from tests.test_e2e_generate import reference_greedy


# ----------------------------------------------------------------------------- GEMM path

def test_weight_left_computes_the_same_product() -> None:
    linear = torch.nn.Linear(48, 80)
    x = torch.randn(3, 5, 48)
    assert torch.allclose(linear_path.weight_left(x, linear.weight, linear.bias), linear(x), atol=1e-5)
    path = linear_path.PathLinear(linear, frozenset({15}))  # 3 x 5 = 15 token rows
    assert torch.allclose(path(x), linear(x), atol=1e-5)
    assert torch.equal(path(x[:1]), linear(x[:1]))  # other token counts: F.linear itself


def test_apply_swaps_only_the_chosen_shapes_and_keeps_the_weights() -> None:
    model = load_model("tiny:seed=0").model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    choice = linear_path.PathChoice({(128, 64): frozenset({2, 3})})  # the MLP up/gate projections
    swapped = linear_path.apply(model, choice)
    paths = [m for m in model.modules() if isinstance(m, linear_path.PathLinear)]
    assert swapped == len(paths) > 0 and all((p.out_features, p.in_features) == (128, 64) for p in paths)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_greedy_output_is_unchanged_with_weight_left_everywhere() -> None:
    reference = reference_greedy([5, 6, 7], 20)
    loaded = load_model("tiny:seed=0")
    shapes = {(m.out_features, m.in_features) for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)}
    linear_path.apply(loaded.model, linear_path.PathChoice({s: frozenset(range(1, 17)) for s in shapes}))
    out = loaded.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False)
    assert out[0, 3:].tolist() == reference


def test_measure_respects_its_budget() -> None:
    model = load_model("tiny:seed=0").model
    ticks = itertools.count()
    choice = linear_path.measure(model, max_m=8, budget_s=3, reps=1, clock=lambda: next(ticks))
    assert not choice.complete and "budget ran out" in choice.summary()
    full = linear_path.measure(model, max_m=5, budget_s=60, reps=1)
    assert full.complete and set(full.speedup) == set(full.weight_left_ms)
    assert all(set(gains) == {1, 2, 3, 4, 5} for gains in full.speedup.values())
    assert all(ms <= set(range(1, 6)) for ms in full.weight_left_ms.values())
    assert linear_path.measured_ms(9) == [1, 2, 3, 4, 6, 8, 9]


# ----------------------------------------------------------------------------- self-calibration

def test_measurement_order_brackets_the_range_first() -> None:
    assert measurement_order(1) == [1]
    order = measurement_order(9)
    assert order[:4] == [1, 9, 5, 3] and sorted(order) == list(range(1, 10))


def test_cost_curve_measures_and_interpolates() -> None:
    model = load_model("tiny:seed=0").model
    curve = measure_cost_curve(model, 260, max_tokens=5, contexts=(8, 32), budget_s=30)
    assert {(t, c) for t, c, _ in curve.points} == {(t, c) for t in range(1, 6) for c in (8, 32)}
    assert all(ms > 0 for _, _, ms in curve.points)
    assert measure_cost_curve(model, 260, 5, (8,), budget_s=0) == CostCurve()
    sparse = CostCurve(((1, 64, 10.0), (5, 64, 30.0), (1, 512, 99.0)))
    assert sparse.ms(1) == 10.0 and sparse.ms(3) == 20.0 and sparse.ms(5) == 30.0 and sparse.ms(6) is None
    assert CostCurve.from_pb(sparse.to_pb()) == sparse


async def test_workers_report_their_curve_in_get_info() -> None:
    # Its own model: calibration may swap linears, and the tests' cached models must stay as built.
    servicer = TargetServicer(WorkerCore(load_model("tiny:seed=0"), "target"))
    try:
        calibrate(servicer.core, max_k=3, budget_s=20)
        info = await servicer.GetInfo(common_pb2.GetInfoRequest(), None)
        # 1..max_k+1 for the verify, and the batched rows (load pricing, prompt chunk size).
        assert sorted({c.tokens for c in info.forward_costs}) == [1, 2, 3, 4, 16, 32, 64]
        assert info.gemm_path  # what was chosen, for operators
    finally:
        servicer.close()


# ----------------------------------------------------------------------------- seeding the policy

def describe(points: tuple[tuple[int, int, float], ...]) -> WorkerDescription:
    return WorkerDescription("w", "m", 260, 4096, [257], "", CostCurve(points))


def test_first_round_k_comes_from_the_measured_curves() -> None:
    flat_target = describe(tuple((t, 64, 100.0 + t) for t in range(1, 10)))
    cheap_draft = describe(((1, 64, 5.0), (2, 64, 6.0)))
    slow_draft = describe(((1, 64, 150.0), (2, 64, 160.0)))
    fast = seeded_stats(cheap_draft, flat_target, max_k=8)
    assert set(fast.timing.verify_by_k) == set(range(9)) and fast.timing.verify_ms(0) == pytest.approx(101.0)
    assert CostModelPolicy().next_k(fast, 0, 8) > 0
    assert CostModelPolicy().next_k(seeded_stats(slow_draft, flat_target, max_k=8), 0, 8) == 0
    # A target whose cost grows linearly with tokens (small-M GEMM cliff): speculation cannot win.
    linear_target = describe(tuple((t, 64, 100.0 * t) for t in range(1, 10)))
    assert CostModelPolicy().next_k(seeded_stats(cheap_draft, linear_target, max_k=8), 0, 8) == 0


def test_verify_model_is_monotone_and_small_k_never_inherits_the_intercept() -> None:
    stats = SessionStats()
    for _ in range(5):  # cold start that only ever saw k = 8 (and a noisy k = 6)
        stats.timing.observe_verify(8, 500.0)
        stats.timing.observe_verify(6, 520.0)
    costs = [stats.timing.verify_ms(k) for k in range(0, 12)]
    assert costs == sorted(costs)
    assert costs[0] < costs[8]  # k = 0 is not priced like k = 8
    assert stats.timing.verify_ms(7) == pytest.approx(520.0)  # envelope: never cheaper than a smaller k


# ----------------------------------------------------------------------------- the guard rail

async def test_a_slow_draft_drops_the_default_policy_to_target_only() -> None:
    """The draft is made 40x slower than the target per forward: within a few rounds the default
    policy stops drafting (apart from its periodic one-token probe), and the output stays exact."""
    import time
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.04")
    try:
        core = stack.draft.core
        feed = core.feed

        def slow_feed(session, tokens, logits_rows=0):
            time.sleep(0.04)
            return feed(session, tokens, logits_rows)
        core.feed = slow_feed
        reply = await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=60)
        assert list(reply.token_ids) == reference_greedy([5, 6, 7], 60)
        ks = list(reply.stats.k_per_round)
        first_zero = ks.index(0)
        assert first_zero <= 4, ks
        after = ks[first_zero:]
        assert sum(1 for k in after if k > 0) <= len(after) // 16 + 1, ks  # only the probes draft
    finally:
        await stack.close()


def test_target_calibration_measures_load_points_even_on_a_tight_budget() -> None:
    model = load_model("tiny:seed=0").model
    curve = measure_cost_curve(model, 260, max_tokens=5, contexts=(8,), budget_s=1e-9, load_tokens=(16, 32))
    # The end points and the largest batched row count always; the rest only within budget.
    assert {t for t, _, _ in curve.points} == {1, 5, 32}
    full = measure_cost_curve(model, 260, max_tokens=3, contexts=(8,), budget_s=30, load_tokens=(16, 32))
    assert [t for t, _ in full.rows_curve()] == [1, 2, 3, 16, 32]
