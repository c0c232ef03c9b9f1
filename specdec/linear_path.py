"""The GEMM path for small-M decode on CPU, chosen per weight shape and token count at startup.

A decode forward multiplies M = 1..k+1 token rows by each weight matrix. How that costs depends on
the CPU and the library path, and nothing here is tuned to one machine: each worker times, for every
distinct weight shape of its model, the ways below to compute the same product and keeps the fastest.

- `linear`: `F.linear` (MKL for float32, oneDNN for bf16). On the AMD EPYCs measured so far its float32
  time grows almost linearly with M from M = 2.
- `weight_left`: `(W @ x.T).T`, the weight as the GEMM's left, large operand: near one read of W at
  small M where `F.linear` is not.
- `packed`: the weight reordered once into oneDNN's blocked layout and run by oneDNN's matmul (the
  ops torch.compile's CPU backend uses for bf16 linears). On the Zen 4 it is nearly flat from M = 1
  to 16 and 1.5-3.5x faster than either dense path for the float32 target.

- `reduced` (a draft only, never a target): a smaller copy of the weight, for the row counts where it
  wins, of one of two kinds (`models.reduced_copy_kinds`, in order of preference):
  - `int4`: 4-bit weights in groups of INT4_GROUP inputs, each group with its own scale and offset
    (round to nearest), run by ATen's CPU int4 kernel. A quarter of bf16's bytes: on the 2-core Zen 4
    a bf16 draft's one-token step took 26 ms on it against 55 ms on the best bf16 path, with 0.792
    greedy agreement with the target against 0.812 (the embedded draft, dequantised from a Q4 GGUF;
    a draft trained in bf16 may lose more: the startup check below bounds it). The copy's products are checked against the dequantised weight, and the whole draft's
    distributions against its own full-precision ones (calibration.reduced_overlap).
  - `bf16` (a float32 draft where the CPU has no bf16 units, when the int4 kernel is missing or turned
    off, or the int4 copies failed the distribution check or won no timing: choose_and_apply measures
    the next kind):
    ATen's bf16 matrix-vector kernels read half the bytes, and on AVX2 kernels they took a
    draft's one-token linears 2.5-3.5x below the best float32 path.
  Either loses from a few rows on (at a prompt chunk's 64 rows bf16 was 4x slower), so only a prefix
  of row counts (1, 2, ...) takes the copy. Costs the copy beside the weights, and changes the draft's
  numerics only: the draft proposes, the target decides, so the output is unchanged.

A shape either keeps its dense weight (and picks `linear` or `weight_left` per M) or swaps it for the
packed one (every M the reduced copy leaves): one copy of the weights in the model's dtype, never two
(plus the reduced copy where it wins). Each timing is one pass over about
COLD_BYTES of the shape's weights, so that it never times the cache (a forward reads each weight
once): whole layers in turn, or, for one layer larger than that (an LM head), a slice of its rows of
about COLD_BYTES, the time scaled to the whole layer. Before any timing, each path's output is
compared with F.linear's on the shape's first layer: a path that differs by more than the order of
a float32 sum and the output's rounding explain (for `reduced`: and its bf16 rounding; an int4 copy
is compared with F.linear over the dequantised weight it stands for) is never chosen (a WARNING says so). So the float32 paths change only the reduction order (greedy identity is
checked by the tests and `specdec flips`); the reduced one changes a draft's numerics, never a target's.

Over 300 lines: the paths, how they are timed and the per-shape plan are one measurement, and the
plan's rules (one copy of a weight, the prompt chunk's guard) read the timings directly.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LINEAR, WEIGHT_LEFT, PACKED, REDUCED = "linear", "weight_left", "packed", "reduced"
# The reduced path's kinds of copy (module doc).
INT4, BF16 = "int4", "bf16"
REDUCED_KINDS = (INT4, BF16)
# The dtype of the bf16 copy, and of the rounding both kinds apply to their operands.
REDUCED_DTYPE = torch.bfloat16
# Inputs per int4 group (one scale and one offset each): a Q4 GGUF's sub-block.
INT4_GROUP = 32
# The int4 kernel's activations, scales and output, whatever the draft's dtype: with AVX2 kernels,
# float32 ones took it to 3-14x F.linear's time, bf16 ones to below the bf16 copy's (on the Zen 4 with
# ATen, oneDNN and MKL capped at AVX2).
INT4_PRODUCTS = torch.bfloat16
# Rows quantised at a time (a multiple of the kernel's 64-row packing).
QUANTIZE_ROWS = 8192
# Weight-left must win by this margin: ties go to the library's own kernel.
MIN_GAIN = 0.9
# The packed plan must not cost a prompt chunk more than this over the best dense path.
PREFILL_SLACK = 1.5
# Rows of a prompt chunk, timed beside the decode rows so a packed plan cannot slow prompts unseen.
PREFILL_ROWS = 64
# Bytes one timing pass reads: several layers' weights, far past any last-level cache.
COLD_BYTES = 192 << 20
# A layer larger than COLD_BYTES is timed on its first rows, a multiple of this many (GEMM blocking).
ROW_BLOCK = 256
# A path agrees with F.linear where each output is within ACCUMULATION_TOL x sqrt(in_features) x
# float32's eps x its scale of F.linear's, plus OUTPUT_ULPS units in the last place of the output's own
# dtype at that output or that scale, the larger. The scale is the norm of that output's terms,
# sqrt(sum_i (x_i w_ji)^2), plus its bias (a GEMM may start its float32 sum from the bias); per output,
# so that a weight row of large norm, whose sums round coarser, does not fail an honest path. Each path
# rounds its sum once; one that adds a bias after a bf16 GEMM rounds twice, the first time at the
# product's scale. On the 1.5B's weights in float32 the honest paths stayed within 1.6 x sqrt(in) x
# eps x the scale (inside the ULPs in bf16, on the 0.5B's); a float32 product of bf16-rounded operands
# was over 1000 of them off, a result scaled by 1 + 1e-3 over 500.
ACCUMULATION_TOL = 8.0
OUTPUT_ULPS = 2.0
# The reduced path rounds x and W to REDUCED_DTYPE: each term is then off by up to about its eps. The
# sum's error is not bounded by the terms' norm (its worst case is sqrt(in_features) times that), but
# with independent roundings it stays near 0.4 x eps x the norm (about 2 at worst over 65k outputs):
# OPERAND_TOL x eps x the norm is a statistical margin, still far below a broken kernel's error (the scale).
OPERAND_TOL = 4.0
# Outputs of a shape's first layer the agreement check compares (the first ones).
AGREEMENT_OUTPUTS = 4096


def weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T computed as (W @ x.T).T: the GEMM sees the weight as its left, large operand."""
    rows = x.reshape(-1, x.shape[-1])
    if bias is None:
        y = torch.matmul(weight, rows.T).T
    else:  # the bias inside the GEMM, rounded once as in F.linear (an add after rounds bf16 twice)
        y = torch.addmm(bias.unsqueeze(1), weight, rows.T).T
    return y.reshape(*x.shape[:-1], weight.shape[0])


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs here for this dtype: probed once, since a CPU build can have the op
    and still refuse the dtype (bf16 packing raises on a CPU without avx512bw/vl/dq or avx_ne_convert)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        packed_linear(torch.ones(1, 8, dtype=dtype), pack(torch.ones(8, 8, dtype=dtype)), None, 8)
    except (AttributeError, RuntimeError) as exc:  # AttributeError: a torch without the ops
        log.info("oneDNN packed weights unavailable for %s: %s", dtype, exc)
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout (an opaque mkldnn tensor of the same size)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], out_features)


