"""The draft's int4 weight copies (linear_path, "reduced") and the startup check of what any reduced
copy keeps of the draft's distributions (calibration.reduced_overlap). Tiny models on CPU; timings
are faked where a test needs the copy to win."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from specdec import calibration, linear_path
from specdec.calibration import calibrate, reduced_overlap
from specdec.models import load_model
from specdec.worker_core import WorkerCore

needs_int4 = pytest.mark.skipif(not linear_path.int4_supported(), reason="ATen's CPU int4 kernel is missing here")


def _copy_wins_up_to(rows_won: int) -> Callable[..., dict[str, float]]:
    """A best_ms that runs every path once and says the reduced copy is 10x faster up to rows_won rows."""
    def best_ms(runs: dict[str, Callable[[], list[torch.Tensor]]], reps: int, **kwargs: object) -> dict[str, float]:
        rows = {run()[0].shape[0] for run in runs.values()}.pop()
        return {path: (0.1 if rows <= rows_won else 5.0) if path == linear_path.REDUCED else 1.0 for path in runs}
    return best_ms


def _copies(model: torch.nn.Module) -> list[linear_path.PathLinear]:
    return [m for m in model.modules() if isinstance(m, linear_path.PathLinear) and m.reduced is not None]


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int4_product_is_that_of_the_weight_it_stands_for(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 96, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    copy, dequantized = linear_path.quantize_int4(weight, dequantized=True)
    assert dequantized is not None and copy.nbytes < weight.numel() * weight.element_size() / 2
    # Round to nearest on each group's range in 15 steps: off by at most half a step (and the
    # products' dtype's rounding of the scale and offset).
    groups = weight.float().reshape(48, 3, 32)
    half_step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 30
    slack = 4 * torch.finfo(linear_path.INT4_PRODUCTS).eps * groups.abs().amax(-1, keepdim=True)
    assert ((dequantized.reshape(48, 3, 32) - groups).abs() <= half_step + slack).all()
    for rows in (1, 3, 17):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        y = linear_path.int4_linear(x, copy, bias)
        expected = F.linear(x, dequantized.to(dtype), bias)
        error = linear_path.agreement(y, expected, x, dequantized.to(dtype), bias, torch.bfloat16)
        assert error <= 1.0, (rows, error)
        # ... and not the product of the weight it was made from, which int4 cannot hold exactly.
        assert not torch.equal(y, F.linear(x, weight, bias))


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_leaves_the_weight_as_it_was_and_blocks_of_rows_pack_as_the_whole(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The model keeps its weight for the rows the copy does not take (a float32 weight's .float() is
    the weight itself: quantising in place on it rewrote the draft). Quantised by blocks of rows (to
    bound a worker's startup memory), the copy is the one quantised whole."""
    weight = torch.randn(1040, 64).to(dtype)  # 1040 = 16 x 65: a last block shorter than the kernel's 64 rows
    before = weight.clone()
    monkeypatch.setattr(linear_path, "QUANTIZE_ROWS", 3 * 64)
    blocks, back_blocks = linear_path.quantize_int4(weight, dequantized=True)
    assert torch.equal(weight, before)
    monkeypatch.setattr(linear_path, "QUANTIZE_ROWS", 1 << 20)
    whole, back_whole = linear_path.quantize_int4(weight, dequantized=True)
    assert torch.equal(weight, before)
    assert torch.equal(blocks.packed, whole.packed) and torch.equal(blocks.scales_and_zeros, whole.scales_and_zeros)
    assert back_blocks is not None and back_whole is not None and torch.equal(back_blocks, back_whole)


