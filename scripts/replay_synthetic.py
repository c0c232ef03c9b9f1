"""Replay synthetic acceptance through the cost policy and every fixed k (docs/adaptive-k.md).

Worlds: independent acceptance at a = 0.3 / 0.6 / 0.8, bursty (P(accept | accept) = 0.85,
P(accept | reject) = 0.4), a mix of texts at a = 0.45..0.9, and the recorded trace
docs/traces/qwen-coder-k8-greedy.jsonl (imputed as `specdec tune` does). Cost shapes: the trace's
own (a step at 3 drafts, AMX), flat (oneDNN-packed weights on a CPU) and linear in k. The policy's
timings are seeded with the true costs, as the orchestrator seeds them from the workers'
calibration, so what differs between policies is only how they read acceptance.

    python scripts/replay_synthetic.py

Prints, per world and cost shape, the cost policy's tokens/s as a fraction of the best fixed k's.
Then the guard rail: a session that drafts well (800 tokens at a = 0.9) meets text the draft cannot
follow (300 tokens at a = 0.2) with a slow draft (150 ms a token against 315 for the target): what the
hard stretch costs against target-only, and after how many of its rounds the policy first runs k = 0.
Deterministic (seeded). Pure Python: it imports the policy code of the checkout it runs from.
"""
from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.kpolicy import CostModelPolicy, FixedPolicy, KPolicy, SessionStats  # noqa: E402
from orchestrator.traces import load_traces  # noqa: E402
from specdec.tools import simulator  # noqa: E402

Replica = list[tuple[list[int], list[float]]]


def markov(p_stay: float, p_recover: float, episodes: int = 30, length: int = 150, seed: int = 1) -> Replica:
    rng, out = random.Random(seed), []
    for _ in range(episodes):
        match, prev = [], 1
        for _ in range(length):
            prev = int(rng.random() < (p_stay if prev else p_recover))
            match.append(prev)
        out.append((match, [1.0] * length))
    return out


def mixed(seed: int = 2) -> Replica:
    out: Replica = []
    for i in range(30):
        a = (0.9, 0.75, 0.6, 0.45)[i % 4]
        out += markov(a, a, 1, 150, seed + i)
    return out


def seeded_prior(timing: simulator.TimingFit, max_k: int) -> SessionStats:
    """A pair's prior with its timings seeded from the true costs, as the orchestrator seeds them."""
    prior = SessionStats().as_pair_prior()
    prior.timing.seed(timing.draft_ms_per_token, {k: timing.verify_ms(k) for k in range(max_k + 1)})
    return prior


def play_round(stats: SessionStats, policy: KPolicy, match: list[int], j: int, timing: simulator.TimingFit,
               lo: int, hi: int) -> tuple[int, int, float, int]:
    """One round at position j, observed by the session: (k, accepted, round ms, tokens produced)."""
    k = max(0, min(policy.next_k(stats, lo, hi), len(match) - j - 1))
    accepted = 0
    while accepted < k and match[j + accepted] == 1:
        accepted += 1
    round_ms = k * timing.draft_ms_per_token + timing.verify_ms(k) + timing.rpc_overhead_ms * (2 if k else 1)
    if k:
        stats.timing.observe_draft(k, k * timing.draft_ms_per_token)
    stats.timing.observe_verify(k, timing.verify_ms(k))
    stats.timing.observe_rtt(timing.rpc_overhead_ms)
    stats.observe_round(k, accepted, round_ms)
    return k, accepted, round_ms, min(accepted + 1, len(match) - j)


def replay(world: Replica, timing: simulator.TimingFit, make: Callable[[], KPolicy], lo: int, hi: int) -> float:
    """Tokens/s of one policy over the world; the prior's timings seeded with the true costs.

    The loop of simulator.simulate (without the early stop), kept here on purpose: the script is
    also run with an older checkout's orchestrator/ and specdec/ on the path, to compare policy
    code, and the simulators of older checkouts did not seed the timings."""
    result = simulator.SimResult()
    prior = seeded_prior(timing, hi)
    for match, _ in world:
        stats, policy, j = prior.new_session(), make(), 0
        while j < len(match):
            k, accepted, round_ms, produced = play_round(stats, policy, match, j, timing, lo, hi)
            prior.observe_round(k, accepted, round_ms)
            j += produced
            result.add(simulator.SimResult(produced, round_ms, 1, k, accepted))
        stats.carry_turn_into(prior, policy_chose_k=True)
    return result.tokens_per_s


def hard_stretch(seed: int, draft_ms: float = 150.0) -> tuple[float, int]:
    """(the hard stretch's time against target-only's for its tokens, rounds into it until k = 0)."""
    rng = random.Random(seed)
    match = [int(rng.random() < 0.9) for _ in range(800)] + [int(rng.random() < 0.2) for _ in range(300)]
    timing = simulator.TimingFit(draft_ms, {k: 315.0 + 2.0 * k for k in range(9)}, 4.0)
    stats, policy = seeded_prior(timing, 8).new_session(), CostModelPolicy(probe_every=8)
    j, hard_ms, hard_tokens, hard_rounds, first_off = 0, 0.0, 0, 0, 0
    while j < len(match):
        k, _, round_ms, produced = play_round(stats, policy, match, j, timing, 0, 8)
        if j >= 800:
            hard_rounds += 1
            hard_ms, hard_tokens = hard_ms + round_ms, hard_tokens + produced
            first_off = first_off or (hard_rounds if k == 0 else 0)
        j += produced
    return hard_ms / (hard_tokens * (timing.verify_ms(0) + timing.rpc_overhead_ms)), first_off


def main() -> None:
    data = simulator.build(load_traces(ROOT / "docs" / "traces" / "qwen-coder-k8-greedy.jsonl"))
    rng = random.Random(0)
    worlds = {"trace": [ep for _ in range(8) for ep in simulator.impute(data, rng)],
              "iid a=0.3": markov(0.3, 0.3), "iid a=0.6": markov(0.6, 0.6), "iid a=0.8": markov(0.8, 0.8),
              "bursty .85/.4": markov(0.85, 0.4), "mixed .45-.9": mixed()}
    costs = {"step (trace)": data.timing,
             "flat": simulator.TimingFit(80.0, {k: 315.0 + 2.0 * k for k in range(9)}, 4.0),
             "linear": simulator.TimingFit(60.0, {k: 300.0 + 40.0 * k for k in range(9)}, 4.0)}
    print("| world | costs | best fixed k | its tok/s | k = 0 / best | cost policy / best |")
    print("|---|---|---|---|---|---|")
    for wname, world in worlds.items():
        for cname, timing in costs.items():
            fixed = {k: replay(world, timing, lambda k=k: FixedPolicy(k), k, k) for k in range(9)}
            best = max(fixed, key=fixed.get)
            cost = replay(world, timing, lambda: CostModelPolicy(probe_every=8), 0, 8)
            print(f"| {wname} | {cname} | {best} | {fixed[best]:.2f} | {fixed[0] / fixed[best]:.3f} "
                  f"| {cost / fixed[best]:.3f} |")
    runs = [hard_stretch(seed) for seed in range(20)]
    ratios, first_off = [r for r, _ in runs], [n for _, n in runs]
    print(f"\nhard stretch after an easy one, slow draft, 20 seeds: {sum(ratios) / 20:.3f}x target-only's time "
          f"(worst {max(ratios):.3f}x); first k = 0 after {sum(first_off) / 20:.1f} rounds (most {max(first_off)})")


if __name__ == "__main__":
    main()
