"""`specdec tune TRACES.jsonl`: replay traces through every policy and parameter grid, print a table
of simulated tokens/s and rounds, and write the best configuration as a ready TOML config file."""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from specdec import simulator
from specdec.kpolicy import PolicyParams, make_policy


@dataclass(frozen=True)
class Candidate:
    policy: str
    params: PolicyParams
    min_draft_prob: float

    def label(self) -> str:
        detail = {"fixed": f"k={self.params.fixed_k}",
                  "heuristic": f"initial_k={self.params.heuristic_initial_k}",
                  "cost": f"probe_every={self.params.probe_every}",
                  "bandit": f"exploration={self.params.bandit_exploration},prior_weight={self.params.bandit_prior_weight:g}"}
        extra = f" p_min={self.min_draft_prob:g}" if self.min_draft_prob else ""
        return f"{self.policy}({detail[self.policy]}){extra}"


def grid(max_k: int, p_mins: list[float]) -> list[Candidate]:
    out = [Candidate("fixed", PolicyParams(fixed_k=k), 0.0) for k in range(0, max_k + 1)]
    variants = ([("heuristic", PolicyParams(heuristic_initial_k=k)) for k in (2, 4, 6)]
                + [("cost", PolicyParams(probe_every=n)) for n in (8, 16, 32)]
                + [("bandit", PolicyParams(bandit_exploration=e, bandit_prior_weight=w))
                   for e, w in itertools.product((0.1, 0.3, 1.0), (1.0, 4.0))])
    for (name, params), p_min in itertools.product(variants, p_mins):
        out.append(Candidate(name, params, p_min))
    for k, p_min in itertools.product(range(1, max_k + 1), [p for p in p_mins if p > 0]):
        out.append(Candidate("fixed", PolicyParams(fixed_k=k), p_min))
    return out


def run(data: simulator.TraceData, candidates: list[Candidate], min_k: int, max_k: int, replicas: int,
        seed: int) -> list[tuple[Candidate, simulator.SimResult]]:
    rng = random.Random(seed)
    worlds = [simulator.impute(data, rng) for _ in range(replicas)]
    results = []
    for cand in candidates:
        lo, hi = (cand.params.fixed_k, cand.params.fixed_k) if cand.policy == "fixed" else (min_k, max_k)
        total = simulator.SimResult()
        for world in worlds:
            total.add(simulator.simulate(world, data.timing, lambda: make_policy(cand.policy, cand.params),
                                         lo, hi, cand.min_draft_prob))
        results.append((cand, total))
    return results


def config_toml(cand: Candidate, min_k: int, max_k: int) -> str:
    values = {"policy": cand.policy, "min_k": min_k, "max_k": max_k, "min_draft_prob": cand.min_draft_prob}
    values.update({f.name: getattr(cand.params, f.name) for f in fields(PolicyParams)})
    lines = ["# written by `specdec tune`; pass to the orchestrator with --config", "[speculation]"]
    for key, value in values.items():
        lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}")
    return "\n".join(lines) + "\n"


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
    results = run(data, grid(args.max_k, args.p_min), args.min_k, args.max_k, args.replicas, args.seed)
    baseline = next(r for c, r in results if c.policy == "fixed" and c.params.fixed_k == 0 and not c.min_draft_prob)
    results.sort(key=lambda cr: cr[1].tokens_per_s, reverse=True)
    print(f"| {'policy':52s} | tok/s (sim) | vs k=0 | rounds | mean k | acceptance |")
    print(f"|{'-' * 54}|-------------|--------|--------|--------|------------|")
    best_per_policy: dict[str, tuple[Candidate, simulator.SimResult]] = {}
    for cand, res in results:
        best_per_policy.setdefault(cand.policy, (cand, res))
    shown = results[:args.top] + [cr for cr in best_per_policy.values() if cr not in results[:args.top]]
    for cand, res in shown:
        print(f"| {cand.label():52s} | {res.tokens_per_s:11.2f} | {res.tokens_per_s / baseline.tokens_per_s:5.2f}x "
              f"| {res.rounds:6d} | {res.mean_k:6.2f} | {res.acceptance:10.1%} |")
    best = results[0][0]
    Path(args.out).write_text(config_toml(best, args.min_k, args.max_k))
    print(f"\nbest: {best.label()} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
