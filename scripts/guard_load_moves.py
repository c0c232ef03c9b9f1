"""How much a load that keeps moving costs the pair guard: synthetic rounds (pure Python, no
models, deterministic), speculation winning at every load (3 tokens in 100 ms against 1 in 50),
the pair's concurrency moving between two levels every N batched steps. Prints the share of rounds
the guard ran target-only; at a steady load it is the probes' cost (about MEASUREMENT_COST).

    python scripts/guard_load_moves.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.guard import SPECULATE, GuardSettings, PairGuard  # noqa: E402

SPEC_ROUND, OFF_ROUND = (3, 100.0), (1, 50.0)  # (tokens, ms)
TOTAL_STEPS = 20000


def play(guard: PairGuard, steps: int, width: int) -> tuple[int, int]:
    """`width` sessions whose rounds are decided together and end together, `steps` times: (rounds off, rounds)."""
    off = 0
    for _ in range(steps):
        tickets = [guard.decide() for _ in range(width)]
        for ticket in tickets:
            speculating = ticket.mode == SPECULATE
            tokens, ms = SPEC_ROUND if speculating else OFF_ROUND
            guard.observe(ticket, tokens, ms, steady=True, drafted=speculating)
            off += not speculating
    return off, steps * width


def main() -> None:
    for low, high in ((2, 4), (4, 6), (4, 8)):
        for every in (40, 100, 400):
            guard = PairGuard(GuardSettings())
            off = rounds = 0
            for move in range(TOTAL_STEPS // every):
                o, r = play(guard, every, low if move % 2 == 0 else high)
                off, rounds = off + o, rounds + r
            print(f"{low} <-> {high} sessions, moving every {every} steps: {off / rounds:.1%} of rounds target-only "
                  f"({guard.load_restarts} load restarts, {guard.decisions} decisions)")
    off, rounds = play(PairGuard(GuardSettings()), TOTAL_STEPS, 4)
    print(f"a steady 4 sessions: {off / rounds:.1%} of rounds target-only")


if __name__ == "__main__":
    main()
