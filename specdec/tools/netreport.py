"""The `specdec netbench` report: each run (NetRun), the round traces mapped onto the runs, the
ceiling and verify-slowdown estimates read from them, per-latency ratios, the markdown tables and
the plot. Kept apart from netbench.py, which runs the services and the requests."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Each system sets what it compares explicitly, whatever the server's config says, or takes what
# netbench_config sets (the pair guard, which would carry one system's measurements into another's
# rounds, off; the prefill overlap "auto", which a request cannot ask for: "pipelined" leaves it so).
SYSTEMS = {"target-only": {"fixed_k": 0},
           "serial": {"pipeline": False, "overlap_prefill": False},
           "pipelined-no-branches": {"pipeline": True, "pipeline_branches": 0, "overlap_prefill": False},
           "pipelined-no-overlap": {"pipeline": True, "overlap_prefill": False},
           "pipelined": {"pipeline": True},
           "pipelined-overlap": {"pipeline": True, "overlap_prefill": True}}
PIPELINED = ("pipelined-no-branches", "pipelined-no-overlap", "pipelined", "pipelined-overlap")
# What each system is, for the report's column heads.
LABELS = {"target-only": "target-only", "serial": "serial", "pipelined-no-branches": "pipelined, no branches",
          "pipelined-no-overlap": "pipelined, branches", "pipelined": "pipelined, branches, overlap auto (default)",
          "pipelined-overlap": "pipelined, branches, overlap on"}
REFERENCES = ("target-only", "serial")  # run whatever --systems selects: every ratio is against them
MIN_ROUNDS_PER_K = 3  # verify_slowdown compares a k only with this many rounds on each side


@dataclass
class NetRun:
    latency_ms: float
    system: str
    prompt: str
    tokens: int
    wall_s: float
    verify_ms: float
    hits: int
    misses: int
    saved_ms: float
    token_ids: list[int]
    branch_hits: int = 0
    repeat: int = 0  # the pass over the prompts (--repeats)
    # The orchestrator's round trace lines of this request (orchestrator.traces.RoundTrace fields).
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def attach_rounds(runs: list[NetRun], trace_path: Path) -> bool:
    """Give each run its round trace lines. The requests ran one after another after one warm-up
    request, so the trace's sessions, in order of first appearance, are the warm-up, then the runs.
    False (and nothing attached) if the counts do not match."""
    from orchestrator.traces import load_traces
    if not trace_path.exists():
        return False
    sessions: dict[str, list[dict[str, Any]]] = {}
    for trace in load_traces(trace_path):
        sessions.setdefault(trace.session, []).append(asdict(trace))
    ordered = list(sessions.values())[1:]
    # Same count, and each session made exactly its run's tokens: a retried or extra request
    # would shift the mapping, and then nothing is attached rather than the wrong rounds.
    if len(ordered) != len(runs) or any(sum(r["emitted"] for r in rounds) != run.tokens
                                        for run, rounds in zip(runs, ordered)):
        return False
    for run, rounds in zip(runs, ordered):
        run.rounds = rounds
    return True


def ceiling(run: NetRun) -> float | None:
    """An estimate of what hiding the drafts is worth for this serial run: its wall time over the
    same rounds with every draft hidden (the first round as it was, each later one as long as its
    verify call). Not a bound: pipelined rounds choose their own k, and the prefill overlap changes
    the first round."""
    if len(run.rounds) < 2:
        return None
    hidden = run.rounds[0]["round_ms"] + sum(r["verify_wall_ms"] for r in run.rounds[1:])
    return sum(r["round_ms"] for r in run.rounds) / hidden if hidden > 0 else None


def verify_slowdown(pipelined: list[NetRun], serial: list[NetRun]) -> float | None:
    """The target's compute per verify in pipelined runs (the draft pre-drafting beside it) over
    serial runs (the draft idle), at the same k, weighted by the pipelined rounds at each k.
    Steady rounds only: a prefill's cost says nothing about the overlap."""
    def by_k(runs: list[NetRun]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for run in runs:
            for r in run.rounds[1:]:
                if r["drafted"] > 0 and r["target_prefilled"] <= 2:
                    out.setdefault(r["drafted"], []).append(r["verify_ms"])
        return out
    piped, alone = by_k(pipelined), by_k(serial)
    # Only where both sides have a few rounds at that k (they come from different prompts and
    # positions, and one serial round is too noisy a reference).
    pairs = [(len(ms), statistics.mean(ms) / statistics.mean(alone[k])) for k, ms in piped.items()
             if len(alone.get(k, ())) >= MIN_ROUNDS_PER_K and len(ms) >= MIN_ROUNDS_PER_K]
    total = sum(n for n, _ in pairs)
    return sum(n * ratio for n, ratio in pairs) / total if total else None


def summarize(runs: list[NetRun]) -> list[dict[str, Any]]:
    rows = []
    for latency in sorted({r.latency_ms for r in runs}):
        at = [r for r in runs if r.latency_ms == latency]
        by = {name: rs for name in SYSTEMS if (rs := [r for r in at if r.system == name])}
        # Each run against the references on the same prompt in the same pass.
        base = {(r.prompt, r.repeat): r for r in by["target-only"]}
        serial = {(r.prompt, r.repeat): r for r in by["serial"]}
        passes = sorted({r.repeat for r in at})
        row: dict[str, Any] = {"one_way_ms": latency, "passes": len(passes)}
        for name, rs in by.items():
            row[f"{name}_tok_s"] = statistics.median(r.tokens_per_s for r in rs)
            row[f"{name}_target_busy"] = sum(r.verify_ms for r in rs) / max(1e-9, 1000 * sum(r.wall_s for r in rs))
            row[f"{name}_vs_target_only"] = statistics.median(
                r.tokens_per_s / base[key].tokens_per_s for r in rs if (key := (r.prompt, r.repeat)) in base)
            if name not in PIPELINED:
                continue
            ratios = [(r.repeat, r.tokens_per_s / serial[key].tokens_per_s) for r in rs
                      if (key := (r.prompt, r.repeat)) in serial]
            row[f"{name}_vs_serial"] = statistics.median(ratio for _, ratio in ratios)
            if len(passes) > 1:  # the median per pass: the spread between passes is the run's own noise
                row[f"{name}_vs_serial_by_pass"] = [statistics.median(ratio for rep, ratio in ratios if rep == p)
                                                    for p in passes if any(rep == p for rep, _ in ratios)]
            hits, misses = sum(r.hits for r in rs), sum(r.misses for r in rs)
            row[f"{name}_hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
            row[f"{name}_branch_hit_share"] = sum(r.branch_hits for r in rs) / hits if hits else 0.0
            row[f"{name}_saved_ms_per_request"] = statistics.mean(r.saved_ms for r in rs)
            if all(r.rounds for r in rs):  # (the traces attached)
                row[f"{name}_overlapped"] = statistics.mean(bool(r.rounds[0].get("overlapped")) for r in rs)
        ceilings = [c for r in by["serial"] if (c := ceiling(r)) is not None]
        if ceilings:
            row["ceiling_vs_serial"] = statistics.median(ceilings)
        slowdown = verify_slowdown([r for name in PIPELINED for r in by.get(name, [])], by["serial"])
        if slowdown is not None:
            row["verify_slowdown"] = slowdown
        # Greedy: every system must produce the same tokens.
        # Each run against target-only on its prompt: one without that reference fails the check
        # (it compared nothing), and target-only's own runs are the reference, not compared.
        others = [r for r in at if r.system != "target-only"]
        row["identical"] = bool(others) and all(
            (key := (r.prompt, r.repeat)) in base and r.token_ids == base[key].token_ids for r in others)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """Two tables, one row per latency, a column per system that ran (SYSTEMS order), and the
    per-pass ratios where the run repeated."""
    ran = [name for name in SYSTEMS if any(f"{name}_tok_s" in r for r in rows)]
    piped = [name for name in PIPELINED if name in ran]

    def cell(r: dict[str, Any], fmt: str, key: str, suffix: str = "") -> str:
        return format(r[key], fmt) + suffix if key in r else "-"

    def speed(r: dict[str, Any], name: str) -> str:
        return f"{r[name + '_tok_s']:.2f} ({r[name + '_vs_target_only']:.2f}x)" if name + "_tok_s" in r else "-"
    head = ["one-way latency", "target-only tok/s"]
    head += [f"{LABELS[name]}: tok/s (vs target-only)" for name in ran if name != "target-only"]
    head += [f"{LABELS[name]} / serial" for name in piped]
    head += ["ceiling: serial rounds with every draft hidden", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['one_way_ms']:g} ms", cell(r, ".2f", "target-only_tok_s")]
        cells += [speed(r, name) for name in ran if name != "target-only"]
        cells += [cell(r, ".2f", f"{name}_vs_serial") for name in piped]
        cells += [cell(r, ".2f", "ceiling_vs_serial"), "yes" if r["identical"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    head = ["one-way latency"]
    head += [f"{LABELS[name]}: hit rate (of hits, from a branch), draft time saved per request, "
             f"turns overlapped" for name in piped]
    head += ["target busy: " + " / ".join(LABELS[name] for name in ran), "verify compute, draft busy / draft idle"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['one_way_ms']:g} ms"]
        cells += [f"{cell(r, '.0%', name + '_hit_rate')} ({cell(r, '.0%', name + '_branch_hit_share')}), "
                  f"{cell(r, '.0f', name + '_saved_ms_per_request', ' ms')}, {cell(r, '.0%', name + '_overlapped')}"
                  for name in piped]
        cells += [" / ".join(cell(r, ".0%", name + "_target_busy") for name in ran),
                  cell(r, ".2f", "verify_slowdown", "x")]
        lines.append("| " + " | ".join(cells) + " |")
    by_pass = [(r["one_way_ms"], name, r[f"{name}_vs_serial_by_pass"]) for r in rows for name in PIPELINED
               if f"{name}_vs_serial_by_pass" in r]
    if by_pass:
        lines += ["", "Pipelined / serial, median over the prompts of each pass (max / min: the spread between passes):", ""]
        lines += [f"- {latency:g} ms, {name}: {', '.join(f'{v:.2f}' for v in values)} "
                  f"(max / min {max(values) / min(values):.3f})" for latency, name, values in by_pass]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["one_way_ms"] for r in rows]
    for name in SYSTEMS:
        if all(f"{name}_tok_s" in r for r in rows):
            ax.plot(xs, [r[f"{name}_tok_s"] for r in rows], marker="o", label=name)
    ax.set_xlabel("injected one-way latency per RPC (ms)")
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_title("Pipelined vs serial rounds, workers on disjoint cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

