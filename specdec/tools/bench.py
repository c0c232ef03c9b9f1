"""`specdec bench`: the service side by side with target-only and HF assisted generation, in ONE run.

Systems run round-robin per prompt (the starting system rotates) so machine drift hits all of them.
Greedy and sampled (temperature 0.7) modes. Writes report.md, report.json and PNG plots.
Performance numbers come from here, never from a timed test; `--smoke` (tiny random models) is what
CI runs to check that the report is produced and consistent.

Over 300 lines: one experiment (the systems, the interleaved runner and the report over their shared
`Run` record) reads best in one file; it is a tool, not on any request path.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from orchestrator.kpolicy import speedup_bound

ROOT = Path(__file__).resolve().parents[2]
FIXED_KS = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class System:
    name: str
    kind: str                      # "service" | "hf-plain" | "hf-assisted"
    speculation: dict = field(default_factory=dict)
    hf: dict = field(default_factory=dict)
    fixed_k: int | None = None     # for the Leviathan bound
    modes: tuple[str, ...] = ("greedy", "sampled")


def systems(all_in_both_modes: bool = False) -> list[System]:
    """The default grid runs a subset in sampled mode (to keep a real run near 20 minutes on 2 cores);
    `--all-systems` runs every system in both modes."""
    out = [
        System("target-only (service, k=0)", "service", {"fixed_k": 0, "min_draft_prob": 0.0}, fixed_k=0),
        System("target-only (HF in-process)", "hf-plain"),
        System("HF assisted (default)", "hf-assisted"),
        System("HF assisted (heuristic)", "hf-assisted", hf={"num_assistant_tokens_schedule": "heuristic",
                                                             "num_assistant_tokens": 5,
                                                             "assistant_confidence_threshold": 0.0},
               modes=("greedy",)),
    ]
    for k in FIXED_KS:
        out.append(System(f"service fixed k={k}", "service", {"fixed_k": k, "min_draft_prob": 0.0}, fixed_k=k,
                          modes=("greedy", "sampled") if k in (2, 4) else ("greedy",)))
    out += [
        System("service cost (server config)", "service", {"policy": "cost"}),
        System("service cost (early stop p_min=0.6)", "service", {"policy": "cost", "min_draft_prob": 0.6},
               modes=("greedy",)),
        System("service heuristic", "service", {"policy": "heuristic", "min_draft_prob": 0.0}, modes=("greedy",)),
        System("service bandit (server config)", "service", {"policy": "bandit"}),
    ]
    if all_in_both_modes:
        out = [System(x.name, x.kind, x.speculation, x.hf, x.fixed_k, ("greedy", "sampled")) for x in out]
    return out


BASELINE = "target-only (service, k=0)"  # every summary's per-prompt reference; always run


def matching_names(names: list[str], pattern: str, always: tuple[str, ...]) -> list[str]:
    """A `--systems` selection (bench, netbench): the names, in order, that the regular expression
    `pattern` finds (searched), and those in `always` (the references every ratio is taken against);
    ValueError where it finds no other name, or is no regular expression."""
    try:
        wanted = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"--systems: not a regex: {exc}") from None
    chosen = {name for name in names if name not in always and wanted.search(name)}
    if not chosen:
        raise ValueError(f"--systems {pattern!r} matches none of: "
                         + ", ".join(name for name in names if name not in always))
    return [name for name in names if name in always or name in chosen]


def select_systems(plan: list[System], pattern: str) -> list[System]:
    """The systems whose name matches `pattern` (a regular expression, searched), in both modes (a
    selection is explicit), plus the service's k = 0, which every summary is taken against."""
    names = matching_names([x.name for x in plan], pattern, (BASELINE,))
    return [System(x.name, x.kind, x.speculation, x.hf, x.fixed_k, ("greedy", "sampled"))
            for x in plan if x.name in names]


@dataclass
class Run:
    system: str
    mode: str
    prompt: str
    tokens: int
    wall_s: float
    token_ids: list[int]
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    overhead_ms: float = 0.0
    bytes_to_draft: int = 0
    bytes_from_draft: int = 0
    bytes_to_target: int = 0
    bytes_from_target: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    accepted_per_round: list[int] = field(default_factory=list)  # in k_per_round's order
    repeat: int = 0  # which pass over the prompts (`--repeats`): its own sampling seeds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