@dataclass(frozen=True, eq=False)  # tensors: no field-wise ==
class Int4Weight:
    """A weight as 4-bit integers q in groups of `group` inputs: W = (q - 8) * scale + offset per group,
    in ATen's CPU int4 layout (`packed`: [out, in / 2] bytes; `scales_and_zeros`: [in / group, out, 2],
    in INT4_PRODUCTS, the dtype of the products)."""
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    out_features: int

    @property
    def nbytes(self) -> int:  # as a tensor's: _copy_bytes sums either
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def int4_fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> None:
    """Raises ValueError where the kernel cannot take the shape: inputs in whole groups, outputs in 16s."""
    if in_features % group or out_features % 16:
        raise ValueError(f"{out_features}x{in_features} does not fit int4 groups of {group} (or 16 outputs)")


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP,
                  dequantized: bool = False) -> tuple[Int4Weight, torch.Tensor | None]:
    """Round to nearest on each group's own [min, max] in 16 steps. With `dequantized`, also the weight
    the int4 one stands for (float32), what its products are checked against. Raises ValueError where
    the shape does not fit the kernel."""
    out_features, in_features = weight.shape
    int4_fits(out_features, in_features, group)
    packed, scales_and_zeros, back = [], [], []
    # By blocks of rows: a float32 copy of a whole LM head, and its integer one, would add over 1 GB to
    # a worker's startup peak. The kernel's layout packs 64 rows at a time, so blocks of a multiple of
    # 64 rows pack as the whole does.
    for rows in weight.detach().split(QUANTIZE_ROWS):
        # In place on the block's own float32 copy (copy=True: .float() of a float32 weight is the weight
        # itself, which this would overwrite): fresh temporaries cost page faults (4x slower in all).
        w = rows.to(torch.float32, copy=True).reshape(rows.shape[0], in_features // group, group)
        low = w.amin(-1, keepdim=True)
        # Scale and offset as the kernel reads them (INT4_PRODUCTS), and each weight rounded to the
        # nearest step of that grid: rounded against the unrounded ones, a group far from 0 (its offset
        # coarse in bf16) lost more than half a step.
        scale = ((w.amax(-1, keepdim=True) - low) / 15).clamp_min(torch.finfo(INT4_PRODUCTS).tiny)
        scale = scale.to(INT4_PRODUCTS).float()
        offset = (low + 8 * scale).to(INT4_PRODUCTS).float()
        q = w.sub_(offset - 8 * scale).div_(scale).round_().clamp_(0, 15)
        scales_and_zeros.append(torch.stack([scale.squeeze(-1), offset.squeeze(-1)], -1).to(INT4_PRODUCTS))
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(rows.shape[0], in_features), 1))
        if dequantized:
            back.append(q.sub_(8).mul_(scale).add_(offset).reshape(rows.shape[0], in_features))
    int4 = Int4Weight(torch.cat(packed), torch.cat(scales_and_zeros).transpose(0, 1).contiguous(), group, out_features)
    return int4, torch.cat(back) if dequantized else None


@functools.cache
def int4_supported() -> bool:
    """ATen's CPU int4 kernel runs here (probed once: torch builds differ)."""
    try:
        weight, _ = quantize_int4(torch.ones(16, INT4_GROUP))
        int4_linear(torch.ones(1, INT4_GROUP), weight, None)
    except (AttributeError, RuntimeError, ValueError) as exc:  # AttributeError: a torch without the ops
        log.info("int4 weights unavailable: %s", exc)
        return False
    return True


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b on an int4 weight: x rounded to INT4_PRODUCTS, float32 accumulation, the product
    rounded to INT4_PRODUCTS before the bias and the cast back to x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(weight.scales_and_zeros.dtype).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group, weight.scales_and_zeros)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.out_features).to(x.dtype)


ReducedCopy = tuple["torch.Tensor | Int4Weight", "torch.Tensor | None"]


def _reduced_copy(weight: torch.Tensor, bias: torch.Tensor | None, kind: str) -> ReducedCopy:
    if kind == INT4:
        # The bias cloned: a view of the parameter's storage would keep the checkpoint's mapping alive
        # after models.own_tensors replaced the parameter's data.
        return quantize_int4(weight)[0], None if bias is None else bias.detach().clone()
    return weight.detach().to(REDUCED_DTYPE), None if bias is None else bias.detach().to(REDUCED_DTYPE)