def test_int4_refuses_shapes_its_kernel_cannot_take() -> None:
    with pytest.raises(ValueError, match="int4"):
        linear_path.quantize_int4(torch.randn(260, 64))  # 260 outputs: not a multiple of 16
    with pytest.raises(ValueError, match="int4"):
        linear_path.quantize_int4(torch.randn(64, 40))  # 40 inputs: not whole groups of 32


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_runs_its_fewest_rows_on_int4_copies_where_they_win(monkeypatch: pytest.MonkeyPatch,
                                                                     dtype: torch.dtype) -> None:
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))
    model = load_model("tiny:seed=0", dtype).model
    choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1, allow_packing=False, reduced_kind="int4")
    copied = {shape for shape, plan in choice.plans.items() if plan.reduced_rows}
    # Every shape but the 260-word LM head (not a multiple of 16 outputs: no copy, logged).
    assert copied == {shape for shape in choice.plans if shape[0] != 260}
    assert all(choice.plans[shape].reduced_rows == 2 and choice.plans[shape].reduced_kind == "int4" for shape in copied)
    assert "int4 copy at M=1-2" in choice.summary() and "bf16" not in choice.summary()
    linear_path.apply(model, choice)
    calls: list[int] = []
    honest = linear_path.int4_linear
    monkeypatch.setattr(linear_path, "int4_linear", lambda x, w, b: calls.append(x.numel() // x.shape[-1]) or honest(x, w, b))
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1]]))
        assert calls and set(calls) == {1}
        calls.clear()
        model(input_ids=torch.tensor([[1, 2, 3]]))  # 3 rows: past the copies
        assert not calls
    assert linear_path.reduced_copy_bytes(model) > 0


@needs_int4
def test_an_int4_copy_whose_product_is_off_is_never_chosen(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    honest = linear_path.int4_linear
    monkeypatch.setattr(linear_path, "int4_linear", lambda x, w, b: honest(x, w, b) * 1.05)
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(16))
    choice = linear_path.measure(load_model("tiny:seed=0").model, max_m=2, budget_s=60, reps=1,
                                 allow_packing=False, reduced_kind="int4")
    assert choice.plans and not any(p.reduced_rows for p in choice.plans.values())
    assert "never chosen" in caplog.text


@needs_int4
def test_the_overlap_check_sees_copies_that_change_the_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without copies a one-token step and the full forward agree (overlap near 1); copies whose
    products are zero (every one-token step then sees a flat distribution) are caught, which they
    would not be if the check's full forward ran on the copies too (zero against zero: overlap 1)."""
    model = load_model("tiny:seed=0").model
    with torch.inference_mode():
        assert reduced_overlap(model, 260, copy_rows=0) > 0.99
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1, allow_packing=False, reduced_kind="int4")
    linear_path.apply(model, choice)
    monkeypatch.setattr(linear_path, "int4_linear", lambda x, w, b: x.new_zeros(*x.shape[:-1], w.out_features))
    assert reduced_overlap(model, 260, copy_rows=4) < calibration.MIN_REDUCED_OVERLAP
    with pytest.raises(ValueError, match="rows"):
        reduced_overlap(model, 260, copy_rows=48)


@needs_int4
@pytest.mark.parametrize("overlap, kept", [(0.5, False), (0.95, True)])
def test_calibrate_drops_copies_that_lose_the_draft_s_distributions(monkeypatch: pytest.MonkeyPatch, overlap: float,
                                                                     kept: bool) -> None:
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    checked: list[int] = []
    monkeypatch.setattr(calibration, "reduced_overlap",
                        lambda model, vocab, rows: checked.append(rows) or overlap)
    core = WorkerCore(load_model("tiny:seed=0", torch.bfloat16), "draft")
    calibrate(core, max_k=3, budget_s=10, reduced_kind="int4")
    # Dropped: then tried on fewer shapes, PARTIAL_CHECKS more checks.
    assert checked == [4] * (1 if kept else 1 + linear_path.PARTIAL_CHECKS)
    assert bool(_copies(core.model)) is kept
    assert ("int4 copy at M=1-4" in core.gemm_path) is kept
    assert (f"keep {overlap:.3f}" if kept else f"dropped: {overlap:.3f} overlap") in core.gemm_path
    # The cost curve is measured on what runs: at the copies' last rows and the next only if kept.
    assert ({4, 5} <= {t for t, _, _ in core.cost_curve.points}) is kept
    with torch.inference_mode():
        core.model(input_ids=torch.tensor([[1]]))  # runs either way


