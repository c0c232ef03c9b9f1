"""The `specdec loadtest --sweep` report: per-level results (Level), their pooled rates and
speculative / target-only ratios per repeat, the markdown table, the plot, and the pair guard's
epochs read back from a round trace. Kept apart from loadsweep.py, which runs the load."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.tools.loadtest import percentile

if TYPE_CHECKING:
    from orchestrator.traces import RoundTrace


@dataclass
class Level:
    mode: str                  # "speculative" | "target-only"
    streams: int
    repeat: int = 0            # which of --repeats this block was
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    itl_ms: list[float] = field(default_factory=list)        # per token: each chunk's gap over its tokens
    chunk_gap_ms: list[float] = field(default_factory=list)  # per chunk: the gap a client waits
    tpot_ms: list[float] = field(default_factory=list)       # per request: time per token after the first chunk
    ttft_ms: list[float] = field(default_factory=list)
    mismatches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    k_sum: int = 0
    guard_off_rounds: int = 0  # rounds the pair guard ran target-only
    started: float = 0.0       # perf_counter at the block's start
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (s since start, tokens) per chunk
    stream_ends: list[float] = field(default_factory=list)           # s since start, per stream
    requests_per_stream: int = 0  # what each stream ran (0: not recorded)
    prompts_run: list[int] = field(default_factory=list)  # prompt index of each request, in start order

    def busy_tokens_per_s(self) -> float:
        """Tokens per second while every stream was still running: up to the first stream's end."""
        if not self.stream_ends or not self.arrivals:
            return 0.0
        until = min(self.stream_ends)
        tokens = sum(n for at, n in self.arrivals if at <= until)
        return tokens / until if until > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "streams": self.streams, "repeat": self.repeat, "requests": self.requests,
                "requests_per_stream": self.requests_per_stream, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.wall_s, 2) if self.wall_s else 0.0,
                "busy_tokens_per_s": round(self.busy_tokens_per_s(), 2),
                "itl_p50_ms": round(percentile(self.chunk_gap_ms, 0.5), 1),   # per chunk (since 2026-11-28)
                "itl_p99_ms": round(percentile(self.chunk_gap_ms, 0.99), 1),
                "token_gap_p50_ms": round(percentile(self.itl_ms, 0.5), 1),   # per token (the ITL before)
                "token_gap_p99_ms": round(percentile(self.itl_ms, 0.99), 1),
                "tpot_p50_ms": round(percentile(self.tpot_ms, 0.5), 1),
                "ttft_p50_ms": round(percentile(self.ttft_ms, 0.5), 1),
                "ttft_p99_ms": round(percentile(self.ttft_ms, 0.99), 1),
                "mismatches": self.mismatches, "errors": self.errors,
                "acceptance": round(self.accepted_tokens / self.draft_tokens, 3) if self.draft_tokens else None,
                "mean_k": round(self.k_sum / self.rounds, 2) if self.rounds else 0.0,
                "guard_off_share": round(self.guard_off_rounds / self.rounds, 3) if self.rounds else 0.0,
                "wall_s": round(self.wall_s, 1)}


def pooled(levels: list[Level], mode: str, streams: int) -> float:
    """Aggregate tok/s of one mode at one level over all its repeats: tokens over wall time."""
    blocks = [lv for lv in levels if lv.mode == mode and lv.streams == streams]
    wall = sum(lv.wall_s for lv in blocks)
    return sum(lv.tokens for lv in blocks) / wall if wall else 0.0


def pooled_busy(levels: list[Level], mode: str, streams: int) -> float:
    """Busy-window tok/s of one mode at one level over all its repeats (see Level.busy_tokens_per_s)."""
    blocks = [lv for lv in levels if lv.mode == mode and lv.streams == streams and lv.stream_ends]
    window = sum(min(lv.stream_ends) for lv in blocks)
    return sum(lv.busy_tokens_per_s() * min(lv.stream_ends) for lv in blocks) / window if window else 0.0


def ratios(levels: list[Level], busy: bool = False) -> dict[int, list[float]]:
    """Per level: speculative / target-only tok/s (whole blocks, or busy windows), one ratio per
    repeat (the two blocks of a repeat ran back to back)."""
    def rate(lv: Level) -> float:
        return lv.busy_tokens_per_s() if busy else lv.summary()["tokens_per_s"]
    out: dict[int, list[float]] = {}
    for lv in levels:
        if lv.mode != "speculative":
            continue
        plain = [p for p in levels if p.mode == "target-only" and p.streams == lv.streams and p.repeat == lv.repeat]
        if plain and rate(plain[0]):
            out.setdefault(lv.streams, []).append(rate(lv) / rate(plain[0]))
    return out