def _copy_bytes(copy: ReducedCopy) -> int:
    return sum(t.nbytes for t in copy if t is not None)


def reduced_linear(x: torch.Tensor, weight: "torch.Tensor | Int4Weight", bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b on a reduced copy (float32 accumulation in ATen's kernels), back in x's dtype."""
    if isinstance(weight, Int4Weight):
        return int4_linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def term_norms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per output of x @ weight.T, the norm of its terms: sqrt(sum_i (x_i w_ji)^2) (float64)."""
    return (x.double().pow(2) @ weight.double().pow(2).T).sqrt()


def agreement(y: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, operands: torch.dtype | None = None) -> float:
    """How far a path's output `y` is from F.linear's `reference` for input x and this weight and bias:
    the worst output's difference over its tolerance (ACCUMULATION_TOL, OUTPUT_ULPS, each output
    scaled by its own terms, term_norms), so at most 1 where the two differ only in the order of the
    sums; inf where the shape or dtype differs, or a NaN. `operands`: the dtype a reduced path rounds
    x, W and its output to (it may then also differ by that rounding: OPERAND_TOL, OUTPUT_ULPS of it)."""
    if y.shape != reference.shape or y.dtype != reference.dtype:
        return math.inf
    ref = reference.double()
    scale = term_norms(x, weight)
    if bias is not None:
        scale = scale + bias.double().abs()
    tolerance = (ACCUMULATION_TOL * math.sqrt(weight.shape[1]) * torch.finfo(torch.float32).eps * scale
                 + OUTPUT_ULPS * torch.finfo(reference.dtype).eps * torch.maximum(ref.abs(), scale))
    if operands is not None:
        eps = torch.finfo(operands).eps
        tolerance = tolerance + OPERAND_TOL * eps * scale + OUTPUT_ULPS * eps * torch.maximum(ref.abs(), scale)
    excess = ((y.double() - ref).abs() / tolerance.clamp_min(torch.finfo(torch.float64).tiny)).nan_to_num(math.inf)
    return excess.max().item() if excess.numel() else 0.0


@dataclass(frozen=True)
class ShapePlan:
    """What one weight shape runs. Packed: every M through oneDNN's packed weight. Dense: per measured
    row count, weight-left or F.linear; any other count takes the choice of the one below it. Either
    way, row counts up to `reduced_rows` (0: none) run on a copy of the weight of `reduced_kind`."""
    packed: bool = False
    grid: tuple[int, ...] = ()
    weight_left: tuple[bool, ...] = ()
    reduced_rows: int = 0
    reduced_kind: str | None = None  # INT4 or BF16 where reduced_rows > 0

    def weight_left_at(self, rows: int) -> bool:
        i = bisect.bisect_right(self.grid, rows) - 1
        return i >= 0 and self.weight_left[i]

    @property
    def swaps(self) -> bool:  # anything but F.linear everywhere
        return self.packed or any(self.weight_left) or self.reduced_rows > 0


class PathLinear(torch.nn.Module):
    """nn.Linear computed the way its shape's plan says (a packed plan drops the dense weight).

    For inference on a loaded model: a packed one has no dense weight to move, cast or save, and a
    reduced copy is not a parameter, so `.to()` / `.float()` refuse (a plain attribute would stay
    behind on its old device and dtype)."""

    def __init__(self, linear: torch.nn.Linear, plan: ShapePlan, reduced: ReducedCopy | None = None) -> None:
        """`reduced`: the plan's copy of this linear's weight, made already (copies_only), else made here."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.plan = plan
        self.bias = linear.bias
        self.reduced: ReducedCopy | None = None
        if plan.reduced_rows > 0:  # copied before packing drops the dense weight
            if plan.reduced_kind not in REDUCED_KINDS:
                raise ValueError(f"a plan with reduced rows needs a kind of copy ({', '.join(REDUCED_KINDS)}), "
                                 f"got {plan.reduced_kind!r}")
            self.reduced = reduced if reduced is not None else _reduced_copy(linear.weight, linear.bias,
                                                                             plan.reduced_kind)
        self.packed: torch.Tensor | None = None
        if plan.packed:
            self.packed = pack(linear.weight)
            self.register_parameter("weight", None)
        else:
            self.weight = linear.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        if self.packed is not None or self.reduced is not None:
            raise RuntimeError("a packed or reduced PathLinear cannot be moved or cast: do that before linear_path.apply")
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduced is not None and x.numel() // self.in_features <= self.plan.reduced_rows:
            return reduced_linear(x, *self.reduced)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.out_features)
        if self.plan.weight_left_at(x.numel() // self.in_features):
            return weight_left(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class PathChoice:
    """Per weight shape (out, in): the plan, and what was measured (ms per path per row count)."""
    plans: dict[tuple[int, int], ShapePlan] = field(default_factory=dict)
    timings: dict[tuple[int, int], dict[str, dict[int, float]]] = field(default_factory=dict)
    seconds: float = 0.0
    complete: bool = True
    # Each kind of copy checked (choose_and_apply's `check`), in order: (label, score, kept), the
    # label a kind, or "<kind> except <shapes>" for one checked on fewer shapes (_fewer_shapes).
    copy_checks: list[tuple[str, float, bool]] = field(default_factory=list)

    def summary(self) -> str:
        def copies(label: str) -> str:  # "int4" or "int4 except 896x4864, 4864x896"
            kind, _, without = label.partition(" except ")
            return f"{kind} copies" + (f" without those of {without}" if without else "")
        return self._plans_text() + "".join(
            f" ({copies(label)} keep {score:.3f} of the draft's distributions)" if kept
            else f" ({copies(label)} dropped: {score:.3f} overlap)" for label, score, kept in self.copy_checks)

    def _plans_text(self) -> str:
        if not self.plans:
            return "F.linear everywhere (" + ("measurement skipped)" if self.complete else "budget ran out)")
        parts = []
        for (out, inp), plan in sorted(self.plans.items()):
            # Weight-left only where it runs: the reduced copy takes the rows up to reduced_rows.
            rows = frozenset(m for m, left in zip(plan.grid, plan.weight_left) if left and m > plan.reduced_rows)
            what = "oneDNN packed" if plan.packed else f"weight-left at M={_ranges(rows)}" if rows else "F.linear"
            if plan.reduced_rows:
                what += f", {plan.reduced_kind} copy at M={_ranges(frozenset(range(1, plan.reduced_rows + 1)))}"
            parts.append(f"{out}x{inp}: {what}{self._gain_text((out, inp)) if plan.swaps else ''}")
        return "; ".join(parts) + ("" if self.complete else " (budget ran out: the rest stays F.linear)")

    def _gain_text(self, shape: tuple[int, int]) -> str:
        """F.linear's time over the chosen path's at M = 1 and the largest decode M measured."""
        timing, plan = self.timings.get(shape, {}), self.plans[shape]
        library = timing.get(LINEAR, {})
        decode = sorted(m for m in library if m != PREFILL_ROWS)
        gains = []
        for m in sorted({decode[0], decode[-1]}) if decode else []:
            path = (REDUCED if m <= plan.reduced_rows else PACKED if plan.packed
                    else WEIGHT_LEFT if plan.weight_left_at(m) else LINEAR)
            chosen = timing.get(path, {}).get(m)
            if chosen:
                gains.append(f"{library[m] / chosen:.1f}x at M={m}")
        return f" ({', '.join(gains)})" if gains else ""


def _ranges(ms: frozenset[int]) -> str:
    """{2, 3, 4, 6} -> "2-4,6"."""
    runs = [[m for _, m in group] for _, group in itertools.groupby(enumerate(sorted(ms)), lambda im: im[1] - im[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def best_ms(runs: dict[str, Callable[[], object]], reps: int, clock: Callable[[], float] = time.perf_counter,
            warm_ups: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Per path, the fastest of `reps` runs after a warm-up (its entry in `warm_ups`, else one run;
    contention only adds time), the paths in turn, the order rotated each round (no path always runs
    after the same one): a slow spell of the machine then costs each path one run, not all runs of one
    path. (Timed path after path, the draft's packed LM head once lost to F.linear, loadtest run 56 on
    the Zen 5.)"""
    for path, run in runs.items():
        (warm_ups or {}).get(path, run)()  # warm-up: allocations, kernel choice
    best = {path: math.inf for path in runs}
    order = list(runs.items())
    last = None
    for i in range(max(1, reps)):
        turn = order[i % len(order):] + order[:i % len(order)]
        if turn[0][0] == last:  # two paths: a path run twice in a row would find its weights in cache
            turn = turn[1:] + turn[:1]
        for path, run in turn:
            start = clock()
            run()
            best[path] = min(best[path], clock() - start)
        last = turn[-1][0]
    return {path: seconds * 1000.0 for path, seconds in best.items()}


def measured_ms(max_m: int) -> list[int]:
    """Token counts to time: every one up to 4 (where kernels switch most), then a sparser grid."""
    return sorted({m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if m <= max_m} | {max_m})


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """Storage of weights held by more than one module (tied embeddings): packing those would keep two copies."""
    held = collections.Counter(p.data_ptr() for m in model.modules() for p in m.parameters(recurse=False))
    return {ptr for ptr, n in held.items() if n > 1}


class _ShapeTimer:
    """Times the paths of one weight shape, in ms per layer. Each timing is one pass over about
    COLD_BYTES of the shape's weights: for layers up to that size, as many whole layers as COLD_BYTES
    takes (or all there are), the time divided by their count; for a single layer larger than that,
    its first rows, about COLD_BYTES of them, the time scaled by its rows over theirs: past COLD_BYTES
    a GEMM's weight costs per byte what the whole does. (Timed whole, the 1.5B float32 target's 933 MB
    LM head took 6.9 of its 10.9 s of measuring on a 2-core Zen 4, and its attention projections were
    left untimed, on F.linear.)"""

    def __init__(self, linears: list[torch.nn.Linear], reps: int, can_pack: bool, reduced_kind: str | None = None) -> None:
        first = linears[0]
        layer_bytes = max(1, first.weight.numel() * first.weight.element_size())
        if layer_bytes > COLD_BYTES:
            row_bytes = first.in_features * first.weight.element_size()
            rows = min(first.out_features, math.ceil(COLD_BYTES / row_bytes / ROW_BLOCK) * ROW_BLOCK)
            self.linears = linears[:1]
            self.weights = [(first.weight[:rows], None if first.bias is None else first.bias[:rows])]
            self.scale = first.out_features / rows
        else:
            self.linears = linears[:max(1, math.ceil(COLD_BYTES / layer_bytes))]
            self.weights = [(lin.weight, lin.bias) for lin in self.linears]
            self.scale = 1.0 / len(self.linears)
        self.reps = reps
        self.packed = [pack(weight) for weight, _ in self.weights] if can_pack else []
        self.reduced_kind = reduced_kind
        self.reduced: list[ReducedCopy] = []
        # What the first layer's int4 copy stands for, on the outputs the agreement check compares
        # (only those: the whole of an LM head's slice, dequantised, is hundreds of MB).
        self.dequantized: torch.Tensor | None = None
        if reduced_kind:
            try:
                if reduced_kind == INT4:  # the whole layer must fit, not only the slice timed
                    int4_fits(first.out_features, first.in_features)
                self.reduced = [_reduced_copy(weight, bias, reduced_kind) for weight, bias in self.weights]
                if reduced_kind == INT4:  # rows quantise independently: these are the copy's own values
                    self.dequantized = quantize_int4(self.weights[0][0][:AGREEMENT_OUTPUTS], dequantized=True)[1]
            except (ValueError, RuntimeError) as exc:  # a shape the kernel refuses: no copy for it
                log.info("no %s copy for %dx%d: %s", reduced_kind, first.out_features, first.in_features, exc)
                self.reduced = []
        self.ms: dict[str, dict[int, float]] = ({LINEAR: {}, WEIGHT_LEFT: {}} | ({PACKED: {}} if can_pack else {})
                                               | ({REDUCED: {}} if self.reduced else {}))

    def _runs(self, x: torch.Tensor, layers: slice) -> dict[str, Callable[[], list[torch.Tensor]]]:
        """Each path's run over the timed layers in `layers`."""
        weights, packed, reduced = self.weights[layers], self.packed[layers], self.reduced[layers]
        runs: dict[str, Callable[[], list[torch.Tensor]]] = {
            LINEAR: lambda: [F.linear(x, w, b) for w, b in weights],
            WEIGHT_LEFT: lambda: [weight_left(x, w, b) for w, b in weights],
        }
        if packed:
            runs[PACKED] = lambda: [packed_linear(x, p, b, w.shape[0]) for p, (w, b) in zip(packed, weights)]
        if reduced:
            runs[REDUCED] = lambda: [reduced_linear(x, w, b) for w, b in reduced]
        return {path: run for path, run in runs.items() if path in self.ms}

    def drop_disagreeing(self, rows: tuple[int, ...]) -> dict[str, str]:
        """Compare each path's output with F.linear's on the first (sliced) layer at each row count, on a
        random input; a path that disagrees (or fails) is dropped from the timings, so it is never
        chosen. Returns the dropped paths, each with why."""
        first = self.linears[0]
        gen = torch.Generator().manual_seed(0)
        dropped: dict[str, str] = {}
        checked = slice(0, AGREEMENT_OUTPUTS)  # outputs compared: enough, and cheap on a vocabulary head
        weight, bias = self.weights[0]
        with torch.inference_mode():
            for m in rows:
                x = torch.randn(m, first.in_features, generator=gen)
                x = x.to(device=first.weight.device, dtype=first.weight.dtype)
                runs = self._runs(x, slice(0, 1))
                reference = runs.pop(LINEAR)()[0][..., checked]
                for path, run in runs.items():
                    if path in dropped:
                        continue
                    # An int4 copy stands for its dequantised weight: its product is checked against that one's.
                    stands_for = self.dequantized if path == REDUCED and self.dequantized is not None else None
                    against = weight[checked] if stands_for is None else stands_for[checked].to(weight.dtype)
                    expected = reference if stands_for is None else F.linear(
                        x, against, None if bias is None else bias[checked])
                    # The rounding a reduced path applies to its operands and output.
                    operands = (INT4_PRODUCTS if self.reduced_kind == INT4 else REDUCED_DTYPE) if path == REDUCED else None
                    try:
                        error = agreement(run()[0][..., checked], expected, x, against,
                                          None if bias is None else bias[checked], operands)
                    except RuntimeError as exc:
                        dropped[path] = f"fails at M={m}: {exc}"
                        continue
                    if not error <= 1.0:
                        dropped[path] = f"differs by {error:.3g}x the reduction-order tolerance at M={m}"
        for path in dropped:
            del self.ms[path]
        if PACKED in dropped:
            self.packed = []
        if REDUCED in dropped:
            self.reduced = []
        self.dequantized = None  # checked: its memory goes back before the timings
        return dropped

    def time(self, m: int, only: tuple[str, ...] | None = None) -> None:
        """Time the paths at m rows (`only`: just these of them)."""
        first = self.linears[0]
        x = torch.randn(m, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
        # Warming a GEMM shape's kernels up takes one of its layers: the last one, which leaves the
        # cache as a whole pass would (the timed pass starts cold, at the first layer). Only a shape's
        # first timing warms the whole pass: the first reads of a memory-mapped checkpoint fault pages in.
        warm_ups = self._runs(x, slice(-1, None)) if self.ms[LINEAR] else None
        runs = self._runs(x, slice(None))
        if only is not None:
            runs = {path: run for path, run in runs.items() if path in only}
            warm_ups = {path: run for path, run in (warm_ups or {}).items() if path in only} or None
        if REDUCED in runs and (m >= PREFILL_ROWS or self.reduced_lost_below(m)):
            # Its cost grows with the rows: a loss at fewer rows is one here. And it only ever takes
            # decode rows: a prompt chunk's would time the copies' slowest case for nothing.
            del runs[REDUCED]
        with torch.inference_mode():
            for path, ms in best_ms(runs, self.reps, warm_ups=warm_ups).items():
                self.ms[path][m] = ms * self.scale

    def reduced_lost_below(self, m: int) -> bool:
        """The reduced path lost at a row count below m (or was dropped): it did not beat the better of
        the dense and packed choice there by MIN_GAIN (the rule of `_plan`'s rows it surely takes)."""
        if REDUCED not in self.ms:
            return True
        return any(r < m and not self.ms[REDUCED][r] < MIN_GAIN * self.float_ms(r) for r in self.ms[REDUCED])

    def float_ms(self, m: int) -> float:
        """The better float32 choice at m: the dense path's (weight-left only by MIN_GAIN) or packed."""
        return min(self.dense_ms(m), self.ms.get(PACKED, {}).get(m, math.inf))

    def left_wins(self, m: int) -> bool:
        return m in self.ms.get(WEIGHT_LEFT, {}) and self.ms[WEIGHT_LEFT][m] < MIN_GAIN * self.ms[LINEAR][m]

    def dense_ms(self, m: int) -> float:
        """The dense path's time at m (inf where only the packed and reduced paths were timed)."""
        return self.ms[WEIGHT_LEFT if self.left_wins(m) else LINEAR].get(m, math.inf)

    def packed_wins(self, m: int) -> bool:
        return PACKED in self.ms and self.ms[PACKED][m] <= self.dense_ms(m)


def _plan(timer: _ShapeTimer, decode: list[int], prefill: int | None) -> ShapePlan:
    """Packed if it is faster on average over the decode row counts (each count weighs the same, as a
    ratio to the best path there) and does not slow a prompt chunk past PREFILL_SLACK; else dense.
    With a reduced path: it takes the row counts from 1 up to where it stops beating the plan by
    MIN_GAIN, and the packed-or-dense choice is made over the row counts it leaves (those it surely
    takes, where it beats every float32 path, would otherwise decide a choice they never run)."""
    taken = _reduced_rows(timer, decode, timer.float_ms)
    plan = _float_plan(timer, [m for m in decode if m > taken] or decode, prefill)
    rows = _reduced_rows(timer, decode, lambda m: timer.ms[PACKED][m] if plan.packed else timer.dense_ms(m))
    return dataclasses.replace(plan, reduced_rows=rows, reduced_kind=timer.reduced_kind) if rows else plan


def _reduced_rows(timer: _ShapeTimer, decode: list[int], float_ms: Callable[[int], float]) -> int:
    """The largest row count of the prefix of `decode` where the reduced path beats float_ms by MIN_GAIN."""
    reduced_ms = timer.ms.get(REDUCED, {})
    rows = 0
    for m in decode:
        if not (m in reduced_ms and reduced_ms[m] < MIN_GAIN * float_ms(m)):
            break
        rows = m
    return rows


def _float_plan(timer: _ShapeTimer, decode: list[int], prefill: int | None) -> ShapePlan:
    grid = tuple(sorted(timer.ms[LINEAR]))
    dense = ShapePlan(False, grid, tuple(timer.left_wins(m) for m in grid))
    if PACKED not in timer.ms:
        return dense
    packed_ms = timer.ms[PACKED]
    packed_score = sum(packed_ms[m] / timer.float_ms(m) for m in decode)
    dense_score = sum(timer.dense_ms(m) / timer.float_ms(m) for m in decode)
    prompt_ok = prefill is None or packed_ms[prefill] <= PREFILL_SLACK * timer.dense_ms(prefill)
    return ShapePlan(packed=True) if packed_score < dense_score and prompt_ok else dense


def measure(model: torch.nn.Module, max_m: int, budget_s: float, reps: int = 2,
            clock: Callable[[], float] = time.monotonic, allow_packing: bool = True,
            reduced_kind: str | None = None) -> PathChoice:
    """Time the paths for each distinct Linear shape at M = 1..max_m (and a prompt chunk's rows).
    `reduced_kind`: the kind of copy the reduced path may use (INT4, BF16: a draft's, never a target's;
    None: no copy).

    The end points and the middle (M = 1, the middle of the grid, max_m, the prompt chunk) come
    first: where the packed path wins at all of them, it is taken without timing the rest (a
    shortcut: a dense path winning only between them would go unseen), bar the row counts the
    reduced path may still win (those below the first it lost at)."""
    if reduced_kind not in (None, *REDUCED_KINDS):
        raise ValueError(f"reduced_kind must be one of {', '.join(REDUCED_KINDS)} or None, got {reduced_kind!r}")
    started = clock()
    choice = PathChoice()
    by_shape: dict[tuple[int, int], list[torch.nn.Linear]] = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            by_shape.setdefault((module.out_features, module.in_features), []).append(module)
    shared = _shared_weights(model)
    decode = measured_ms(max_m)
    prefill = PREFILL_ROWS if PREFILL_ROWS > max_m else None
    # Where the time goes first (weight bytes x how many layers have the shape), so a tight budget
    # still covers what matters. That is also the order of the most there is to gain per second of
    # measuring: a shape's timings cost one pass over at most COLD_BYTES, the same for every shape
    # that has that many bytes (less for the rest), whatever its size.
    for shape, linears in sorted(by_shape.items(), key=lambda kv: -kv[0][0] * kv[0][1] * len(kv[1])):
        if clock() - started > budget_s:
            choice.complete = False
            break
        can_pack = (allow_packing and packing_supported(linears[0].weight.dtype)
                    and linears[0].weight.device.type == "cpu"
                    and not any(lin.weight.data_ptr() in shared for lin in linears))
        # A tied weight may take a reduced copy: that is another format, not a second copy of the same.
        dtype, on_cpu = linears[0].weight.dtype, linears[0].weight.device.type == "cpu"
        kind = reduced_kind if on_cpu and (
            (reduced_kind == BF16 and dtype == torch.float32)
            or (reduced_kind == INT4 and dtype in (torch.float32, torch.bfloat16) and int4_supported())) else None
        timer = _ShapeTimer(linears, reps, can_pack, kind)
        # Compared at one row, two (a reduced path's GEMM rather than its matrix-vector kernel) and the most.
        checked = tuple(sorted({decode[0], decode[min(1, len(decode) - 1)], decode[-1]}))
        for path, why in timer.drop_disagreeing(checked).items():
            log.warning("GEMM path %s %s for the %dx%d weights (not F.linear's product): never chosen for them",
                        path, why, *shape)
        ends = sorted({decode[0], decode[len(decode) // 2], decode[-1]} | ({prefill} if prefill else set()))
        order = ends + [m for m in decode if m not in ends]
        for i, m in enumerate(order):
            shortcut = i >= len(ends) and all(timer.packed_wins(e) for e in ends)
            if shortcut and timer.reduced_lost_below(m):
                break  # packed wins where it was timed: take it without the rest
            if clock() - started > budget_s:
                choice.complete = False
                break
            # Past the shortcut only the reduced copy can still beat packed: the dense paths are not timed.
            timer.time(m, only=(PACKED, REDUCED) if shortcut else None)
        if not choice.complete:
            break
        timed_decode = [m for m in decode if m in timer.ms[LINEAR] or m in timer.ms.get(REDUCED, {})]
        choice.plans[shape] = _plan(timer, timed_decode, prefill)
        choice.timings[shape] = timer.ms
        del timer  # its copies and packed weights go before the next shape's are made
    choice.seconds = clock() - started
    return choice


def _planned_linears(model: torch.nn.Module,
                     choice: PathChoice) -> Iterator[tuple[torch.nn.Module, str, torch.nn.Linear, ShapePlan]]:
    """(parent, attribute name, nn.Linear, its shape's plan) for every plain nn.Linear the choice has a
    plan for; listed up front, so that the caller may swap them as it goes."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                plan = choice.plans.get((child.out_features, child.in_features))
                if plan is not None:
                    yield parent, name, child, plan


def apply(model: torch.nn.Module, choice: PathChoice, copies: dict[int, ReducedCopy] | None = None) -> int:
    """Swap every nn.Linear whose shape's plan differs from F.linear for a PathLinear; returns how many.
    `copies`: reduced copies of this choice made already, by id of the nn.Linear (copies_only)."""
    from specdec.models import own_tensors
    swapped = 0
    for parent, name, child, plan in _planned_linears(model, choice):
        if plan.swaps:
            made = copies.get(id(child)) if copies and plan.reduced_rows else None
            if made is not None and (INT4 if isinstance(made[0], Int4Weight) else BF16) != plan.reduced_kind:
                made = None  # not this plan's kind of copy: made anew
            setattr(parent, name, PathLinear(child, plan, made))
            swapped += 1
    if any(plan.packed for plan in choice.plans.values()):
        own_tensors(model)  # the dense weights are gone: let the checkpoint's mapping go with them
    return swapped


def reduced_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of the reduced copies the model's PathLinears hold (beside their weights)."""
    return sum(_copy_bytes(m.reduced) for m in model.modules() if isinstance(m, PathLinear) and m.reduced)


def without_copies_on(choice: PathChoice, shapes: set[tuple[int, int]]) -> PathChoice:
    """The same choice with no copies for these shapes (their other path at every row count)."""
    return dataclasses.replace(choice, plans={
        shape: dataclasses.replace(plan, reduced_rows=0, reduced_kind=None) if shape in shapes else plan
        for shape, plan in choice.plans.items()})


def without_reduced(choice: PathChoice) -> PathChoice:
    """The same choice with no copies: every shape runs its other path at every row count."""
    return without_copies_on(choice, set(choice.plans))


def copy_rows(choice: PathChoice) -> int:
    """The most rows any shape runs on a reduced copy (0: no copies)."""
    return max((plan.reduced_rows for plan in choice.plans.values()), default=0)


@contextlib.contextmanager
def copies_only(model: torch.nn.Module, choice: PathChoice,
                reuse: dict[int, ReducedCopy] | None = None) -> Iterator[dict[int, ReducedCopy]]:
    """Within: the choice's reduced copies swapped in alone, every other product on the model's own
    nn.Linear weights (F.linear), which stay as they are; on exit the nn.Linears come back, also
    after an error. What a check of the copies needs before `apply` packs weights for good (packing
    drops the dense weight that another kind of copy would be made from). Yields the copies by id of
    the nn.Linear they stand for, filled as they are made, for `apply` to reuse. `reuse`: copies of
    the same kind made before (by id of the nn.Linear), taken instead of making them again."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    made: dict[int, ReducedCopy] = {}
    try:
        for parent, name, child, plan in _planned_linears(model, choice):
            if plan.reduced_rows:
                path = PathLinear(child, ShapePlan(reduced_rows=plan.reduced_rows, reduced_kind=plan.reduced_kind),
                                  (reuse or {}).get(id(child)))
                setattr(parent, name, path)
                swapped.append((parent, name, child))
                made[id(child)] = path.reduced  # type: ignore[assignment]
        yield made
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


PARTIAL_CHECKS = 2  # checks of a kind's copies on fewer shapes, once its whole plan failed


@torch.inference_mode()
def copy_errors(model: torch.nn.Module, choice: PathChoice, copies: dict[int, ReducedCopy],
                tokens: int = 16) -> dict[tuple[int, int], float]:
    """Per shape with copies: how far its copies' products are from the weights' own, relative, on the
    inputs the model's own forward over `tokens` seeded token ids gives each nn.Linear (its first
    call; mean over the layers). Real inputs, not random ones: activations carry a few large
    channels, where a copy's error costs most, which random inputs would not show. {} where the
    model is no causal LM with a config.vocab_size (nothing to rank by)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        return {}
    inputs: dict[int, torch.Tensor] = {}
    planned = [(child, copies[id(child)]) for _, _, child, plan in _planned_linears(model, choice)
               if plan.reduced_rows and id(child) in copies]

    def keep_input(module: torch.nn.Module, args: tuple) -> None:  # None: the input goes on as it was
        inputs.setdefault(id(module), args[0].reshape(-1, module.in_features))
    device = next(model.parameters()).device
    ids = torch.randint(0, max(1, vocab // 2), (1, tokens), generator=torch.Generator().manual_seed(2)).to(device)
    hooks = []
    try:
        for child, _ in planned:
            hooks.append(child.register_forward_pre_hook(keep_input))
        model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    errors: dict[tuple[int, int], list[float]] = {}
    for child, copy in planned:
        x = inputs.get(id(child))
        if x is None:
            continue
        ref = F.linear(x, child.weight, child.bias).float()
        got = reduced_linear(x, *copy).float()
        errors.setdefault((child.out_features, child.in_features), []).append(
            ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item())
    return {shape: sum(v) / len(v) for shape, v in errors.items()}


def _fewer_shapes(model: torch.nn.Module, kind: str, choice: PathChoice, made: dict[int, ReducedCopy],
                  check: Callable[[int], float], min_score: float,
                  checks: list[tuple[str, float, bool]]) -> tuple[PathChoice | None, dict[int, ReducedCopy] | None]:
    """A kind whose copies failed the check on all their shapes, tried without the copies of the shape
    whose products they change most, then also the next (copy_errors), while a shape keeps copies, up
    to PARTIAL_CHECKS checks: (the choice and its copies) of the first that passes, else (None, None).
    Each check is recorded in `checks` as "<kind> except <shapes>". `made`: the copies the failed
    check ran on, by id of the nn.Linear, or empty where they were let go (while another kind was
    measured): then made again here. Every trial reuses them; `made` is emptied on return."""
    try:
        if not made:
            with copies_only(model, choice) as fresh:
                pass  # made, and the nn.Linears back
            made.update(fresh)
        try:
            errors = copy_errors(model, choice, made)
        except Exception as exc:  # a ranking that fails leaves the draft as before: without copies
            log.warning("could not rank the %s copies' shapes (%s: %s): not trying fewer shapes", kind,
                        type(exc).__name__, exc)
            return None, None
        ranked = sorted(errors, key=errors.get, reverse=True)  # type: ignore[arg-type]
        if len(ranked) < 2:
            log.info("the %s copies are on %d shape(s) ranked: no fewer shapes to try", kind, len(ranked))
            return None, None
        dropped: set[tuple[int, int]] = set()
        for shape in ranked[:PARTIAL_CHECKS]:
            dropped.add(shape)
            trial = without_copies_on(choice, dropped)
            rows = copy_rows(trial)
            if not rows:
                break
            with copies_only(model, trial, reuse=made) as kept:
                score = check(rows)
            without = ", ".join(f"{out}x{inp}" for out, inp in sorted(dropped))
            checks.append((f"{kind} except {without}", score, score >= min_score))
            if score >= min_score:
                log.info("the %s weight copies without those of %s (dropped: relative product error %s) keep %.3f "
                         "of the model's token distributions", kind, without,
                         ", ".join(f"{errors[s]:.3f}" for s in sorted(dropped)), score)
                return trial, kept
            log.warning("the %s weight copies without those of %s keep %.3f of the model's token distributions "
                        "(under %.2f)", kind, without, score, min_score)
            kept.clear()
        return None, None
    finally:
        made.clear()  # the copies kept, if any, are the trial's (the same objects)


def choose_and_apply(model: torch.nn.Module, max_m: int, budget_s: float, reduced_kinds: tuple[str, ...] = (),
                     check: Callable[[int], float] | None = None, min_score: float = 0.0) -> PathChoice:
    """Measure on this machine and apply; CPU only (GPU GEMMs have no such small-M cliff).

    `reduced_kinds`: the kinds of copy the reduced path may use, in order of preference (a draft's;
    models.reduced_copy_kinds). Each is measured in turn (with a budget of its own: a fallback can
    double the time measuring takes) until one is kept. A kind is passed over where its copies win
    no shape's timing, or where `check` is given and check(rows of the copies), run with the copies
    alone swapped in (copies_only), scores below `min_score` (a WARNING). Where no kind is kept on
    all its shapes, each is tried on fewer (`_fewer_shapes`: without the shapes whose products its
    copies change most, at most PARTIAL_CHECKS more checks a kind): which shapes a budget-bound
    measurement reached decided whether the draft ran with copies at all (seen: 0.879 with three
    shapes, 0.944 with two, in two startups of the same draft). Where none is kept, the first
    measurement's plan runs, without its copies."""
    device = next(model.parameters()).device
    if device.type != "cpu" or budget_s <= 0:
        return PathChoice()
    kinds: tuple[str | None, ...] = reduced_kinds or (None,)
    checks: list[tuple[str, float, bool]] = []
    seconds, first, kept, copies = 0.0, None, None, None
    # Kinds whose copies failed the check on all their shapes, with those copies: each set is let go
    # before another kind is measured or retried, so that two sets are never held at once.
    failed: list[tuple[str, PathChoice, dict[int, ReducedCopy]]] = []
    for i, kind in enumerate(kinds):
        for *_, earlier in failed:
            earlier.clear()
        choice = measure(model, max_m, budget_s, reduced_kind=kind)
        seconds += choice.seconds
        first = choice if first is None else first
        rows = copy_rows(choice)
        if not rows:
            continue  # no shape took this kind of copy
        if check is None:
            kept = choice
            break
        started = time.monotonic()
        with copies_only(model, choice) as made:
            score = check(rows)
        seconds += time.monotonic() - started
        checks.append((kind, score, score >= min_score))  # type: ignore[arg-type]
        if score >= min_score:
            log.info("the %s weight copies keep %.3f of the model's token distributions", kind, score)
            kept, copies = choice, made
            break
        log.warning("the %s weight copies keep %.3f of the model's token distributions (under %.2f): %s", kind,
                    score, min_score, "measuring the next kind" if i + 1 < len(kinds) else "trying fewer shapes")
        failed.append((kind, choice, made))  # type: ignore[arg-type]
    # No kind kept on all its shapes: each, in turn, without the copies of the shapes whose products
    # they change most (copy_errors), a shape at a time, at most PARTIAL_CHECKS checks a kind.
    for kind, choice, made in failed if kept is None else ():
        for *_, other in failed:
            if other is not made:
                other.clear()
        started = time.monotonic()
        kept, copies = _fewer_shapes(model, kind, choice, made, check, min_score, checks)  # type: ignore[arg-type]
        seconds += time.monotonic() - started
        if kept is not None:
            break
    if failed and kept is None:
        log.warning("no kind of weight copy kept the model's token distributions on any shapes tried: running "
                    "without copies")
    assert first is not None  # kinds is never empty
    choice = kept if kept is not None else without_reduced(first)
    if choice is not first:
        # A later kind's measurement that ran out of budget: the shapes it did not reach keep the
        # first measurement's plan, without its copies (packed where that won), not F.linear.
        for shape, plan in without_reduced(first).plans.items():
            if shape not in choice.plans:
                choice.plans[shape], choice.timings[shape] = plan, first.timings[shape]
        choice.complete = choice.complete or first.complete
    choice.seconds, choice.copy_checks = seconds, checks
    started = time.monotonic()
    swapped = apply(model, choice, copies)
    copy_bytes = reduced_copy_bytes(model)
    copied = "/".join(sorted({str(plan.reduced_kind) for plan in choice.plans.values() if plan.reduced_rows}))
    log.info("GEMM path (%.1fs measuring, %.1fs swapping in, %d linears swapped%s): %s", choice.seconds,
             time.monotonic() - started, swapped,
             f", {copied} copies {copy_bytes / 2**20:.0f} MiB beside the weights" if copy_bytes else "",
             choice.summary())
    return choice
