"""`specdec tune TRACES.jsonl`: replay traces through every policy and parameter grid, print a table
of simulated tokens/s and rounds, and write the best configuration as a ready TOML config file."""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from orchestrator.config import SpeculationConfig
from specdec.tools import simulator


@dataclass(frozen=True)
class Candidate:
    config: SpeculationConfig

    def label(self) -> str:
        c = self.config
        detail = {"fixed": f"k={c.fixed_k}",
                  "heuristic": f"initial_k={c.heuristic_initial_k}",
                  "cost": f"probe_every={c.probe_every}",
                  "bandit": f"exploration={c.bandit_exploration},prior_weight={c.bandit_prior_weight:g}"}
        extra = f" p_min={c.min_draft_prob:g}" if c.min_draft_prob else ""
        return f"{c.policy}({detail[c.policy]}){extra}"


def grid(min_k: int, max_k: int, p_mins: list[float]) -> list[Candidate]:
    base = SpeculationConfig(min_k=min_k, max_k=max_k)
    # Fixed k only inside [min_k, max_k]: the orchestrator clamps a fixed k into that range, so a
    # candidate outside it would be simulated at one k and run at another.
    out = [Candidate(replace(base, policy="fixed", fixed_k=k)) for k in range(min_k, max_k + 1)]
    variants = ([replace(base, policy="heuristic", heuristic_initial_k=k) for k in (2, 4, 6)]
                + [replace(base, policy="cost", probe_every=n) for n in (8, 16, 32)]
                + [replace(base, policy="bandit", bandit_exploration=e, bandit_prior_weight=w)
                   for e, w in itertools.product((0.1, 0.3, 1.0), (1.0, 4.0))])
    for config, p_min in itertools.product(variants, p_mins):
        out.append(Candidate(replace(config, min_draft_prob=p_min)))
    for k, p_min in itertools.product(range(max(1, min_k), max_k + 1), [p for p in p_mins if p > 0]):
        out.append(Candidate(replace(base, policy="fixed", fixed_k=k, min_draft_prob=p_min)))
    return out


def target_only_candidate(max_k: int) -> Candidate:
    return Candidate(SpeculationConfig(policy="fixed", fixed_k=0, min_k=0, max_k=max_k))


def run(data: simulator.TraceData, candidates: list[Candidate], replicas: int,
        seed: int) -> list[tuple[Candidate, simulator.SimResult]]:
    rng = random.Random(seed)
    worlds = [simulator.impute(data, rng) for _ in range(replicas)]
    results = []
    for cand in candidates:
        c = cand.config.validate()
        lo, hi = (c.fixed_k, c.fixed_k) if c.policy == "fixed" else (c.min_k, c.max_k)
        total = simulator.SimResult()
        for world in worlds:
            total.add(simulator.simulate(world, data.timing, c.make_policy, lo, hi, c.min_draft_prob))
        results.append((cand, total))
    return results


def config_toml(cand: Candidate) -> str:
    return "# written by `specdec tune`; pass to the orchestrator with --config\n" + cand.config.to_toml()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec tune", description=__doc__)
    parser.add_argument("traces", nargs="+", help="JSONL files written by the orchestrator's --trace-file")
    parser.add_argument("--min-k", type=int, default=0)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--p-min", type=float, nargs="*", default=[0.0, 0.2, 0.4, 0.6],
                        help="min_draft_prob values to try")
    parser.add_argument("--replicas", type=int, default=8, help="imputation replicas (paired across policies)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=25, help="rows to print")
    parser.add_argument("--out", default="tuned-speculation.toml", help="best configuration (TOML)")
    args = parser.parse_args(argv)

    from orchestrator.traces import load_traces
    traces = [t for path in args.traces for t in load_traces(path)]
    data = simulator.build(traces)
    timing = data.timing
    print(f"{len(traces)} rounds, {len(data.episodes)} requests, {data.positions} positions "
          f"({data.unknown_fraction:.1%} imputed); P(accept|accept)={data.p_stay_accept:.2f}, "
          f"P(accept|reject)={data.p_recover:.2f}")
    verify = ", ".join(f"k={k}: {v:.1f}" for k, v in sorted(timing.verify_ms_by_k.items()))
    print(f"timing: draft {timing.draft_ms_per_token:.1f} ms/token, verify ms {{{verify}}}, "
          f"overhead {timing.rpc_overhead_ms:.2f} ms/call\n")
    # Target-only is the yardstick even when --min-k keeps it out of the candidates: run last, on the
    # same imputed worlds, and taken out of the ranking.
    results = run(data, [*grid(args.min_k, args.max_k, args.p_min), target_only_candidate(args.max_k)],
                  args.replicas, args.seed)
    _, baseline = results.pop()
    results.sort(key=lambda cr: cr[1].tokens_per_s, reverse=True)
    print(f"| {'policy':52s} | tok/s (sim) | vs k=0 | rounds | mean k | acceptance |")
    print(f"|{'-' * 54}|-------------|--------|--------|--------|------------|")
    best_per_policy: dict[str, tuple[Candidate, simulator.SimResult]] = {}
    for cand, res in results:
        best_per_policy.setdefault(cand.config.policy, (cand, res))
    shown = results[:args.top] + [cr for cr in best_per_policy.values() if cr not in results[:args.top]]
    for cand, res in shown:
        print(f"| {cand.label():52s} | {res.tokens_per_s:11.2f} | {res.tokens_per_s / baseline.tokens_per_s:5.2f}x "
              f"| {res.rounds:6d} | {res.mean_k:6.2f} | {res.acceptance:10.1%} |")
    best = results[0][0]
    Path(args.out).write_text(config_toml(best))
    print(f"\nbest: {best.label()} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