@needs_int4
def test_a_tied_lm_head_gets_its_own_int4_copy_and_the_embedding_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft's largest copy in production is its LM head, tied to the input embedding (Qwen 0.5B):
    a shared weight is never packed, but may take a copy; the embedding keeps its values, and one-row
    steps run the head on the copy."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))
    model = load_model("tiny:seed=0,vocab=272", torch.bfloat16).model
    model.lm_head.weight = model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight.detach().clone()
    choice = linear_path.measure(model, max_m=4, budget_s=60, reps=1, reduced_kind="int4")
    head = choice.plans[(272, 64)]
    assert not head.packed and head.reduced_rows == 2 and head.reduced_kind == "int4"
    linear_path.apply(model, choice)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert isinstance(model.lm_head, linear_path.PathLinear) and model.lm_head.reduced is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still the one tied tensor
    heads: list[int] = []
    honest = linear_path.int4_linear
    monkeypatch.setattr(linear_path, "int4_linear",
                        lambda x, w, b: heads.append(w.out_features) or honest(x, w, b))
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1]]))
    assert 272 in heads


@needs_int4
def test_the_target_never_gets_an_int4_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(16))
    target = WorkerCore(load_model("tiny:seed=0"), "target")
    calibrate(target, max_k=3, budget_s=10, reduced_kind="int4")
    assert not _copies(target.model) and "int4" not in target.gemm_path


@needs_int4
def test_calibrate_drops_honest_int4_copies_of_a_random_weight_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 levels per group of 32 random weights lose the tiny draft most of its distribution (overlap
    0.63-0.66 measured, real drafts 0.97): the unpatched check drops them."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    core = WorkerCore(load_model("tiny:seed=0"), "draft")
    calibrate(core, max_k=3, budget_s=10, reduced_kind="int4")
    assert not _copies(core.model) and "int4 copies dropped" in core.gemm_path


