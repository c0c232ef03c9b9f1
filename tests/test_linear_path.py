"""The GEMM path's measurement (specdec/linear_path.py): a layer larger than COLD_BYTES timed on a
slice of its rows, the check that a path computes F.linear's product before it may be chosen, and
`--gemm-path library`. Tiny models on CPU; the timings are faked where a test needs one path to win."""
from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from specdec import linear_path
from specdec.calibration import calibrate
from specdec.models import load_model
from specdec.worker_core import WorkerCore

DTYPES = [torch.float32, torch.bfloat16]


def _favouring(fast: str) -> Callable[..., dict[str, float]]:
    """A best_ms that runs every path once (as the real one does) and says `fast` is 10x faster."""
    def best_ms(runs: dict[str, Callable[[], object]], reps: int, **kwargs: object) -> dict[str, float]:
        for run in runs.values():
            run()
        return {path: 0.1 if path == fast else 1.0 for path in runs}
    return best_ms


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, linear_path.PathLinear))]


def test_a_packed_path_that_is_off_by_1e_3_is_never_chosen(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A float32 packed product 0.1 % off (what a path computing in a coarser type looks like) is
    dropped before timing, however fast it is; before the check it was chosen for every shape."""
    if not linear_path.packing_supported(torch.float32):
        pytest.skip("oneDNN packing refuses float32 here")
    honest = linear_path.packed_linear
    monkeypatch.setattr(linear_path, "packed_linear", lambda *args: honest(*args) * (1 + 1e-3))
    monkeypatch.setattr(linear_path, "best_ms", _favouring(linear_path.PACKED))
    model = load_model("tiny:seed=0").model
    with caplog.at_level(logging.WARNING, logger="specdec.linear_path"):
        choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1)
    assert choice.complete and choice.plans
    assert not any(plan.packed for plan in choice.plans.values())
    assert all(linear_path.PACKED not in timing for timing in choice.timings.values())
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "packed" in r.getMessage()]
    assert len(warned) == len(choice.plans), caplog.text  # once per shape
    assert "reduction-order tolerance" in warned[0].getMessage()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wrong_weight_left_is_never_chosen(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                             dtype: torch.dtype) -> None:
    """Weight-left reading the weight in the wrong layout (its storage taken as [in, out]): dropped,
    so no row count of any shape runs it, however fast it is."""
    def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.matmul(x, weight.reshape(weight.shape[1], weight.shape[0]))
        return y if bias is None else y + bias

    monkeypatch.setattr(linear_path, "weight_left", transposed)
    monkeypatch.setattr(linear_path, "best_ms", _favouring(linear_path.WEIGHT_LEFT))
    model = load_model("tiny:seed=0", dtype).model
    with caplog.at_level(logging.WARNING, logger="specdec.linear_path"):
        choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1)
    assert choice.complete and choice.plans
    assert not any(plan.weight_left_at(m) for plan in choice.plans.values() for m in range(1, 70))
    assert all(linear_path.WEIGHT_LEFT not in timing for timing in choice.timings.values())
    assert sum("weight_left" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == len(
        choice.plans)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_honest_paths_agree_with_f_linear(dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    """Weight-left and the packed path differ from F.linear only in the order of the sums: within the
    tolerance, with and without a (large, as Qwen2's k/v projections have) bias, at decode and prompt
    row counts; and a whole tiny model's measurement drops no path."""
    torch.manual_seed(0)
    packs = linear_path.packing_supported(dtype)
    for out_features, in_features, bias in ((80, 48, True), (256, 1536, True), (1536, 256, False),
                                            (512, 4096, False)):
        linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
        if bias:
            with torch.no_grad():
                linear.bias.mul_(50)
        packed = linear_path.pack(linear.weight) if packs else None
        for m in (1, 3, 16, 64):
            x = torch.randn(m, in_features).to(dtype)
            reference = F.linear(x, linear.weight, linear.bias)
            paths = {"weight_left": linear_path.weight_left(x, linear.weight, linear.bias)}
            if packed is not None:
                paths["packed"] = linear_path.packed_linear(x, packed, linear.bias, out_features)
            for path, y in paths.items():
                error = linear_path.agreement(y, reference, x, linear.weight, linear.bias)
                assert error <= 1.0, (path, dtype, out_features, in_features, m, error)
    model = load_model("tiny:seed=0", dtype).model
    with caplog.at_level(logging.WARNING, logger="specdec.linear_path"):
        choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    expected = {linear_path.LINEAR, linear_path.WEIGHT_LEFT} | ({linear_path.PACKED} if packs else set())
    assert all(set(timing) == expected for timing in choice.timings.values())


def test_the_tolerance_rejects_a_coarser_product() -> None:
    """The tolerance admits reduction order, not precision: a float32 product of bf16-rounded operands,
    a 0.1 % scale, another dtype or a NaN are all out; a bf16 output one ulp off is in."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(1536, 256)
    x = torch.randn(3, 1536)
    reference = F.linear(x, linear.weight, linear.bias)
    coarse = F.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias)
    assert linear_path.agreement(coarse, reference, x, linear.weight, linear.bias) > 10
    assert linear_path.agreement(reference * (1 + 1e-3), reference, x, linear.weight, linear.bias) > 10
    assert linear_path.agreement(reference.double(), reference, x, linear.weight, linear.bias) == float("inf")
    nan = reference.clone()
    nan[0, 0] = float("nan")
    assert linear_path.agreement(nan, reference, x, linear.weight, linear.bias) == float("inf")
    half = reference.bfloat16()
    one_ulp = torch.nextafter(half, torch.full_like(half, float("inf")))
    assert linear_path.agreement(one_ulp, half, x, linear.weight, linear.bias.bfloat16()) <= 1.0


def test_a_weight_row_of_large_norm_does_not_fail_an_honest_path() -> None:
    """Each output's tolerance scales with its own terms: a row 300x the others rounds its sums
    300x coarser. Against one scale for the whole output (the product's RMS) an honest blocked or
    sequential float32 sum of such a layer was over the tolerance, and the path would be dropped."""
    torch.manual_seed(2)
    weight = torch.randn(1024, 4096) * 0.02
    weight[7] *= 300.0
    for m in (1, 16):
        x = torch.randn(m, 4096)
        reference = F.linear(x, weight)
        # A sequential float32 sum: the coarsest honest order there is.
        sequential = torch.zeros(m, 1024)
        for chunk in torch.split(torch.arange(4096), 1):
            sequential += x[:, chunk] * weight[:, chunk].T
        assert linear_path.agreement(sequential, reference, x, weight, None) <= 1.0
        assert linear_path.agreement(reference * (1 + 1e-3), reference, x, weight, None) > 5
        coarse = F.linear(x.bfloat16().float(), weight.bfloat16().float())
        assert linear_path.agreement(coarse, reference, x, weight, None) > 10


def test_a_layer_larger_than_cold_bytes_is_timed_on_a_slice_of_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single layer past COLD_BYTES (an LM head): one pass over about COLD_BYTES of its first rows, a
    view (no copy), the time scaled to the whole layer. Smaller layers: whole layers, the time per layer."""
    model = load_model("tiny:seed=0").model
    head = model.lm_head  # 260 x 64 float32: 65 KiB; the MLP's 128 x 64 layers: 32 KiB each
    monkeypatch.setattr(linear_path, "COLD_BYTES", 40 << 10)
    monkeypatch.setattr(linear_path, "ROW_BLOCK", 16)
    monkeypatch.setattr(linear_path, "best_ms", lambda runs, reps, **kwargs: {path: 1.0 for path in runs})
    timer = linear_path._ShapeTimer([head], reps=1, can_pack=False)
    (weight, _), = timer.weights
    assert weight.shape == (160, 64) and weight.data_ptr() == head.weight.data_ptr()  # 40 KiB / 256 B rows
    timer.time(2)
    assert timer.ms[linear_path.LINEAR][2] == pytest.approx(260 / 160)
    ups = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 128]
    timer = linear_path._ShapeTimer(ups, reps=1, can_pack=False)
    assert len(timer.weights) == 2 and all(w is lin.weight for (w, _), lin in zip(timer.weights, ups))
    timer.time(2)
    assert timer.ms[linear_path.LINEAR][2] == pytest.approx(0.5)


def test_library_gemm_path_swaps_nothing_and_still_measures_the_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    """--gemm-path library: F.linear everywhere (nothing measured for it, nothing swapped), and the
    cost curve measured as with auto (before, only --calibration-s 0 kept F.linear, with no curve)."""
    def no_measuring(*args: object, **kwargs: object) -> linear_path.PathChoice:
        raise AssertionError("library measures no GEMM path")

    monkeypatch.setattr(linear_path, "measure", no_measuring)
    core = WorkerCore(load_model("tiny:seed=0"), "target")
    calibrate(core, max_k=3, budget_s=5, gemm_path="library")
    linears = _linears(core.model)
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    assert "library" in core.gemm_path
    assert {1, 4} <= {t for t, _, _ in core.cost_curve.points}
    with pytest.raises(ValueError, match="gemm_path"):
        calibrate(core, max_k=3, budget_s=5, gemm_path="fastest")


def test_the_worker_flag_defaults_to_auto() -> None:
    import argparse
    from specdec.worker_server import add_worker_args
    parser = argparse.ArgumentParser()
    add_worker_args(parser, "tiny:seed=0")
    assert parser.parse_args([]).gemm_path == "auto"
    assert parser.parse_args(["--gemm-path", "library"]).gemm_path == "library"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gemm-path", "packed"])


def test_only_a_shapes_first_timing_warms_up_on_the_whole_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up sets up one GEMM shape's kernels: after the shape's first timing (which also faults a
    memory-mapped checkpoint in) it runs on the last layer only, so the timed pass still starts cold."""
    warmed: list[int] = []
    real_best_ms = linear_path.best_ms

    def best_ms(runs: dict[str, Callable[[], object]], reps: int,
                warm_ups: dict[str, Callable[[], object]] | None = None, **kwargs: object) -> dict[str, float]:
        warmed.append(len((warm_ups or runs)[linear_path.LINEAR]()))
        return {path: 1.0 for path in runs}

    monkeypatch.setattr(linear_path, "best_ms", best_ms)
    model = load_model("tiny:seed=0").model
    ups = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 128]
    timer = linear_path._ShapeTimer(ups, reps=1, can_pack=False)
    for m in (1, 2, 3):
        timer.time(m)
    assert warmed == [len(ups), 1, 1] and len(ups) > 1  # up and gate projections of both layers
    calls = []
    ms = real_best_ms({"linear": lambda: calls.append("run")}, reps=2,
                             warm_ups={"linear": lambda: calls.append("warm")})
    assert calls == ["warm", "run", "run"] and set(ms) == {"linear"}


# ----------------------------------------------------------------------------- the reduced (bf16 copy) path

def test_the_reduced_path_runs_a_bf16_copy_up_to_its_rows_and_float32_above() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    plan = linear_path.ShapePlan(False, (1, 3), (False, True), reduced_rows=2, reduced_kind="bf16")
    path = linear_path.PathLinear(linear, plan)
    bf16_weight, bf16_bias = linear.weight.bfloat16(), linear.bias.bfloat16()
    for rows in (1, 2):
        x = torch.randn(rows, 64)
        y = path(x)
        assert y.dtype == torch.float32
        assert torch.equal(y, F.linear(x.bfloat16(), bf16_weight, bf16_bias).float())
        assert not torch.equal(y, linear(x))  # really the bf16 copy, not float32
    x = torch.randn(1, 3, 64)  # 3 rows: above the reduced rows, weight-left in float32
    assert torch.equal(path(x), linear_path.weight_left(x, linear.weight, linear.bias))
    with pytest.raises(RuntimeError, match="reduced"):  # the bf16 copy is no parameter: it would stay behind
        path.double()


def test_a_packed_shape_keeps_its_reduced_copy() -> None:
    if not linear_path.packing_supported(torch.float32):
        pytest.skip("oneDNN packing refuses float32 here")
    linear = torch.nn.Linear(64, 96)
    path = linear_path.PathLinear(linear, linear_path.ShapePlan(packed=True, reduced_rows=1, reduced_kind="bf16"))
    assert path.weight is None and path.reduced is not None
    x1, x4 = torch.randn(1, 64), torch.randn(4, 64)
    assert torch.equal(path(x1), linear_path.reduced_linear(x1, *path.reduced))
    assert torch.allclose(path(x4), linear(x4), atol=1e-5)


def test_the_reduced_path_agrees_only_within_its_own_rounding() -> None:
    """An honest bf16 product fails the float32 tolerance (so the operands' rounding term is needed) and
    passes with it; a product 5 % off, or over the wrong weight layout, fails even that."""
    torch.manual_seed(0)
    weight, bias = torch.randn(512, 256) * 0.05, torch.randn(512) * 0.1
    x = torch.randn(3, 256)
    reference = F.linear(x, weight, bias)
    honest = linear_path.reduced_linear(x, weight.bfloat16(), bias.bfloat16())
    assert linear_path.agreement(honest, reference, x, weight, bias) > 1.0
    assert linear_path.agreement(honest, reference, x, weight, bias, torch.bfloat16) <= 1.0
    assert linear_path.agreement(honest * 1.05, reference, x, weight, bias, torch.bfloat16) > 1.0
    shuffled = weight.reshape(256, 512).T.contiguous()
    wrong = linear_path.reduced_linear(x, shuffled.bfloat16(), bias.bfloat16())
    assert linear_path.agreement(wrong, reference, x, weight, bias, torch.bfloat16) > 1.0


def _timer_with(ms: dict[str, dict[int, float]]) -> "linear_path._ShapeTimer":
    timer = linear_path._ShapeTimer([torch.nn.Linear(8, 8)], reps=1, can_pack=False)
    timer.ms = ms
    return timer


def test_the_plan_takes_the_reduced_path_for_the_prefix_of_rows_where_it_wins() -> None:
    rows = [1, 2, 3, 4, 8]
    linear_ms = {m: 10.0 for m in rows}
    # Wins at 1 and 2, only ties at 3 (MIN_GAIN), would win again at 8: the prefix ends at 2.
    reduced = {1: 3.0, 2: 6.0, 3: 9.5, 4: 20.0, 8: 1.0}
    plan = linear_path._plan(_timer_with({linear_path.LINEAR: linear_ms, linear_path.WEIGHT_LEFT: dict(linear_ms),
                                          linear_path.REDUCED: reduced}), rows, None)
    assert plan.reduced_rows == 2 and not plan.packed
    plan = linear_path._plan(_timer_with({linear_path.LINEAR: linear_ms, linear_path.WEIGHT_LEFT: dict(linear_ms),
                                          linear_path.REDUCED: {1: 9.5, 2: 1.0}}), rows, None)
    assert plan.reduced_rows == 0 and not plan.swaps


def test_rows_the_reduced_path_takes_do_not_decide_packed_or_dense() -> None:
    """Weight-left wins at 1-2 rows and packed from 3: with the reduced path taking 1-2, packed is the
    better plan for the rows left, which the whole grid's average would not choose."""
    rows = [1, 2, 3, 4]
    ms = {linear_path.LINEAR: {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 64: 10.0},
          linear_path.WEIGHT_LEFT: {1: 1.0, 2: 1.0, 3: 10.0, 4: 10.0, 64: 10.0},
          linear_path.PACKED: {1: 8.0, 2: 8.0, 3: 8.0, 4: 8.0, 64: 10.0}}
    without = linear_path._plan(_timer_with({k: dict(v) for k, v in ms.items()}), rows, 64)
    assert not without.packed  # the control: over all rows, dense wins
    with_reduced = linear_path._plan(_timer_with(ms | {linear_path.REDUCED: {1: 0.5, 2: 0.5, 3: 20.0}}), rows, 64)
    assert with_reduced.packed and with_reduced.reduced_rows == 2


def test_measure_offers_the_reduced_path_to_float32_weights_only_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, frozenset[str]]] = []
    real_time = linear_path._ShapeTimer.time

    def fake_best_ms(runs: dict[str, Callable[[], list[torch.Tensor]]], reps: int, **kwargs: object) -> dict[str, float]:
        rows = {run()[0].shape[0] for run in runs.values()}.pop()
        # The reduced path: fast at one row, slow from two (as ATen's bf16 GEMMs on an AVX2 CPU).
        return {path: (0.1 if rows == 1 else 5.0) if path == linear_path.REDUCED else 1.0 for path in runs}

    def recording_time(self: linear_path._ShapeTimer, m: int, only: tuple[str, ...] | None = None) -> None:
        real_time(self, m, only)
        timed.append((m, frozenset(p for p, ms in self.ms.items() if m in ms)))

    monkeypatch.setattr(linear_path, "best_ms", fake_best_ms)
    monkeypatch.setattr(linear_path._ShapeTimer, "time", recording_time)
    model = load_model("tiny:seed=0").model
    off = linear_path.measure(model, max_m=4, budget_s=60, reps=1, allow_packing=False)
    assert all(linear_path.REDUCED not in t for t in off.timings.values()) and not any(
        p.reduced_rows for p in off.plans.values())
    timed.clear()
    on = linear_path.measure(model, max_m=4, budget_s=60, reps=1, allow_packing=False, reduced_kind="bf16")
    assert on.plans and all(p.reduced_rows == 1 for p in on.plans.values()), on.plans
    assert "bf16 copy at M=1" in on.summary()
    # Timed in the order 1, 3, 4, 64 (the ends), then 2: it lost at 3, so it is not timed at 4 or 64
    # (its cost grows with the rows), but still at 2, below that loss.
    assert [m for m, _ in timed[:5]] == [1, 3, 4, 64, 2]
    assert {m for m, paths in timed if linear_path.REDUCED in paths} == {1, 2, 3}
    bf16 = load_model("tiny:seed=0", torch.bfloat16).model
    assert all(linear_path.REDUCED not in t for t in linear_path.measure(
        bf16, max_m=2, budget_s=60, reps=1, allow_packing=False, reduced_kind="bf16").timings.values())


def test_a_reduced_path_off_by_5_percent_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = linear_path.reduced_linear
    monkeypatch.setattr(linear_path, "reduced_linear", lambda *args: honest(*args) * 1.05)
    monkeypatch.setattr(linear_path, "best_ms", _favouring(linear_path.REDUCED))
    choice = linear_path.measure(load_model("tiny:seed=0").model, max_m=2, budget_s=60, reps=1,
                                 allow_packing=False, reduced_kind="bf16")
    assert choice.plans and not any(p.reduced_rows for p in choice.plans.values())
    assert all(linear_path.REDUCED not in t for t in choice.timings.values())


def test_only_an_auto_cpu_draft_gets_reduced_copy_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 for a CPU draft under --dtype auto where the kernel runs, then bf16 for a draft auto keeps
    in float32 (no native bf16); nothing else where auto gives a bf16 draft. Never the target, an
    explicit dtype or CUDA."""
    from specdec import models
    monkeypatch.setattr(models, "bf16_is_fast", lambda device="cpu": False)
    monkeypatch.setattr(linear_path, "int4_supported", lambda: True)
    assert models.reduced_copy_kinds("auto", "draft", "cpu") == ("int4", "bf16")  # bf16: if int4 is dropped
    assert models.reduced_copy_kinds("auto", "draft", "cpu", int4=False) == ("bf16",)
    assert models.reduced_copy_kinds("auto", "target", "cpu") == ()  # the target's numerics are the output
    assert models.reduced_copy_kinds("float32", "draft", "cpu") == ()  # float32 asked for is float32
    assert models.reduced_copy_kinds("auto", "draft", "cuda") == ()
    monkeypatch.setattr(linear_path, "int4_supported", lambda: False)  # a torch without the kernel
    assert models.reduced_copy_kinds("auto", "draft", "cpu") == ("bf16",)
    monkeypatch.setattr(models, "bf16_is_fast", lambda device="cpu": True)  # auto gives a bf16 draft there
    assert models.reduced_copy_kinds("auto", "draft", "cpu") == ()
    monkeypatch.setattr(linear_path, "int4_supported", lambda: True)
    assert models.reduced_copy_kinds("auto", "draft", "cpu") == ("int4",)


def test_calibrate_passes_the_reduced_rows_permission_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_path, "best_ms", _favouring(linear_path.REDUCED))
    core = WorkerCore(load_model("tiny:seed=0"), "draft")
    calibrate(core, max_k=3, budget_s=5, reduced_kind="bf16")
    reduced = [m for m in _linears(core.model) if isinstance(m, linear_path.PathLinear) and m.plan.reduced_rows]
    assert reduced and "bf16 copy" in core.gemm_path
    core = WorkerCore(load_model("tiny:seed=0"), "draft")
    calibrate(core, max_k=3, budget_s=5)
    assert "bf16" not in core.gemm_path


def test_the_packed_shortcut_still_times_the_rows_the_reduced_path_may_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed winning at every end point skips the other row counts, but not those below the reduced
    path's first loss: there it may still win, and untimed it could not be taken."""
    if not linear_path.packing_supported(torch.float32):
        pytest.skip("oneDNN packing refuses float32 here")
    timed: list[int] = []
    real_time = linear_path._ShapeTimer.time

    def fake_best_ms(runs: dict[str, Callable[[], list[torch.Tensor]]], reps: int, **kwargs: object) -> dict[str, float]:
        rows = {run()[0].shape[0] for run in runs.values()}.pop()
        fast = {linear_path.PACKED: 0.5, linear_path.REDUCED: 0.1 if rows <= 2 else 5.0}
        return {path: fast.get(path, 1.0) for path in runs}

    def recording_time(self: linear_path._ShapeTimer, m: int, only: tuple[str, ...] | None = None) -> None:
        real_time(self, m, only)
        timed.append(m)

    monkeypatch.setattr(linear_path, "best_ms", fake_best_ms)
    monkeypatch.setattr(linear_path._ShapeTimer, "time", recording_time)
    model = load_model("tiny:seed=0").model
    choice = linear_path.measure(model, max_m=8, budget_s=60, reps=1, reduced_kind="bf16")
    shapes = len(choice.plans)
    assert shapes and all(p.packed and p.reduced_rows == 2 for p in choice.plans.values()), choice.plans
    # Per shape: the ends 1, 4, 8, 64, then 2 and 3 (below the loss at 4), and none of 6.
    assert timed == [1, 4, 8, 64, 2, 3] * shapes
    # Past the shortcut only packed and the copy were timed (the dense paths lose to packed there
    # already); the plan and the summary read the rows where F.linear was not timed.
    for timing in choice.timings.values():
        assert {2, 3} <= set(timing[linear_path.PACKED]) & set(timing[linear_path.REDUCED])
        assert not {2, 3} & (set(timing[linear_path.LINEAR]) | set(timing[linear_path.WEIGHT_LEFT]))
    assert "bf16 copy at M=1-2" in choice.summary() and "x at M=1" in choice.summary()
    timed.clear()
    choice = linear_path.measure(model, max_m=8, budget_s=60, reps=1)
    assert timed == [1, 4, 8, 64] * shapes  # the control: without the reduced path, the ends alone


def test_calibrate_gives_the_reduced_path_to_a_draft_only_and_measures_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target never runs a reduced copy, whatever the caller says. A draft that does has its
    cost curve measured at the copy's last row count and the next (its forward's cost steps there)."""
    def fake_best_ms(runs: dict[str, Callable[[], list[torch.Tensor]]], reps: int, **kwargs: object) -> dict[str, float]:
        rows = {run()[0].shape[0] for run in runs.values()}.pop()
        return {path: (0.1 if rows <= 4 else 5.0) if path == linear_path.REDUCED else 1.0 for path in runs}

    monkeypatch.setattr(linear_path, "best_ms", fake_best_ms)
    target = WorkerCore(load_model("tiny:seed=0"), "target")
    calibrate(target, max_k=3, budget_s=30, reduced_kind="bf16")
    assert "bf16" not in target.gemm_path and not any(
        isinstance(m, linear_path.PathLinear) and m.plan.reduced_rows for m in target.model.modules())
    draft = WorkerCore(load_model("tiny:seed=0"), "draft")
    calibrate(draft, max_k=3, budget_s=30, reduced_kind="bf16")
    assert "bf16 copy at M=1-4" in draft.gemm_path
    assert {1, 2, 4, 5} <= {t for t, _, _ in draft.cost_curve.points}


def test_a_draft_worker_started_with_dtype_auto_passes_the_permission_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve_worker asks models.reduced_copy_kinds with the worker's own --dtype, --int4, role and device."""
    import argparse
    import asyncio

    from specdec import models, worker_server

    seen: list[tuple[str, ...]] = []

    class Stop(Exception):
        pass

    def fake_calibrate(core: WorkerCore, max_k: int, budget_s: float, gemm_path: str,
                       reduced: tuple[str, ...]) -> None:
        seen.append(reduced)
        raise Stop

    monkeypatch.setattr(worker_server, "calibrate", fake_calibrate)
    monkeypatch.setattr(models, "bf16_is_fast", lambda device="cpu": False)
    cpu = ["--device", "cpu"]  # auto would be CUDA on a GPU host, where no copy is offered
    monkeypatch.setattr(linear_path, "int4_supported", lambda: True)
    for role, flags, want in (("draft", cpu, ("int4", "bf16")), ("draft", cpu + ["--int4", "off"], ("bf16",)),
                              ("draft", cpu + ["--dtype", "float32"], ()), ("target", cpu, ())):
        parser = argparse.ArgumentParser()
        worker_server.add_worker_args(parser, "tiny:seed=0")
        with pytest.raises(Stop):
            asyncio.run(worker_server.serve_worker(parser.parse_args(flags), role, None, None, "x"))  # type: ignore[arg-type]
        assert seen.pop() == want, (role, flags)


