"""The GEMM path for small-M decode on CPU, chosen per weight shape and token count at startup.

A decode forward multiplies M = 1..k+1 token rows by each weight matrix. On some CPUs (measured on
AMD EPYC with AVX2 and with AVX-512) `F.linear` on small M grows almost linearly with M, while the
same product computed weight-left, `(W @ x.T).T`, stays near the memory-bound cost of reading W once.
On others `F.linear` is already flat (reported for Intel machines with AMX). Nothing here is tuned to one machine: each
worker times both orientations for every distinct weight shape of its model at M = 1..max_m and uses
the faster one per (shape, M). The choice only changes the reduction order of the same product, the
way any batch size or kernel switch does.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Weight-left must win by this margin: ties go to the library's own kernel.
MIN_GAIN = 0.9


def weight_left(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T computed as (W @ x.T).T: the GEMM sees the weight as its left, large operand."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.matmul(weight, rows.T).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class PathLinear(torch.nn.Module):
    """nn.Linear with a per-M choice of orientation (same parameters, same state_dict keys)."""

    def __init__(self, linear: torch.nn.Linear, weight_left_ms: frozenset[int]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight_left_ms = weight_left_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features in self.weight_left_ms:
            return weight_left(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class PathChoice:
    """Per weight shape (out, in): the token counts that run weight-left, and the measured gains."""
    weight_left_ms: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict)
    speedup: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    seconds: float = 0.0
    complete: bool = True

    def summary(self) -> str:
        if not self.weight_left_ms:
            return "F.linear everywhere (measurement skipped)"
        parts = []
        for shape, ms in sorted(self.weight_left_ms.items()):
            parts.append(f"{shape[0]}x{shape[1]}: weight-left at M={_ranges(ms)}" if ms else
                         f"{shape[0]}x{shape[1]}: F.linear")
        return "; ".join(parts) + ("" if self.complete else " (budget ran out: the rest stays F.linear)")


def _ranges(ms: frozenset[int]) -> str:
    out, run = [], []
    for m in sorted(ms):
        if run and m != run[-1] + 1:
            out.append(run)
            run = []
        run.append(m)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: first call allocates and picks kernels
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1000.0


def measured_ms(max_m: int) -> list[int]:
    """Token counts to time: every one up to 4 (where kernels switch most), then a sparser grid; a
    count in between takes the choice of the nearest measured count below it."""
    return sorted({m for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32) if m <= max_m} | {max_m})


def measure(model: torch.nn.Module, max_m: int, budget_s: float, reps: int = 3,
            clock: Callable[[], float] = time.monotonic) -> PathChoice:
    """Time F.linear against weight-left for each distinct Linear shape at M = 1..max_m."""
    started = clock()
    choice = PathChoice()
    shapes: dict[tuple[int, int], torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault((module.out_features, module.in_features), module)
    # Where the time goes first (weight bytes x how many layers have the shape), so a tight budget
    # still covers what matters.
    count: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.out_features, module.in_features)
            count[shape] = count.get(shape, 0) + 1
    for shape, linear in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1] * count[kv[0]]):
        chosen, gains = set(), {}
        grid = measured_ms(max_m)
        for i, m in enumerate(grid):
            if clock() - started > budget_s:
                choice.complete = False
                break
            x = torch.randn(m, shape[1], dtype=linear.weight.dtype, device=linear.weight.device)
            with torch.inference_mode():
                library = _median_ms(lambda: F.linear(x, linear.weight, linear.bias), reps)
                left = _median_ms(lambda: weight_left(x, linear.weight, linear.bias), reps)
            gains[m] = library / max(left, 1e-6)
            if left < MIN_GAIN * library:
                upto = grid[i + 1] if i + 1 < len(grid) else m + 1
                chosen.update(range(m, upto))
        choice.weight_left_ms[shape] = frozenset(chosen)
        choice.speedup[shape] = gains
        if not choice.complete:
            break
    choice.seconds = clock() - started
    return choice


def apply(model: torch.nn.Module, choice: PathChoice) -> int:
    """Swap every nn.Linear whose shape has weight-left token counts for a PathLinear; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                ms = choice.weight_left_ms.get((child.out_features, child.in_features), frozenset())
                if ms:
                    setattr(parent, name, PathLinear(child, ms))
                    swapped += 1
    return swapped


def choose_and_apply(model: torch.nn.Module, max_m: int, budget_s: float) -> PathChoice:
    """Measure on this machine and apply; CPU only (GPU GEMMs have no such small-M cliff)."""
    device = next(model.parameters()).device
    if device.type != "cpu" or budget_s <= 0:
        return PathChoice()
    choice = measure(model, max_m, budget_s)
    swapped = apply(model, choice)
    log.info("GEMM path (%.1fs, %d linears swapped): %s", choice.seconds, swapped, choice.summary())
    return choice