@needs_int4
def test_a_float32_draft_whose_int4_copies_fail_the_check_measures_bf16_copies_next(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The fallback a float32 draft on a CPU without native bf16 gets (models.reduced_copy_kinds):
    honest int4 copies of the random-weight draft fail the unpatched check, and bf16 copies, measured
    next, keep enough and run."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    core = WorkerCore(load_model("tiny:seed=0"), "draft")
    with caplog.at_level("WARNING", logger="specdec.linear_path"):
        calibrate(core, max_k=3, budget_s=10, reduced_kind=("int4", "bf16"))
    copies = _copies(core.model)
    assert copies and all(m.reduced[0].dtype == torch.bfloat16 and m.plan.reduced_kind == "bf16" for m in copies)
    assert "int4 copies dropped" in core.gemm_path and "bf16 copies keep" in core.gemm_path
    assert "bf16 copy at M=1-4" in core.gemm_path and "int4 copy" not in core.gemm_path
    assert "measuring the next kind" in caplog.text
    bf16_steps: list[int] = []
    honest = linear_path.reduced_linear
    monkeypatch.setattr(linear_path, "reduced_linear",
                        lambda x, w, b: bf16_steps.append(w.dtype == torch.bfloat16) or honest(x, w, b))
    with torch.inference_mode():
        core.model(input_ids=torch.tensor([[1]]))
    assert bf16_steps and all(bf16_steps)


@needs_int4
def test_when_every_kind_of_copy_fails_the_draft_runs_its_first_plan_without_copies(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    checked: list[int] = []
    monkeypatch.setattr(calibration, "reduced_overlap", lambda model, vocab, rows: checked.append(rows) or 0.5)
    core = WorkerCore(load_model("tiny:seed=0"), "draft")
    with caplog.at_level("WARNING"):
        calibrate(core, max_k=3, budget_s=10, reduced_kind=("int4", "bf16"))
    assert checked == [4] * (2 + 2 * linear_path.PARTIAL_CHECKS) and not _copies(core.model)  # all, then fewer shapes
    assert "int4 copies dropped: 0.500" in core.gemm_path and "bf16 copies dropped: 0.500" in core.gemm_path
    assert "int4 copies without those of " in core.gemm_path and "bf16 copies without those of " in core.gemm_path
    assert "the draft runs without weight copies" in caplog.text and "running without copies" in caplog.text
    with torch.inference_mode():
        core.model(input_ids=torch.tensor([[1]]))


def test_copies_only_swaps_the_copies_in_alone_and_puts_the_linears_back() -> None:
    model = load_model("tiny:seed=0").model
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    choice = linear_path.measure(model, max_m=2, budget_s=60, reps=1, allow_packing=False)
    shape = next(iter(choice.plans))
    choice.plans[shape] = linear_path.ShapePlan(packed=True, reduced_rows=2, reduced_kind="bf16")
    with pytest.raises(RuntimeError, match="inside"):
        with linear_path.copies_only(model, choice):
            inside = {name: m for name, m in model.named_modules() if isinstance(m, linear_path.PathLinear)}
            assert inside and all((m.in_features, m.out_features)[::-1] == shape for m in inside.values())
            # Only the copy: the rest of the plan (packing here) is not applied, the weight stays dense.
            assert all(m.reduced is not None and m.packed is None and m.weight is linears[name].weight
                       for name, m in inside.items())
            raise RuntimeError("inside")
    assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == linears


def test_a_later_kind_measured_only_in_part_keeps_the_first_plan_for_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fallback measurement that ran out of budget: the shapes it did not reach keep the first
    measurement's plan (without its copies), not F.linear."""
    honest = linear_path.measure

    def measure(model: torch.nn.Module, max_m: int, budget_s: float, **kwargs: object) -> linear_path.PathChoice:
        choice = honest(model, max_m, budget_s, reps=1, allow_packing=False, **kwargs)
        for shape in list(choice.plans):
            choice.plans[shape] = linear_path.ShapePlan(grid=(1,), weight_left=(kwargs["reduced_kind"] == "int4",),
                                                        reduced_rows=2, reduced_kind=kwargs["reduced_kind"])
        if kwargs["reduced_kind"] == "bf16":  # ran out after its first shape
            first = next(iter(choice.plans))
            choice.plans, choice.complete = {first: choice.plans[first]}, False
        return choice
    monkeypatch.setattr(linear_path, "measure", measure)
    model = load_model("tiny:seed=0,vocab=272").model  # every shape fits int4 groups
    scores = [0.5, 0.95]  # int4's, then bf16's
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("int4", "bf16"),
                                          check=lambda rows: scores.pop(0), min_score=0.9)
    assert [(kind, kept) for kind, _, kept in choice.copy_checks] == [("int4", False), ("bf16", True)]
    reached = [shape for shape, plan in choice.plans.items() if plan.reduced_rows]
    assert len(reached) == 1 and choice.plans[reached[0]].reduced_kind == "bf16"
    rest = [plan for shape, plan in choice.plans.items() if shape not in reached]
    assert rest and all(plan.weight_left == (True,) and not plan.reduced_rows for plan in rest)  # the int4 measurement's
    assert choice.complete  # as far as the first measurement went



def test_the_copies_checked_are_the_copies_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies made for the check (copies_only) are the ones the draft keeps: not made a second
    time by apply."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))
    model = load_model("tiny:seed=0").model
    seen: list[object] = []
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",),
                                          check=lambda rows: seen.extend(
                                              m.reduced[0] for m in _copies(model)) or 0.95, min_score=0.9)
    assert choice.copy_checks == [("bf16", 0.95, True)]
    kept = [m.reduced[0] for m in _copies(model)]
    assert kept and len(kept) == len(seen) and all(a is b for a, b in zip(kept, seen))


