"""Piecewise-linear cost curves: (x, ms) points sorted by x, as the workers measure them (forward time
over token rows) and the k policy learns them. Pure Python: the orchestrator, the scheduler and the
contract share one reading of a curve."""
from __future__ import annotations

from collections.abc import Sequence

Curve = Sequence[tuple[float, float]]


def interpolate(curve: Curve, x: float) -> float | None:
    """Linear between the two points of `curve` around x; None outside its range."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
    return None


def extended(curve: Curve, x: float) -> float | None:
    """interpolate, with the first point's value below the curve and the last segment's slope (never
    negative) past its end; None with fewer than two points."""
    if len(curve) < 2:
        return None
    if x <= curve[0][0]:
        return curve[0][1]
    within = interpolate(curve, x)
    if within is not None:
        return within
    (x0, y0), (x1, y1) = curve[-2], curve[-1]
    slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
    return y1 + max(0.0, slope) * (x - x1)
