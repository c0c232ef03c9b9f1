"""Decode speed machinery, on CPU with tiny models: GEMM path choice, self-calibration, seeding the k
policy from it, and the guard rail that drops to target-only when the draft cannot pay for itself.
(Speed itself is measured by `specdec bench`, never asserted here.)"""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch

from orchestrator.app import measure_rtt_ms
from orchestrator.backends import WorkerDescription
from orchestrator.config import SpeculationConfig
from orchestrator.engine import seeded_stats
from orchestrator.kpolicy import CostModelPolicy, SessionStats
from specdec import linear_path
from specdec.calibration import calibrate, measure_cost_curve, measurement_order
from specdec.contract import CostCurve
from specdec.errors import WorkerUnavailable
from specdec.models import load_model
from specdec.tokenizers import HFTokenizer
from specdec.v1 import common_pb2
from specdec.worker_core import WorkerCore
from target_worker.servicer import TargetServicer
from tests.stack import start_stack
from tests.test_e2e_generate import reference_greedy


# ----------------------------------------------------------------------------- GEMM path

def dense_plan(weight_left_rows: set[int], upto: int = 16) -> linear_path.ShapePlan:
    """Weight-left exactly at `weight_left_rows` (each row count 1..upto its own grid point)."""
    grid = tuple(range(1, upto + 2))
    return linear_path.ShapePlan(False, grid, tuple(m in weight_left_rows for m in grid))


def test_weight_left_computes_the_same_product() -> None:
    linear = torch.nn.Linear(48, 80)
    x = torch.randn(3, 5, 48)
    assert torch.allclose(linear_path.weight_left(x, linear.weight, linear.bias), linear(x), atol=1e-5)
    path = linear_path.PathLinear(linear, linear_path.ShapePlan(False, (1, 15, 16), (False, True, False)))
    assert torch.allclose(path(x), linear(x), atol=1e-5)  # 3 x 5 = 15 token rows: weight-left
    assert torch.equal(path(x[:1]), linear(x[:1]))  # 5 rows: below 15, so F.linear itself


def test_weight_left_rounds_a_bias_once_in_bf16() -> None:
    # Qwen2's q/k/v projections carry a bias: added after a bf16 GEMM it rounds twice, and the
    # weight-left path drifts from the F.linear it replaces (31 % of outputs differed, a reviewer saw).
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 384).bfloat16()
    with torch.no_grad():
        linear.bias.mul_(20)
    x = torch.randn(32, 256).bfloat16()
    exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    error = {name: (y.double() - exact).abs().mean().item()
             for name, y in (("linear", linear(x)), ("weight_left", linear_path.weight_left(x, linear.weight, linear.bias)))}
    assert error["weight_left"] <= error["linear"] * 1.05, error


def test_a_dense_plan_takes_the_choice_of_the_measured_count_below() -> None:
    plan = linear_path.ShapePlan(False, (1, 2, 4, 64), (False, True, False, True))
    assert [plan.weight_left_at(m) for m in (1, 2, 3, 4, 63, 64, 500)] == [False, True, True, False, False, True, True]
    assert plan.swaps and not linear_path.ShapePlan(False, (1, 2), (False, False)).swaps
    assert linear_path.ShapePlan(packed=True).swaps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_path_computes_the_same_product_and_holds_one_copy(dtype: torch.dtype) -> None:
    if not linear_path.packing_supported(dtype):  # e.g. bf16 on an AVX2-only CPU
        pytest.skip(f"oneDNN packing refuses {dtype} on this CPU")
    linear = torch.nn.Linear(48, 80).to(dtype)
    path = linear_path.PathLinear(linear, linear_path.ShapePlan(packed=True))
    assert path.weight is None and path.packed is not None  # the dense weight is dropped, not kept beside
    for shape in ((1, 1, 48), (3, 5, 48), (64, 48)):
        x = torch.randn(*shape).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(path(x).float(), linear(x).float(), atol=tol, rtol=tol)
    assert path(torch.randn(2, 7, 48).to(dtype)[:, 1:]).shape == (2, 6, 80)  # a non-contiguous slice
    with pytest.raises(RuntimeError, match="packed"):  # not a cast of the bias alone, then a oneDNN error
        path.to(torch.float16)