def test_a_kind_whose_copies_win_no_timing_is_followed_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 copies that lose every shape's timing (as they might with slow kernels) leave the draft
    to try bf16 ones, not to run without copies."""
    wins = {"bf16": 2}

    def measure(model: torch.nn.Module, max_m: int, budget_s: float, **kwargs: object) -> linear_path.PathChoice:
        monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(wins.get(str(kwargs["reduced_kind"]), 0)))
        return honest(model, max_m, budget_s, **kwargs)
    honest = linear_path.measure
    monkeypatch.setattr(linear_path, "measure", measure)
    model = load_model("tiny:seed=0").model
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("int4", "bf16"), check=lambda rows: 0.95,
                                          min_score=0.9)
    assert choice.copy_checks == [("bf16", 0.95, True)]  # int4: no copies, nothing to check
    assert _copies(model) and all(m.plan.reduced_kind == "bf16" for m in _copies(model))


@needs_int4
def test_a_large_layer_timed_on_a_slice_gets_no_int4_copy_where_the_whole_does_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer over COLD_BYTES is timed on a slice of whole row blocks, which quantises; the layer
    itself (260 outputs: not a multiple of 16) does not, so it must get no int4 copy (it made the
    worker's startup fail in apply)."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(4))
    monkeypatch.setattr(linear_path, "COLD_BYTES", 4096)  # the 260x64 head (66 KB) is timed on 256 rows
    model = load_model("tiny:seed=0").model
    choice = linear_path.choose_and_apply(model, 4, 60.0, reduced_kinds=("int4",))
    assert choice.plans[(260, 64)].reduced_rows == 0
    assert any(plan.reduced_rows for plan in choice.plans.values())  # the shapes that fit have theirs
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1]]))


def test_copy_errors_rank_the_shape_whose_copies_change_its_products_most() -> None:
    """The products of each shape's copies against the weights' own, on the inputs the model's own
    forward gives each layer: a shape whose copies are wrong (zeros here) ranks first."""
    model = load_model("tiny:seed=0").model
    choice = linear_path.measure(model, max_m=2, budget_s=60, reps=1, allow_packing=False)
    for shape in choice.plans:
        choice.plans[shape] = linear_path.ShapePlan(reduced_rows=2, reduced_kind="bf16")
    with linear_path.copies_only(model, choice) as made:
        pass
    errors = linear_path.copy_errors(model, choice, made)
    assert set(errors) == set(choice.plans) and max(errors.values()) < 0.05  # bf16: about 2^-8 relative
    broken = sorted(choice.plans)[0]
    for _, _, child, _ in linear_path._planned_linears(model, choice):
        if (child.out_features, child.in_features) == broken:
            weight, bias = made[id(child)]
            made[id(child)] = (torch.zeros_like(weight), bias)
    errors = linear_path.copy_errors(model, choice, made)
    assert max(errors, key=errors.get) == broken and errors[broken] == pytest.approx(1.0, abs=0.05)


def test_a_kind_that_fails_on_all_its_shapes_is_kept_without_the_one_that_loses_most(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Which shapes a budget-bound measurement reached decided whether the draft ran with copies at
    all (two startups of the same draft: 0.879 with three shapes, 0.944 with two). A kind whose copies
    fail the check on all their shapes is checked again without the shape whose products they change
    most (copy_errors), then also the next; the first subset that passes is kept."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))
    model = load_model("tiny:seed=0").model
    shapes = sorted({(m.out_features, m.in_features) for m in model.modules() if type(m) is torch.nn.Linear})
    culprit, second = shapes[-1], shapes[0]
    monkeypatch.setattr(linear_path, "copy_errors",
                        lambda model, choice, copies: {s: 0.5 if s == culprit else 0.1 if s == second else 0.01
                                                       for s, p in choice.plans.items() if p.reduced_rows})

    def check(rows: int) -> float:  # fails while the culprit's copies are in
        copied = {(m.out_features, m.in_features) for m in _copies(model)}
        return 0.5 if culprit in copied else 0.95
    with caplog.at_level("INFO", logger="specdec.linear_path"):
        choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",), check=check, min_score=0.9)
    label = f"bf16 except {culprit[0]}x{culprit[1]}"
    assert choice.copy_checks == [("bf16", 0.5, False), (label, 0.95, True)]
    copied = {(m.out_features, m.in_features) for m in _copies(model)}
    assert copied == set(shapes) - {culprit} and not choice.plans[culprit].reduced_rows
    assert f"bf16 copies without those of {culprit[0]}x{culprit[1]} keep 0.950" in choice.summary()
    assert "trying fewer shapes" in caplog.text
    # Where dropping the first is not enough, the next goes too; PARTIAL_CHECKS at most.
    model = load_model("tiny:seed=0").model
    calls: list[int] = []

    def stricter(rows: int) -> float:
        copied = {(m.out_features, m.in_features) for m in _copies(model)}
        calls.append(len(copied))
        return 0.5 if {culprit, second} & copied else 0.95
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",), check=stricter, min_score=0.9)
    n = len(shapes)  # every shape took copies (the copy wins every timing)
    assert [kept for _, _, kept in choice.copy_checks] == [False, False, True] and calls == [n, n - 1, n - 2]
    assert {(m.out_features, m.in_features) for m in _copies(model)} == set(shapes) - {culprit, second}
    model = load_model("tiny:seed=0").model
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",), check=lambda rows: 0.5,
                                          min_score=0.9)
    assert len(choice.copy_checks) == 1 + linear_path.PARTIAL_CHECKS and not _copies(model)


def test_a_ranking_that_fails_leaves_the_draft_without_copies_not_down(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The fewer-shapes retry is a rescue: where ranking the shapes raises, the worker starts as it
    did before the retry existed (without copies), with a WARNING, and its nn.Linears are back."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))

    def broken(model: torch.nn.Module, choice: linear_path.PathChoice, copies: dict) -> dict:
        raise RuntimeError("no forward here")
    monkeypatch.setattr(linear_path, "copy_errors", broken)
    model = load_model("tiny:seed=0").model
    with caplog.at_level("WARNING", logger="specdec.linear_path"):
        choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",), check=lambda rows: 0.5,
                                              min_score=0.9)
    assert choice.copy_checks == [("bf16", 0.5, False)] and not _copies(model)
    assert "could not rank the bf16 copies' shapes (RuntimeError: no forward here)" in caplog.text
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1]]))


def test_the_fewer_shapes_checks_reuse_the_copies_the_failed_check_ran_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each nn.Linear's copy is made once for the timing and once for the checks: the retries on
    fewer shapes take the failed check's copies, not a third set (quantising a draft's weights
    again costs startup time)."""
    monkeypatch.setattr(linear_path, "best_ms", _copy_wins_up_to(2))
    model = load_model("tiny:seed=0").model
    linears = sum(1 for m in model.modules() if type(m) is torch.nn.Linear)
    made: list[int] = []
    honest = linear_path._reduced_copy
    monkeypatch.setattr(linear_path, "_reduced_copy", lambda *args: made.append(1) or honest(*args))
    choice = linear_path.choose_and_apply(model, 2, 10.0, reduced_kinds=("bf16",), check=lambda rows: 0.5,
                                          min_score=0.9)
    assert len(choice.copy_checks) == 1 + linear_path.PARTIAL_CHECKS
    assert len(made) == 2 * linears  # the timer's, then the checks' (every shape took copies)