def test_the_summary_names_only_the_weight_left_rows_that_run() -> None:
    """Rows the bf16 copy takes do not run weight-left: the summary must not say they do."""
    plan = linear_path.ShapePlan(False, (1, 2, 3, 4), (False, True, True, True), reduced_rows=2, reduced_kind="bf16")
    assert linear_path.PathChoice({(8, 8): plan}).summary() == "8x8: weight-left at M=3-4, bf16 copy at M=1-2"


def test_the_reduced_step_is_measured_right_after_the_largest_load_point_and_once() -> None:
    from specdec.calibration import measure_cost_curve
    loaded = load_model("tiny:seed=0")
    ticks = iter(range(1000))
    # One tick per clock call, a budget of 5.5 ticks: the first five row counts of the order only.
    curve = measure_cost_curve(loaded.model, loaded.model.config.vocab_size, 2, (8,), 5.5,
                               clock=lambda: float(next(ticks)), load_tokens=(16, 32, 64), step_tokens=(2, 3, 4))
    assert {t for t, _, _ in curve.points} == {1, 2, 64, 3, 4}
    curve = measure_cost_curve(loaded.model, loaded.model.config.vocab_size, 2, (8,), 60,
                               load_tokens=(16, 32, 64), step_tokens=(15, 16))
    assert sorted(t for t, _, _ in curve.points) == [1, 2, 15, 16, 32, 64]  # 16 once, though asked twice