def test_apply_swaps_only_the_chosen_shapes_and_keeps_the_weights() -> None:
    model = load_model("tiny:seed=0").model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    choice = linear_path.PathChoice({(128, 64): dense_plan({2, 3})})  # the MLP up/gate projections
    swapped = linear_path.apply(model, choice)
    paths = [m for m in model.modules() if isinstance(m, linear_path.PathLinear)]
    assert swapped == len(paths) > 0 and all((p.out_features, p.in_features) == (128, 64) for p in paths)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _all_shapes(model: torch.nn.Module) -> set[tuple[int, int]]:
    return {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)}


def test_greedy_output_is_unchanged_with_weight_left_everywhere() -> None:
    reference = reference_greedy([5, 6, 7], 20)
    loaded = load_model("tiny:seed=0")
    plans = {s: dense_plan(set(range(1, 17))) for s in _all_shapes(loaded.model)}
    linear_path.apply(loaded.model, linear_path.PathChoice(plans))
    out = loaded.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False)
    assert out[0, 3:].tolist() == reference


@pytest.mark.skipif(not linear_path.packing_supported(torch.float32), reason="torch built without oneDNN")
def test_greedy_output_is_unchanged_with_packed_weights_everywhere() -> None:
    reference = reference_greedy([5, 6, 7], 20)
    loaded = load_model("tiny:seed=0")
    plans = {s: linear_path.ShapePlan(packed=True) for s in _all_shapes(loaded.model)}
    assert linear_path.apply(loaded.model, linear_path.PathChoice(plans)) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.model.modules())
    out = loaded.model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False)
    assert out[0, 3:].tolist() == reference


