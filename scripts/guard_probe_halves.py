"""Why the pair guard does not end a speculating probe early: the first half of a probe is not a
fair sample of it. Replayed offline on recorded round traces (`specdec loadtest --trace-file F`).

For each run of speculating rounds that follows a run of target-only ones (roughly a probe: the
trace records each round's guard mode, not the guard's epochs, so consecutive epochs can merge), it
compares the probe's steady rounds (not a turn's first, no draft catch-up) with the target-only
run's steady rounds without prompt rows: the first 16 rounds (half the default probe), the next 16
and the whole. It also says where a sequential test (rate plus z standard errors of the ratio
estimator below target-only's, from round 16 on) would have ended the probe. An approximation of
what the guard counts: no scaling of prompt rows out of a round, no clean-round filter.

On the Zen 5 traces (loadtest runs 28-56) the first half is often well below the second at 4
streams (0.82 then 1.10x, 0.68 then 1.28x): the draft's catch-ups and first rounds at a probe's
start slow the rounds beside them. A test on the first half would end probes that win or tie over
their whole length (run 28: 0.98x overall, ended at 17 rounds), so the guard runs every probe in
full (tried in 2a76ecb, reverted; docs/benchmarks.md, "Runs 55-56").

    python scripts/guard_probe_halves.py docs/bench/amd-epyc-zen5/loadtest-run*/rounds.jsonl.gz [--z 2]
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path

HALF_PROBE = 16  # half of guard_spec_rounds' default


def runs_of_modes(rounds: list[dict]) -> list[tuple[str, list[dict]]]:
    """Consecutive rounds (in the order they ended) with the same guard mode."""
    runs: list[tuple[str, list[dict]]] = []
    for record in rounds:
        if runs and runs[-1][0] == record["guard"]:
            runs[-1][1].append(record)
        else:
            runs.append((record["guard"], [record]))
    return runs


def first_clear_loss(probe: list[dict], off_rate: float, z: float) -> tuple[int, float] | None:
    """(rounds, rate / off_rate) where the probe's rate plus z standard errors first fell below off_rate."""
    n = tokens = ms = tt = mm = tm = 0.0
    for record in probe:
        x, y = float(record["emitted"]), float(record["round_ms"])
        n, tokens, ms = n + 1, tokens + x, ms + y
        tt, mm, tm = tt + x * x, mm + y * y, tm + x * y
        if n >= HALF_PROBE:
            rate = tokens / ms
            residuals = max(0.0, tt - 2.0 * rate * tm + rate * rate * mm)
            error = math.sqrt(residuals / (n * (n - 1))) / (ms / n)
            if rate + z * error < off_rate:
                return int(n), rate / off_rate
    return None


def rate(rounds: list[dict]) -> float:
    return sum(r["emitted"] for r in rounds) / sum(r["round_ms"] for r in rounds)


def replay(path: Path, z: float) -> None:
    with gzip.open(path, "rt") as f:
        rounds = sorted((json.loads(line) for line in f), key=lambda r: r["ts"])
    runs = runs_of_modes([r for r in rounds if r["policy"] == "cost"])
    for i in range(1, len(runs)):
        (before, off_rounds), (mode, spec_rounds) = runs[i - 1], runs[i]
        if mode != "spec" or before != "off":
            continue
        off = [r for r in off_rounds if r["round"] > 1 and r["target_prompt_rows"] == 0]
        probe = [r for r in spec_rounds if r["round"] > 1 and r["draft_prefilled"] <= 2]
        if len(off) < 4 or len(probe) < HALF_PROBE:
            continue
        off_rate = rate(off)
        first = rate(probe[:HALF_PROBE]) / off_rate
        second = f"{rate(probe[HALF_PROBE:2 * HALF_PROBE]) / off_rate:.2f}x" if len(probe) > HALF_PROBE else "-"
        batch = max(r["target_batch"] for r in spec_rounds)
        stop = first_clear_loss(probe, off_rate, z)
        where = f"a test at z = {z:g} ends it after {stop[0]} rounds" if stop else "no early end"
        print(f"{path.parent.name}: probe at batch <= {batch:.0f}, {len(probe)} steady rounds against target-only: "
              f"first {HALF_PROBE} {first:.2f}x, next {HALF_PROBE} {second}, whole {rate(probe) / off_rate:.2f}x; {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--z", type=float, default=2.0)
    args = parser.parse_args()
    for path in args.traces:
        replay(path, args.z)


if __name__ == "__main__":
    main()