def guard_epochs(traces: list[RoundTrace]) -> list[dict[str, Any]]:
    """Runs of consecutive rounds (in the order they ended) with one policy and one guard mode: what
    the pair did when. For each: its span in s from the first round's start, rounds, tokens, tok/s
    over the span, the tokens per second of round time (per session), prompts, draft catch-up."""
    if not traces:
        return []
    t0 = min(t.ts - t.round_ms / 1000.0 for t in traces)
    runs: list[dict[str, Any]] = []
    for t in traces:
        key = (t.policy, t.guard or "-")
        if not runs or runs[-1]["key"] != key:
            runs.append({"key": key, "from_s": t.ts - t.round_ms / 1000.0 - t0, "to_s": 0.0, "rounds": 0,
                         "tokens": 0, "round_ms": 0.0, "prompts": 0, "draft_prefilled": 0})
        run = runs[-1]
        run["from_s"] = min(run["from_s"], t.ts - t.round_ms / 1000.0 - t0)
        run["to_s"] = t.ts - t0
        run["rounds"] += 1
        run["tokens"] += t.tokens
        run["round_ms"] += t.round_ms
        run["prompts"] += int(t.target_prefilled > 1)
        run["draft_prefilled"] += t.draft_prefilled
    return [{"policy": r["key"][0], "guard": r["key"][1], "from_s": round(r["from_s"], 1), "to_s": round(r["to_s"], 1),
             "rounds": r["rounds"], "tokens": r["tokens"], "prompts": r["prompts"],
             "draft_prefilled": r["draft_prefilled"],
             "tokens_per_s": round(r["tokens"] / (r["to_s"] - r["from_s"]), 2) if r["to_s"] > r["from_s"] else 0.0,
             "session_tokens_per_s": round(1000.0 * r["tokens"] / r["round_ms"], 2) if r["round_ms"] else 0.0}
            for r in runs]


def epochs_markdown(traces: list[RoundTrace]) -> str:
    """guard_epochs as a markdown table."""
    rows = [("| policy | guard | from s | to s | rounds | tokens | tok/s over the span | tok/s per session | "
             "prompts | draft prefilled |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for e in guard_epochs(traces):
        rows.append(f"| {e['policy']} | {e['guard']} | {e['from_s']} | {e['to_s']} | {e['rounds']} | {e['tokens']} | "
                    f"{e['tokens_per_s']} | {e['session_tokens_per_s']} | {e['prompts']} | {e['draft_prefilled']} |")
    return "\n".join(rows)


def markdown(levels: list[Level]) -> str:
    """One row per block: "requests / stream" is what each of its streams ran (loadsweep runs more at
    the lower levels so that every level runs each prompt equally often); "x one stream" is its tok/s
    over the same mode's pooled 1-stream rate ("-" where the sweep had no 1-stream level)."""
    repeated = any(lv.repeat for lv in levels)
    rows = ["| mode | streams | requests / stream | " + ("repeat | " if repeated else "") + "tok/s | x one stream | "
            "tok/s, all busy | ITL p50 / p99 ms, per chunk (per token) | TPOT p50 ms | TTFT p50 / p99 ms | "
            "acceptance | mean k | guard: rounds off | "
            "differs from alone | errors |",
            "|---|---|---|" + ("---|" if repeated else "") + "---|---|---|---|---|---|---|---|---|---|---|"]
    base = {mode: pooled(levels, mode, 1) for mode in ("speculative", "target-only")}
    for lv in sorted(levels, key=lambda lv: (lv.mode != "speculative", lv.streams, lv.repeat)):
        s = lv.summary()
        ratio = f"{s['tokens_per_s'] / base[lv.mode]:.2f}x" if base.get(lv.mode) else "-"
        rows.append(f"| {lv.mode} | {lv.streams} | {lv.requests_per_stream or '-'} | "
                    + (f"{lv.repeat + 1} | " if repeated else "")
                    + f"{s['tokens_per_s']:.2f} | {ratio} | {s['busy_tokens_per_s']:.2f} | "
                    f"{s['itl_p50_ms']:.0f} / {s['itl_p99_ms']:.0f} ({s['token_gap_p50_ms']:.0f} / "
                    f"{s['token_gap_p99_ms']:.0f}) | {s['tpot_p50_ms']:.0f} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
                    f"{s['acceptance'] if s['acceptance'] is not None else '-'} | {s['mean_k']} | "
                    f"{s['guard_off_share']:.0%} | "
                    f"{lv.mismatches}/{lv.requests} | "
                    f"{sum(lv.errors.values())} |")
    parts = []
    busy_ratios = ratios(levels, busy=True)

    def spread(values: list[float]) -> str:
        return f" (repeats {min(values):.2f}-{max(values):.2f}x)" if len(values) > 1 else ""
    for streams, values in ratios(levels).items():
        plain = pooled(levels, "target-only", streams)
        overall = pooled(levels, "speculative", streams) / plain if plain else 0.0
        busy_plain = pooled_busy(levels, "target-only", streams)
        busy = pooled_busy(levels, "speculative", streams) / busy_plain if busy_plain else 0.0
        parts.append(f"- {streams} streams: {overall:.2f}x over whole blocks{spread(values)}, "
                     f"{busy:.2f}x while all streams were busy{spread(busy_ratios.get(streams, []))}")
    rows.append("\nspeculative / target-only at the same load:\n" + "\n".join(parts))
    return "\n".join(rows)


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("speculative", "o-"), ("target-only", "s--")):
        counts = sorted({lv.streams for lv in levels if lv.mode == mode})
        p99 = [percentile([ms for lv in levels if lv.mode == mode and lv.streams == n for ms in lv.chunk_gap_ms], 0.99)
               for n in counts]
        left.plot(counts, [pooled(levels, mode, n) for n in counts], style, label=mode)
        right.plot(counts, p99, style, label=mode)
    left.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput")
    right.set(xlabel="concurrent streams", ylabel="p99 inter-token latency per chunk (ms)", title="latency")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