def test_a_cpu_that_refuses_packing_keeps_the_dense_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN refuses bf16 packing on CPUs without AVX-512 BF16 (a RuntimeError at reorder): the probe
    says so once and the worker keeps F.linear / weight-left instead of failing at startup."""
    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear_path, "pack", refuse)
    linear_path.packing_supported.cache_clear()
    try:
        assert not linear_path.packing_supported(torch.float32)
        model = load_model("tiny:seed=0").model
        choice = linear_path.measure(model, max_m=2, budget_s=60, reps=1)
        assert choice.complete and choice.plans and not any(p.packed for p in choice.plans.values())
        assert all(linear_path.PACKED not in t for t in choice.timings.values())
    finally:
        linear_path.packing_supported.cache_clear()  # the next test probes the real oneDNN again


def test_a_slow_spell_costs_every_path_one_run_not_one_path_all_its_runs() -> None:
    """Paths timed in turn: a slow spell (10x) as long as a round of the paths spoils at most one run
    of each, and the best of two still finds each path's own cost. Timed back to back, the same spell
    spoils both timed runs of the path it falls on."""
    now = [0.0]
    spell = (1.0, 12.0)

    def path(cost_ms: float):
        def run() -> None:
            slow = spell[0] <= now[0] < spell[1]
            now[0] += cost_ms * (10.0 if slow else 1.0)
        return run

    def clock() -> float:
        return now[0] / 1000.0

    ms = linear_path.best_ms({"linear": path(1.0), "packed": path(0.5)}, reps=2, clock=clock)
    assert ms == pytest.approx({"linear": 1.0, "packed": 0.5})
    # Warm-ups (the packed one in the spell), a round in the spell (linear spoiled), a clean round
    # in the other order.
    assert now[0] == pytest.approx(1.0 + 5.0 + (10.0 + 0.5) + (0.5 + 1.0))
    now[0] = 0.0
    assert linear_path.best_ms({"linear": path(1.0)}, reps=2, clock=clock) == {"linear": pytest.approx(10.0)}


def test_tied_weights_are_never_packed() -> None:
    """Packing a weight another module also holds would keep two copies of it."""
    model = load_model("tiny:seed=0").model
    model.lm_head.weight = model.get_input_embeddings().weight
    choice = linear_path.measure(model, max_m=2, budget_s=60, reps=1)
    vocab_shape = (model.lm_head.out_features, model.lm_head.in_features)
    assert linear_path.PACKED not in choice.timings[vocab_shape] and not choice.plans[vocab_shape].packed
    if linear_path.packing_supported(torch.float32):  # the control: untied shapes were offered packing
        assert all(linear_path.PACKED in t for s, t in choice.timings.items() if s != vocab_shape)


def test_owning_the_tensors_keeps_values_and_ties() -> None:
    """After packing, the rest of the model is copied out of the (memory-mapped) checkpoint: the values
    and the tied weights stay as they were."""
    from specdec.models import own_tensors
    model = load_model("tiny:seed=0").model
    model.lm_head.weight = model.get_input_embeddings().weight
    before = {name: (t.data_ptr(), t.clone()) for name, t in model.state_dict(keep_vars=True).items()}
    own_tensors(model)
    after = model.state_dict(keep_vars=True)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n][1], after[n]) and before[n][0] != after[n].data_ptr() for n in before)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def _fake_timer(ms: dict[str, dict[int, float]]) -> linear_path._ShapeTimer:
    timer = linear_path._ShapeTimer.__new__(linear_path._ShapeTimer)
    timer.ms = ms
    return timer


def test_the_plan_weighs_every_decode_count_and_guards_the_prompt_chunk() -> None:
    decode = [1, 2, 4]
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 64: 4.0}
    # Packed wins at every count: packed.
    plan = linear_path._plan(_fake_timer({"linear": {1: 2.0, 2: 4.0, 4: 8.0, 64: 8.0}, "weight_left": dict(flat),
                                          "packed": {1: 0.5, 2: 0.5, 4: 0.5, 64: 4.0}}), decode, 64)
    assert plan.packed
    # Packed wins the decode counts but makes a prompt chunk 2x slower: dense, weight-left where it wins.
    plan = linear_path._plan(_fake_timer({"linear": {1: 1.0, 2: 4.0, 4: 8.0, 64: 4.0}, "weight_left": dict(flat),
                                          "packed": {1: 0.5, 2: 0.5, 4: 0.5, 64: 8.0}}), decode, 64)
    assert not plan.packed and [plan.weight_left_at(m) for m in (1, 2, 4, 64)] == [False, True, True, False]
    # Packed wins one count by a little and loses two by a lot: dense.
    plan = linear_path._plan(_fake_timer({"linear": dict(flat), "weight_left": {1: 9.0, 2: 9.0, 4: 9.0, 64: 9.0},
                                          "packed": {1: 0.9, 2: 3.0, 4: 3.0, 64: 4.0}}), decode, 64)
    assert not plan.packed and not plan.swaps
    # No packed timings (no oneDNN, or a tied weight): dense.
    assert not linear_path._plan(_fake_timer({"linear": dict(flat), "weight_left": dict(flat)}), decode, 64).packed


def test_measure_takes_packed_at_the_end_points_and_drops_a_shape_the_budget_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic timings: one shape where packed wins at M = 1, the middle, max_m and the prompt
    chunk (the rest is not timed), one where it loses (the whole grid is timed), and a budget that
    ends inside the third shape (dropped: it stays F.linear, and the choice says incomplete)."""
    model = load_model("tiny:seed=0").model
    order = sorted(_all_shapes(model), key=lambda s: -s[0] * s[1] * sum(
        1 for m in model.modules() if isinstance(m, torch.nn.Linear) and (m.out_features, m.in_features) == s))
    wins, loses = order[0], order[1]
    timed: dict[tuple[int, int], list[int]] = {}
    now = [0.0]

    def fake_time(self: linear_path._ShapeTimer, m: int, only: tuple[str, ...] | None = None) -> None:
        shape = (self.linears[0].out_features, self.linears[0].in_features)
        timed.setdefault(shape, []).append(m)
        now[0] += 1.0
        packed = 0.5 if shape == wins else 3.0
        self.ms[linear_path.LINEAR][m], self.ms[linear_path.WEIGHT_LEFT][m] = 2.0, 1.0 if m == 2 else 4.0
        self.ms.setdefault(linear_path.PACKED, {})[m] = packed

    monkeypatch.setattr(linear_path._ShapeTimer, "time", fake_time)
    monkeypatch.setattr(linear_path, "packing_supported", lambda dtype: True)
    monkeypatch.setattr(linear_path, "pack", lambda weight: weight)  # nothing is run: no oneDNN needed
    grid = linear_path.measured_ms(8)  # [1, 2, 3, 4, 6, 8]
    ends = [1, grid[len(grid) // 2], 8, linear_path.PREFILL_ROWS]
    budget = len(ends) + len(grid) + 1 + 2.5  # each timing is a second: both shapes, then into the third
    choice = linear_path.measure(model, max_m=8, budget_s=budget, reps=1, clock=lambda: now[0])
    assert timed[wins] == ends and choice.plans[wins].packed
    assert sorted(timed[loses]) == sorted(grid + [linear_path.PREFILL_ROWS]) and not choice.plans[loses].packed
    assert choice.plans[loses].weight_left_at(2) and not choice.plans[loses].weight_left_at(3)
    assert len(timed) == 3 and order[2] not in choice.plans and not choice.complete


def test_measure_respects_its_budget() -> None:
    model = load_model("tiny:seed=0").model
    ticks = itertools.count()
    choice = linear_path.measure(model, max_m=8, budget_s=3, reps=1, clock=lambda: next(ticks))
    assert not choice.complete and "budget ran out" in choice.summary()
    full = linear_path.measure(model, max_m=5, budget_s=60, reps=1)
    assert full.complete and set(full.timings) == set(full.plans) == _all_shapes(model)
    for shape, timing in full.timings.items():
        # The end points, the middle and a prompt chunk always; the rest unless packed won at those.
        assert {1, 3, 5, linear_path.PREFILL_ROWS} <= set(timing["linear"]) <= {1, 2, 3, 4, 5, linear_path.PREFILL_ROWS}
        if len(timing["linear"]) < 6:
            assert full.plans[shape].packed
    dense = linear_path.measure(model, max_m=5, budget_s=60, reps=1, allow_packing=False)
    assert all(set(t["linear"]) == {1, 2, 3, 4, 5, 64} and "packed" not in t for t in dense.timings.values())
    assert not any(p.packed for p in dense.plans.values())
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


def test_the_cost_curve_pays_what_a_new_attention_shape_costs() -> None:
    """Serving almost never repeats an attention shape (rows, key length): the context grows every
    step. Where a backend sets up per shape (on the H200 a new shape cost 76.5 against 32 ms a step,
    likely cuDNN attention's graphs), served steps were dear while the curve, which timed each shape
    twice and kept the second, saw the cheap repeat. Each timed run now has a key length of its own."""
    model = load_model("tiny:seed=0").model
    seen: set[tuple[int, int]] = set()

    class PerShapeSetup(torch.nn.Module):
        """The tiny model, 30 ms slower on a (rows, key length) pair it has not run before."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(self, input_ids, past_key_values, **kwargs):
            shape = (input_ids.shape[1], past_key_values.get_seq_length())
            if shape not in seen:
                seen.add(shape)
                time.sleep(0.03)
            return self.inner(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    curve = measure_cost_curve(PerShapeSetup(), 260, max_tokens=2, contexts=(8,), budget_s=30)
    assert curve.points and all(ms >= 30.0 for _, _, ms in curve.points), curve.points


def test_a_calibration_point_above_a_larger_one_is_noise() -> None:
    """Contention only adds time: one slow point must not price every larger k and batch as slow."""
    noisy = CostCurve(((1, 64, 304.0), (3, 64, 849.0), (5, 64, 236.0), (9, 64, 296.0), (32, 64, 620.0),
                       (1, 256, 999.0)))
    assert noisy.rows_curve() == ((1, 236.0), (3, 236.0), (5, 236.0), (9, 296.0), (32, 620.0))
    assert noisy.ms(3) == 236.0 and noisy.ms(7) == pytest.approx(266.0)
    steady = CostCurve(((1, 64, 100.0), (4, 64, 150.0), (9, 64, 300.0)))
    assert steady.rows_curve() == ((1, 100.0), (4, 150.0), (9, 300.0))  # a rising curve is kept as measured
    seeded = seeded_stats(describe(noisy.points), describe(noisy.points), max_k=8)
    assert seeded.timing.verify_by_k[2].value == 236.0  # k = 2 verifies 3 tokens
    assert seeded.timing.load.forward_ms(16) < 620.0


def test_a_curve_that_repeats_a_token_count_prices_without_dividing_by_zero() -> None:
    """A GetInfo curve with one token count twice: the draft's rows curve kept both points, and the
    slope past its end divided by zero (ZeroDivisionError in next_k: INTERNAL)."""
    from specdec.curves import extended
    repeated = CostCurve(((1, 64, 2.0), (2, 64, 2.5), (2, 64, 2.2)))
    assert repeated.rows_curve() == ((1, 2.0), (2, 2.2))
    assert extended(((1, 2.0), (2, 2.2), (2, 2.3)), 8) == pytest.approx(2.3)  # flat past a vertical step
    seeded = seeded_stats(describe(repeated.points), describe(repeated.points), max_k=4)
    assert seeded.timing.draft_rows_factor(3) > 0


def test_a_calibration_budget_that_is_not_a_number_is_refused() -> None:
    """NaN passed the `budget <= 0` skip and then no `elapsed > budget` ever held: no budget at all."""
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    for budget in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite"):
            calibrate(core, max_k=3, budget_s=budget)


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


def test_swapping_the_paths_in_is_not_charged_to_the_cost_curve(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Packing a large model's weights takes seconds whatever the budget: charged to the budget, it
    left the curve only its always-measured points. A fake clock: swapping in takes 100 s."""
    import logging
    import time
    offset = [0.0]
    real_monotonic = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset[0])

    def slow_apply(model: torch.nn.Module, choice: linear_path.PathChoice, copies: object = None) -> int:
        offset[0] += 100.0
        return 0

    monkeypatch.setattr(linear_path, "measure", lambda model, max_m, budget_s, **kw: linear_path.PathChoice(seconds=0.5))
    monkeypatch.setattr(linear_path, "apply", slow_apply)
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    with caplog.at_level(logging.INFO, logger="specdec.linear_path"):
        calibrate(core, max_k=3, budget_s=30)
    assert "(0.5s measuring, 100.0s swapping in, 0 linears swapped)" in caplog.text
    # 1..max_k + 1 and the batched rows, not only the end points and the largest load.
    assert sorted({t for t, _, _ in core.cost_curve.points}) == [1, 2, 3, 4, 16, 32, 64]


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
    # Below the smallest measured k: that cost scaled by the token count (k + 1 of the 7 tokens at
    # k = 6), never the fitted line's intercept, which k = 6 and 8 put near 440 ms: k = 0 is priced
    # at a seventh of k = 6, not like k = 8.
    assert costs[0] == pytest.approx(costs[6] / 7) and costs[3] == pytest.approx(costs[6] * 4 / 7)
    assert costs[0] < 0.2 * costs[8]
    # Envelope: k = 7 and 8 never cheaper than k = 6 (whose price the k = 8 rounds pull down to
    # theirs, as the model is monotone: a smaller k never costs more).
    assert costs[6] == costs[7] == costs[8] and 500.0 < costs[6] < 520.0


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


async def test_a_far_draft_is_priced_from_the_startup_ping() -> None:
    """Every draft call waits 100 ms (a draft on a far node; its compute is cheap). The orchestrator's
    startup ping (GetInfo) measures that, so the very first round of a fresh deployment runs k = 0
    (with the old 1 ms guess, it drafted)."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.04", draft_call_delay_ms=100.0)
    try:
        timing = stack.orch.engine.seed_stats.timing
        assert timing.draft_rtt_ms.value >= 100.0 and timing.rtt_ms.value < 100.0  # the target is near
        reply = await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=40)
        assert list(reply.token_ids) == reference_greedy([5, 6, 7], 40)
        assert list(reply.stats.k_per_round)[0] == 0, list(reply.stats.k_per_round)
    finally:
        await stack.close()


async def test_the_startup_ping_takes_the_fastest_call_and_gives_up_quietly() -> None:
    class Worker:
        def __init__(self, delays_s: list[float], fail_after: int | None = None) -> None:
            self.delays_s, self.fail_after, self.calls = delays_s, fail_after, 0

        async def describe(self, timeout_s: float) -> None:
            if self.fail_after is not None and self.calls >= self.fail_after:
                raise WorkerUnavailable("draft 127.0.0.1:1: connection refused")
            await asyncio.sleep(self.delays_s[self.calls])
            self.calls += 1

    worker = Worker([0.2, 0.02, 0.1])  # the first call also pays for the connection, say
    assert 20.0 <= await measure_rtt_ms(worker, "draft") < 100.0 and worker.calls == 3
    assert 20.0 <= await measure_rtt_ms(Worker([0.02, 0.02], fail_after=1), "draft") < 200.0
    assert await measure_rtt_ms(Worker([], fail_after=0), "target") is None  # the policies keep their guess


def test_get_info_does_not_hash_the_vocabulary_on_every_call() -> None:
    """GetInfo is the startup RTT ping. It reported the tokenizer's fingerprint by sorting and hashing
    the 150k-token vocabulary each time: about 290 ms per call on a 2-core CPU, which the ping took
    for network latency (loadtest runs 18 and 19 started with a 290 ms draft RTT)."""
    class Vocabulary:
        calls = 0

        def get_vocab(self) -> dict[str, int]:
            Vocabulary.calls += 1
            return {"a": 0, "b": 1}

    tokenizer = HFTokenizer(Vocabulary(), [1])
    assert tokenizer.fingerprint() == tokenizer.fingerprint() and Vocabulary.calls == 1


async def test_a_new_session_keeps_the_pairs_probe_backoff() -> None:
    """Where drafting keeps losing (a far draft), the cost policy probes after 16 target-only rounds,
    then 32, 64, ... A new session on the same pair continues that back-off instead of probing after
    16 rounds again. (The pair guard is off here: it would take the rounds over.)"""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.04", draft_call_delay_ms=100.0,
                              speculation=SpeculationConfig(guard=False))
    try:
        first = list((await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=60)).stats.k_per_round)
        probes = [i for i, k in enumerate(first) if k > 0]
        assert probes == [16, 49], first  # waits of 16, then 32 target-only rounds
        prior = stack.orch.engine.prior_for("any")
        # The pair's rounds since it last drafted: the turn's last round (one token left, no room to
        # draft) was not the policy's k = 0 and does not count.
        since = len(first) - 2 - probes[-1]
        assert prior.failed_probes == 2 and prior.rounds_since_draft == since
        reply = await stack.generate(prompt_ids=[5, 6, 8], max_new_tokens=60)
        assert list(reply.token_ids) == reference_greedy([5, 6, 8], 60)
        later = list(reply.stats.k_per_round)
        # The next probe is due 64 rounds after the pair's last one (a fresh back-off would have probed
        # 16 rounds after it, and again 32 later).
        assert [i for i, k in enumerate(later) if k > 0] == [64 - since], (since, later)
    finally:
        await stack.close()


async def test_a_callers_target_only_request_does_not_put_the_pair_into_target_only() -> None:
    """A request pinned to k = 0 (fixed_k = 0) is the caller's choice, not a sign that drafting
    loses: the pair's prior does not count its rounds as a target-only stretch. Otherwise the next
    session would start mid back-off, and one unlucky first round would keep it at k = 0 until a
    probe (seen in netbench: a serial request right after a target-only one ran 97 % of its rounds
    at k = 0)."""
    stack = await start_stack(draft_ref="tiny:seed=0,noise=0.001", speculation=SpeculationConfig(guard=False))
    try:
        pinned = await stack.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, speculation={"fixed_k": 0})
        assert set(pinned.stats.k_per_round) == {0} and len(pinned.stats.k_per_round) == 30
        prior = stack.orch.engine.prior_for("any")
        assert prior.rounds_since_draft == 0 and prior.failed_probes == 0
        # k = 0 rounds the policy chose do count (here it soon finds the tiny draft not worth it).
        chosen = await stack.generate(prompt_ids=[5, 6, 8], max_new_tokens=30)
        assert list(chosen.token_ids) == reference_greedy([5, 6, 8], 30)
        ks = list(chosen.stats.k_per_round)
        trailing = len(ks) - 1 - max(i for i, k in enumerate(ks) if k > 0)
        # Less the turn's last round: one token left, no room to draft, not the policy's choice.
        assert trailing > 1 and prior.rounds_since_draft == trailing - 1, ks
    finally:
        await stack.close()


def test_target_calibration_measures_load_points_even_on_a_tight_budget() -> None:
    model = load_model("tiny:seed=0").model
    curve = measure_cost_curve(model, 260, max_tokens=5, contexts=(8,), budget_s=1e-9, load_tokens=(16, 32))
    # The end points and the largest batched row count always; the rest only within budget.
    assert {t for t, _, _ in curve.points} == {1, 5, 32}
    full = measure_cost_curve(model, 260, max_tokens=3, contexts=(8,), budget_s=30, load_tokens=(16, 32))
    assert [t for t, _ in full.rows_curve()] == [1, 2, 3, 16, 32]


@pytest.mark.parametrize("role, gemm_share", [("draft", 0.7), ("target", 0.5)])
def test_the_cost_curve_keeps_its_share_whatever_the_gemm_path_took(monkeypatch: pytest.MonkeyPatch, role: str,
                                                                    gemm_share: float) -> None:
    """A fallback between kinds of weight copies measures the GEMM path twice (up to the whole
    budget): the cost curve, which seeds the k policy, still gets the share the GEMM path was not
    given. A draft's GEMM path gets the larger share (its curve is two row counts; its GEMM path
    makes, checks and times copies per shape)."""
    from specdec import calibration
    budgets: dict[str, float] = {}

    def gemm(model: object, max_m: int, budget_s: float, **kw: object) -> object:
        budgets["gemm"] = budget_s
        return linear_path.PathChoice(seconds=30.0)  # far over its share

    def curve(model: object, vocab: int, max_tokens: int, contexts: object, budget_s: float, **kw: object) -> object:
        budgets["curve"] = budget_s
        raise StopIteration  # the budget is all this test needs
    monkeypatch.setattr(linear_path, "choose_and_apply", gemm)
    monkeypatch.setattr(calibration, "measure_cost_curve", curve)
    core = WorkerCore(load_model("tiny:seed=0"), role)
    with pytest.raises(StopIteration):
        calibrate(core, max_k=3, budget_s=20, reduced_kind=("int4", "bf16"))
    assert budgets == {"gemm": pytest.approx(20 * gemm_share), "curve": pytest.approx(20 * (1 - gemm_share))}