# ----------------------------------------------------------------------------- runners

class ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: Any) -> None:
        self.calls += 1


class HFRunner:
    """In-process anchor: transformers' own generate (with assistant_model for assisted decoding),
    on the same device and in the same dtypes as the service's workers, so a ratio compares methods,
    not devices."""

    def __init__(self, target_ref: str, draft_ref: str, target_dtype: torch.dtype, draft_dtype: torch.dtype,
                 device: torch.device = torch.device("cpu")) -> None:
        from specdec.models import load_model
        self.device = device
        self.target = load_model(target_ref, target_dtype, str(device))
        self.draft = load_model(draft_ref, draft_dtype, str(device))
        self.target_calls = ForwardCounter(self.target.model)
        self.draft_calls = ForwardCounter(self.draft.model)
        self.base_assistant_config = self.draft.model.generation_config

    def run(self, system: System, mode: str, prompt_name: str, prompt_ids: list[int], max_new: int,
            seed: int) -> Run:
        import copy

        from specdec.models import synchronize
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": mode == "sampled"}
        if mode == "sampled":
            kwargs["temperature"] = 0.7
            torch.manual_seed(seed)
        if system.kind == "hf-assisted":
            config = copy.deepcopy(self.base_assistant_config)
            for key, value in system.hf.items():
                setattr(config, key, value)
            self.draft.model.generation_config = config
            kwargs["assistant_model"] = self.draft.model
        t0_target, t0_draft = self.target_calls.calls, self.draft_calls.calls
        ids = torch.tensor([prompt_ids], device=self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        synchronize(self.device)
        wall = time.perf_counter() - start
        new = out[0, len(prompt_ids):].tolist()
        target_calls = self.target_calls.calls - t0_target
        draft_calls = self.draft_calls.calls - t0_draft
        run = Run(system.name, mode, prompt_name, len(new), wall, new, target_forwards=target_calls,
                  draft_forwards=draft_calls)
        if system.kind == "hf-assisted":
            # One target forward per round; every extra token of a round is an accepted draft.
            run.rounds = target_calls
            run.accepted = max(0, len(new) - target_calls)
            run.drafted = draft_calls
        else:
            run.rounds = len(new)
        return run


async def service_run(stub: Any, system: System, mode: str, prompt_name: str, prompt_ids: list[int],
                      max_new: int, seed: int) -> Run:
    from specdec.tools.client import build_request
    spec = system.speculation
    req = build_request(prompt_ids=prompt_ids, max_new_tokens=max_new, temperature=0.7 if mode == "sampled" else 0.0,
                        seed=seed, policy=spec.get("policy"), fixed_k=spec.get("fixed_k"))
    if "min_draft_prob" in spec:
        req.speculation.min_draft_prob = spec["min_draft_prob"]
    start = time.perf_counter()
    reply = await stub.Generate(req, timeout=1800)
    wall = time.perf_counter() - start
    s = reply.stats
    return Run(system.name, mode, prompt_name, s.new_tokens, wall, list(reply.token_ids), s.rounds, s.draft_tokens,
               s.accepted_tokens, list(s.accepted_per_position), list(s.k_per_round), s.draft_ms, s.verify_ms,
               s.overhead_ms, s.bytes_to_draft, s.bytes_from_draft, s.bytes_to_target, s.bytes_from_target,
               target_forwards=s.rounds, draft_forwards=s.draft_tokens,
               accepted_per_round=list(s.accepted_per_round))


# ----------------------------------------------------------------------------- analysis

def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(runs: list[Run], mode: str, plan: list[System] | None = None,
              categories: dict[str, str] | None = None) -> dict[str, Any]:
    by_system: dict[str, list[Run]] = {}
    for r in runs:
        if r.mode == mode:
            by_system.setdefault(r.system, []).append(r)

    def keyed(name: str) -> dict[tuple[str, int], Run]:  # one run per (prompt, repeat); none without tokens
        return {(r.prompt, r.repeat): r for r in by_system.get(name, []) if r.tokens_per_s > 0}
    baseline = keyed(BASELINE)
    anchor = keyed("HF assisted (default)")
    hf_plain_name = "target-only (HF in-process)"
    # Identity compares every run, one without tokens too (an immediate EOS must match as well).
    hf_plain = {(r.prompt, r.repeat): r for r in by_system.get(hf_plain_name, [])}
    # c and a measured in this run: target ms/token from k=0 compute, draft ms/drafted token,
    # per-token acceptance pooled over the fixed-k service runs.
    t_target = _median([r.verify_ms / r.tokens for r in baseline.values() if r.tokens])
    service = [r for rs in by_system.values() for r in rs if r.drafted and r.draft_ms]
    t_draft = sum(r.draft_ms for r in service) / max(1, sum(r.drafted for r in service))
    c = t_draft / t_target if t_target else 0.0
    fixed = [r for name, rs in by_system.items() if name.startswith("service fixed") for r in rs]
    rejections = sum(sum(1 for k_r, n in _round_outcomes(r) if n < k_r) for r in fixed)
    accepted = sum(r.accepted for r in fixed)
    a = accepted / (accepted + rejections) if accepted + rejections else 0.0
    rows = []
    systems_by_name = {s.name: s for s in (plan or systems())}
    for name, rs in by_system.items():
        tps = [r.tokens_per_s for r in rs]
        speedups = [r.tokens_per_s / baseline[r.prompt, r.repeat].tokens_per_s for r in rs
                    if (r.prompt, r.repeat) in baseline and r.tokens_per_s > 0]  # (no tokens: no rate)
        vs_anchor = [r.tokens_per_s / anchor[r.prompt, r.repeat].tokens_per_s for r in rs
                     if (r.prompt, r.repeat) in anchor]
        tokens = sum(r.tokens for r in rs)
        rounds = sum(r.rounds for r in rs)
        drafted = sum(r.drafted for r in rs)
        acc = sum(r.accepted for r in rs)
        spec = systems_by_name.get(name)
        k = spec.fixed_k if spec else None
        speculative = spec is not None and spec.kind != "hf-plain" and k != 0
        if not speculative or spec.kind == "hf-assisted":
            # (HF assisted: its speedup is over HF's own target-only, slower than the service's,
            # and its draft's cost is not the c measured here: no bound of this run applies.)
            bound = None
        elif k is not None:
            bound = speedup_bound(a, k, c)
        else:  # adaptive / HF: the best any fixed k could do in theory
            bound = max(speedup_bound(a, kk, c) for kk in range(0, 9))
        identical = None
        if mode == "greedy" and hf_plain and name != hf_plain_name:
            # None unless every run had its reference (a run compared with nothing is not "yes").
            pairs = [(r, hf_plain.get((r.prompt, r.repeat))) for r in rs]
            if all(ref is not None for _, ref in pairs):
                identical = all(r.token_ids == ref.token_ids for r, ref in pairs)
        geomean_speedup = math.exp(statistics.fmean(map(math.log, speedups))) if speedups else None
        rows.append({
            "system": name, "prompts": len({r.prompt for r in rs}), "runs": len(rs),
            "tok_s_median": _median(tps), "tok_s_min": min(tps), "tok_s_max": max(tps),
            "speedup_vs_target_only": _median(speedups) if speedups else None,
            "ratio_vs_hf_assisted": _median(vs_anchor) if vs_anchor else None,
            "acceptance": acc / drafted if drafted else None,
            "accepted_per_round": acc / rounds if rounds else 0.0,
            "target_forwards_per_token": sum(r.target_forwards for r in rs) / tokens if tokens else 0.0,
            "bytes_per_round_to_draft": sum(r.bytes_to_draft for r in rs) / rounds if rounds else 0.0,
            "bytes_per_round_from_draft": sum(r.bytes_from_draft for r in rs) / rounds if rounds else 0.0,
            "bytes_per_round_to_target": sum(r.bytes_to_target for r in rs) / rounds if rounds else 0.0,
            "bytes_per_round_from_target": sum(r.bytes_from_target for r in rs) / rounds if rounds else 0.0,
            "bytes_per_token": sum(r.bytes_to_draft + r.bytes_from_draft + r.bytes_to_target + r.bytes_from_target
                                   for r in rs) / tokens if tokens else 0.0,
            "draft_ms_share": sum(r.draft_ms for r in rs) / max(1e-9, sum(r.wall_s for r in rs) * 1000),
            "verify_ms_share": sum(r.verify_ms for r in rs) / max(1e-9, sum(r.wall_s for r in rs) * 1000),
            "overhead_ms_per_round": sum(r.overhead_ms for r in rs) / rounds if rounds and rs[0].verify_ms else None,
            "leviathan_bound": bound, "mean_k": drafted / rounds if rounds and rs[0].verify_ms else None,
            # Over the bound: the geometric mean over prompts (the figure the targets use),
            # not the median, which sat well above it where prompts' acceptance differs.
            "speedup_geomean": geomean_speedup,
            "bound_fraction": (geomean_speedup / bound) if bound and geomean_speedup else None,
            "identical_to_target_only": identical,
        })
    return {"mode": mode, "a": a, "c": c, "t_target_ms": t_target, "t_draft_ms": t_draft, "rows": rows,
            "repeats": repeat_spread(runs, mode, categories or {})}


def repeat_spread(runs: list[Run], mode: str, categories: dict[str, str]) -> dict[str, Any] | None:
    """Per system and per repeat (`--repeats`), the issue's figure: tok/s over target-only's on the
    same prompt and repeat, as a geometric mean per category (`categories`: prompt -> category; a
    prompt of its own where absent), then over the categories, with how many prompts it covers (a
    run with no tokens, or without its reference, is left out). With two or more repeats, the
    adaptive policy against the best fixed k, both ways: the k best on the repeats' mean, and each
    repeat's own best (a selection from the same runs, which favours the fixed k); beside the spread
    of each fixed k's figure between repeats (the noise a single run's comparison sits in).
    Reference: HF's in-process target-only where the run has it, else the service at k = 0."""
    mine = [r for r in runs if r.mode == mode and r.tokens and r.wall_s]
    names = {r.system for r in mine}
    reference = "target-only (HF in-process)" if "target-only (HF in-process)" in names else BASELINE
    ref = {(r.prompt, r.repeat): r.tokens_per_s for r in mine if r.system == reference}
    repeats = sorted({r.repeat for r in runs if r.mode == mode})
    if not ref or not repeats:
        return None
    per_system: dict[str, list[float | None]] = {}
    prompts: dict[str, list[int]] = {}
    for name in sorted(names):
        figures: list[float | None] = []
        counts: list[int] = []
        for repeat in repeats:
            by_category: dict[str, list[float]] = {}
            for r in mine:
                if r.system == name and r.repeat == repeat and (r.prompt, repeat) in ref:
                    by_category.setdefault(categories.get(r.prompt, r.prompt), []).append(
                        r.tokens_per_s / ref[r.prompt, repeat])
            figures.append(statistics.geometric_mean([statistics.geometric_mean(v) for v in by_category.values()])
                           if by_category else None)
            counts.append(sum(len(v) for v in by_category.values()))
        per_system[name], prompts[name] = figures, counts
    out: dict[str, Any] = {"reference": reference, "repeats": len(repeats), "geomean_by_repeat": per_system,
                           "prompts_by_repeat": prompts,
                           "prompts_per_repeat": len({prompt for prompt, _ in ref})}
    fixed = {n: f for n, f in per_system.items() if n.startswith("service fixed") and None not in f}
    adaptive = per_system.get("service cost (server config)")
    if len(repeats) >= 2 and fixed and adaptive and None not in adaptive:
        best = max(fixed, key=lambda n: statistics.geometric_mean(fixed[n]))  # type: ignore[arg-type]
        ratios = [a / b for a, b in zip(adaptive, fixed[best])]  # type: ignore[operator]
        own_best = [max(f[i] for f in fixed.values()) for i in range(len(repeats))]  # type: ignore[type-var]
        out["adaptive_vs_best_fixed"] = {
            "candidates": sorted(fixed), "best_fixed": best, "ratio_by_repeat": ratios,
            "ratio_mean": statistics.geometric_mean(ratios),
            "ratio_by_repeat_own_best": [a / b for a, b in zip(adaptive, own_best)],  # type: ignore[operator]
            # The noise: how far one system's figure moves between repeats (max / min - 1), at most over
            # the fixed-k systems, whose k is the same in every repeat.
            "spread_between_repeats": max(max(f) / min(f) - 1.0 for f in fixed.values()),  # type: ignore[type-var]
        }
    return out


def _round_outcomes(run: Run) -> list[tuple[int, int]]:
    """(k, accepted) per round: each round's k with its own accepted count (sorting both lists, as
    before, paired a capped k = 2 round that accepted 2 with a k = 8 one: a = 0.50 for 0.667)."""
    if len(run.accepted_per_round) != len(run.k_per_round):
        raise ValueError(f"{run.system}: {len(run.k_per_round)} rounds but {len(run.accepted_per_round)} "
                         "accepted counts (an orchestrator without GenerationStats.accepted_per_round?)")
    return list(zip(run.k_per_round, run.accepted_per_round))


def markdown(summary: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".2f", unit: str = "") -> str:
        if x is None:
            return "–"
        if isinstance(x, bool):
            return "yes" if x else "NO"
        return format(x, spec) + unit
    lines = [f"### {summary['mode']}",
             "",
             f"Measured in this run: a = {summary['a']:.3f} (per-token acceptance, fixed-k runs), "
             f"c = {summary['c']:.3f} (draft {summary['t_draft_ms']:.1f} ms / target {summary['t_target_ms']:.1f} ms per token). "
             "Of bound: the geometric mean over prompts of tok/s over target-only's (service, k = 0) on the same prompt, "
             "over the Leviathan S from a and c (none for HF assisted, whose reference and draft cost differ). "
             "= target-only: every run the same tokens as HF target-only's on its prompt (– where one had no reference).",
             "",
             "| system | tok/s median (min–max) | vs target-only | vs HF assisted | acceptance | accepted/round | "
             "target fwd/token | bytes/round →draft/←draft/→target/←target | bytes/token | time draft/verify | "
             "overhead ms/round | Leviathan S | of bound | = target-only |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        lines.append(
            f"| {r['system']} | {r['tok_s_median']:.2f} ({r['tok_s_min']:.2f}–{r['tok_s_max']:.2f}) "
            f"| {f(r['speedup_vs_target_only'], '.2f', 'x')} | {f(r['ratio_vs_hf_assisted'], '.2f', 'x')} "
            f"| {f(r['acceptance'], '.1%')} "
            f"| {r['accepted_per_round']:.2f} | {r['target_forwards_per_token']:.2f} "
            f"| {r['bytes_per_round_to_draft']:.0f}/{r['bytes_per_round_from_draft']:.0f}/"
            f"{r['bytes_per_round_to_target']:.0f}/{r['bytes_per_round_from_target']:.0f} | {r['bytes_per_token']:.0f} "
            f"| {r['draft_ms_share']:.0%}/{r['verify_ms_share']:.0%} | {f(r['overhead_ms_per_round'])} "
            f"| {f(r['leviathan_bound'])} | {f(r['bound_fraction'], '.0%')} | {f(r['identical_to_target_only'])} |")
    spread = summary.get("repeats")
    if spread and spread["repeats"] >= 2:
        n = spread["repeats"]
        lines += ["", f"Per repeat (each a pass over the prompts with its own seeds): tok/s over "
                  f"{spread['reference']}'s on the same prompt and repeat, geometric mean per category, then over "
                  "the categories.", "",
                  "| system | " + " | ".join(f"repeat {i + 1}" for i in range(n)) + " | max / min |",
                  "|---|" + "---|" * (n + 1)]
        full = spread["prompts_per_repeat"]
        for name, figures in spread["geomean_by_repeat"].items():
            known = [x for x in figures if x is not None]
            counts = spread["prompts_by_repeat"][name]
            lines.append(f"| {name} | " + " | ".join(
                f(x, ".2f", "x") + ("" if count == full else f" ({count}/{full} prompts)")
                for x, count in zip(figures, counts))
                + f" | {f(max(known) / min(known) if known else None, '.3f')} |")
        versus = spread.get("adaptive_vs_best_fixed")
        if versus:
            lines += ["", f"Adaptive (service cost) against the best fixed k of {', '.join(versus['candidates'])}: "
                      f"on the repeats' mean ({versus['best_fixed']}) " + ", ".join(
                          f"{x:.3f}" for x in versus["ratio_by_repeat"])
                      + f" per repeat, {versus['ratio_mean']:.3f} over all; against each repeat's own best "
                      + ", ".join(f"{x:.3f}" for x in versus["ratio_by_repeat_own_best"])
                      + f" (picked after the fact from the same runs); a fixed k's figure moved by up to "
                      f"{versus['spread_between_repeats']:.1%} between repeats."]
    return "\n".join(lines) + "\n"


def plots(summaries: list[dict[str, Any]], runs: list[Run], out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for summary in summaries:
        rows = {r["system"]: r for r in summary["rows"]}
        ks = [k for k in FIXED_KS if f"service fixed k={k}" in rows]
        fig, ax = plt.subplots(figsize=(8, 5))
        if ks:
            ax.plot(ks, [rows[f"service fixed k={k}"]["tok_s_median"] for k in ks], "o-", label="service, fixed k")
        for name, style in (("target-only (service, k=0)", "k:"), ("target-only (HF in-process)", "k--"),
                            ("HF assisted (default)", "r--"), ("HF assisted (heuristic)", "m--")):
            if name in rows:
                ax.axhline(rows[name]["tok_s_median"], linestyle=style[1:], color=style[0], label=name)
        colors = iter(["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:cyan"])
        for name, row in rows.items():
            if name.startswith("service") and "fixed" not in name:
                ax.axhline(row["tok_s_median"], color=next(colors), label=name)
        ax.set_xlabel("k (draft tokens per round)")
        ax.set_ylabel("tokens/s (median over prompts)")
        ax.set_title(f"tokens/s vs k ({summary['mode']})")
        ax.legend(fontsize=7)
        path = out_dir / f"tokens_per_s_vs_k_{summary['mode']}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for k in FIXED_KS:
        rs = [r for r in runs if r.system == f"service fixed k={k}" and r.mode == "greedy"]
        if not rs:
            continue
        rounds = [sum(1 for r in rs for kk in r.k_per_round if kk > i) for i in range(k)]
        acc = [sum(r.accepted_per_position[i] if i < len(r.accepted_per_position) else 0 for r in rs) for i in range(k)]
        ax.plot(range(1, k + 1), [a / n if n else 0 for a, n in zip(acc, rounds)], "o-", label=f"fixed k={k}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_title("acceptance by draft position (greedy)")
    ax.legend(fontsize=7)
    path = out_dir / "acceptance_by_position.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


# ----------------------------------------------------------------------------- main

async def _run_all(address: str, hf: "HFRunner | None", prompts: list[dict], modes: list[str], max_new: int,
                   progress: Any, plan: list[System], repeats: int = 1) -> list[Run]:
    import grpc
    from specdec.v1 import orchestrator_pb2_grpc
    runs: list[Run] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        # Warm-up: page in every model's weights before anything is timed.
        warm = prompts[0]["ids"]
        # The target alone, then a fixed k > 0 (the draft too), whatever the selection.
        for system in (System("warm-up", "service", {"fixed_k": 0}), System("warm-up", "service", {"fixed_k": 2})):
            await service_run(stub, system, "greedy", "warmup", warm, 4, 0)
        if hf is not None:
            hf.run(System("warm-up", "hf-assisted"), "greedy", "warmup", warm, 4, 0)
        for mode in modes:
            active = [s for s in plan if mode in s.modes]
            # Each repeat is a whole pass over the prompts with its own seeds (repeat 0: the seeds a
            # single run has always used), so the passes' spread is the run-to-run noise.
            for repeat in range(repeats):
                for p_index, prompt in enumerate(prompts):
                    rotation = (p_index + repeat) % len(active)
                    for system in active[rotation:] + active[:rotation]:
                        seed = 1000 + p_index + 1000 * repeat
                        if system.kind == "service":
                            run = await service_run(stub, system, mode, prompt["id"], prompt["ids"], max_new, seed)
                        else:
                            assert hf is not None  # loaded whenever the plan has an HF system
                            run = await asyncio.to_thread(hf.run, system, mode, prompt["id"], prompt["ids"],
                                                          max_new, seed)
                        run.repeat = repeat
                        runs.append(run)
                        progress.set_postfix_str(f"{mode} {prompt['id']} {system.name}: {run.tokens_per_s:.2f} tok/s")
                        progress.update(1)
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec bench", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--categories", default="code,chat,factual,story,math",
                        help="one prompt per category (in file order) unless --all-prompts")
    parser.add_argument("--all-prompts", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--config", help="orchestrator [speculation] TOML (default for the embedded pair: "
                        "configs/embedded-pair-cpu.toml)")
    parser.add_argument("--out", default=str(ROOT / "bench-out"))
    parser.add_argument("--device", default="auto", help="where the workers AND the HF anchors run: auto "
                        "(cuda if available) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="weights' dtype for workers and anchors alike: "
                        "auto (the workers' rule: bf16 on CUDA; on CPU float32 target, bf16 draft where "
                        "the CPU has native bf16) | exact | float32 | bfloat16")
    parser.add_argument("--smoke", action="store_true", help="tiny random models, 3 prompts, 12 tokens (CI)")
    parser.add_argument("--all-systems", action="store_true", help="every system in both modes (default: a "
                        "subset in sampled mode)")
    parser.add_argument("--systems", help="only the systems whose name matches this regular expression, in "
                        "every mode of --modes (the service at k = 0, the summaries' reference, always runs)")
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts, each with its own "
                        "sampling seeds; the report gives each pass's figures and their spread (the noise)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not args.modes or not set(args.modes.split(",")) <= {"greedy", "sampled"}:
        parser.error(f"--modes takes greedy and/or sampled, comma-separated, got {args.modes!r}")
    plan = systems(args.all_systems)
    if args.systems:
        try:
            plan = select_systems(plan, args.systems)
        except ValueError as exc:
            parser.error(str(exc))

    from tqdm import tqdm

    from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
    from specdec.models import load_tokenizer, resolve_device, resolve_dtype
    if args.smoke:
        args.target, args.draft = "tiny:seed=0", "tiny:seed=0,noise=0.02"
        args.max_new_tokens = 12
    tokenizer = load_tokenizer(args.target)
    all_prompts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    if args.smoke:
        chosen = all_prompts[:3]
    elif args.all_prompts:
        chosen = all_prompts
    else:
        seen: set[str] = set()
        chosen = [p for p in all_prompts if p["category"] in args.categories.split(",")
                  and not (p["category"] in seen or seen.add(p["category"]))]
    for p in chosen:
        p["ids"] = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
    config = args.config
    if config is None and (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT):
        config = str(DEFAULT_PAIR_CONFIG)
    modes = args.modes.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    target_dtype = resolve_dtype(args.dtype, "target", device)
    draft_dtype = resolve_dtype(args.dtype, "draft", device)
    print(f"bench: on {device}, target {args.target} ({target_dtype}), draft {args.draft} ({draft_dtype}), "
          f"{len(chosen)} prompts, {args.max_new_tokens} new tokens, modes {modes}, config {config}")
    # The in-process anchors only where the plan runs one (`--systems` may leave them out).
    hf = (HFRunner(args.target, args.draft, target_dtype, draft_dtype, device)
          if any(s.kind != "service" and set(s.modes) & set(modes) for s in plan) else None)
    total = args.repeats * sum(len(chosen) for mode in modes for s in plan if mode in s.modes)
    orch_args = ["--log-level", "WARNING", "--max-k", "8"] + (["--config", config] if config else [])
    started = time.time()
    worker_args = ["--device", str(device), "--dtype", args.dtype]
    with local_services(args.target, args.draft, 0, orch_args, worker_args=worker_args,
                        logs_dir=out_dir / "logs") as address, tqdm(total=total, unit="run") as progress:
        runs = asyncio.run(_run_all(address, hf, chosen, modes, args.max_new_tokens, progress, plan, args.repeats))
        gemm_paths = worker_gemm_paths(out_dir / "logs")
    categories = {p["id"]: p.get("category", p["id"]) for p in chosen}
    summaries = [summarize(runs, mode, plan, categories) for mode in modes]
    report = {
        "command": "specdec bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": describe_machine(),
        "device": str(device), "target": args.target, "target_dtype": str(target_dtype), "draft": args.draft,
        "draft_dtype": str(draft_dtype), "config": config, "gemm_paths": gemm_paths,
        "prompts": [p["id"] for p in chosen], "max_new_tokens": args.max_new_tokens,
        "summaries": summaries, "runs": [asdict(r) for r in runs],
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    m = report["machine"]
    md = [f"# specdec bench\n\n`{report['command']}` — {report['started']} UTC, {report['duration_s']:.0f} s, "
          f"on `{device}`: target `{args.target}` ({target_dtype}), draft `{args.draft}` ({draft_dtype}); "
          + ("HF anchors on the same device in the same dtypes" if hf is not None else "no HF anchors (`--systems`)")
          + (" (the service's draft also runs smaller copies of its weights, int4 or bf16, for its fewest-row "
             "steps: its GEMM path below; HF assisted's draft does not)"
             if "copy at M=" in gemm_paths.get("draft", "") else "")
          + f"; prompts {', '.join(report['prompts'])}, "
          f"{args.max_new_tokens} new tokens.\n\nMachine: {m['cpu']} ({m['cpus']} cpus; flags {m['flags']}); "
          f"{m['gpu']}; torch {m['torch']}.\n\nGEMM path the workers took (GetInfo): "
          + "; ".join(f"{role}: {path}" for role, path in gemm_paths.items()) + "\n"]
    md += [markdown(s) for s in summaries]
    paths = plots(summaries, runs, out_dir)
    md.append("\n" + "\n".join(f"![{p.stem}]({p.name})" for p in paths) + "\n")
    (out_dir / "report.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"wrote {out_dir / 'report.md'}, {out_dir / 'report.json'} and {len(paths)} plots")


def worker_gemm_paths(logs_dir: Path) -> dict[str, str]:
    """Each running worker's GEMM path as its GetInfo reports it (port files in logs_dir): which path
    this CPU took, for the report."""
    import grpc

    from specdec.v1 import common_pb2, worker_pb2_grpc
    stubs = {"target": worker_pb2_grpc.TargetWorkerStub, "draft": worker_pb2_grpc.DraftWorkerStub}
    paths = {}
    for role, stub in stubs.items():
        try:
            port = (logs_dir / f"{role}.port").read_text().strip()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                info = stub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
            paths[role] = info.gemm_path or "not chosen (no calibration, or not a CPU)"
        except (OSError, grpc.RpcError) as exc:
            paths[role] = f"unknown ({type(exc).__name__})"
    return paths


# Environment variables that cap the instruction set of torch's own kernels, oneDNN's and MKL's.
KERNEL_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def describe_machine() -> dict[str, Any]:
    """What a figure depends on: CPU model and the flags that change small-M GEMM, or the GPU."""
    import os
    import subprocess
    cpu, flags, fields = platform.processor() or "unknown CPU", set(), {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        cpu = fields.get("Model name", cpu)
        flags = set(fields.get("Flags", "").split())
        # Model names can be generic ("AMD EPYC" for Zen 4 and Zen 5 alike): family and model tell them apart.
        if "CPU family" in fields and "Model" in fields:
            cpu += f" (family {fields['CPU family']} model {fields['Model']})"
    except (OSError, subprocess.SubprocessError):
        pass
    relevant = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx_vnni",
                "amx_bf16", "amx_tile"]
    gpu = "no GPU"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        driver = "unknown"
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
        gpu = (f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB), driver {driver}, "
               f"CUDA {torch.version.cuda}")
    flag_text = " ".join(f for f in relevant if f in flags) or "none of " + "/".join(relevant)
    # Kernels restricted below what the flags offer (an AVX2 CPU emulated on an AVX-512 one): a figure
    # then belongs to those kernels on this machine's memory, and the report must say so.
    restricted = {name: os.environ[name] for name in KERNEL_LIMITS if os.environ.get(name)}
    if restricted:
        flag_text += (" (kernels restricted: " + " ".join(f"{k}={v}" for k, v in restricted.items())
                      + f"; torch runs {torch.backends.cpu.get_cpu_capability()} kernels)")
    return {"cpu": cpu, "cpus": os.cpu_count(), "flags": flag_text, "gpu": gpu, "platform": platform.platform(),
            "torch": torch.__version__}


if __name__ == "__main__":
    main()
