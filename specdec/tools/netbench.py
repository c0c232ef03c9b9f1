"""`specdec netbench`: pipelined against serial rounds and target-only, over an emulated network.

The workers run on disjoint CPU sets (taskset, one torch thread each by default) to emulate two
devices, and the orchestrator adds a one-way delay to every worker call (a gRPC client interceptor;
the traffic stays on 127.0.0.1). For each one-way latency, three systems run the same prompts,
round-robin per prompt, in one run:

  target-only            fixed k = 0
  serial                 the server's k policy, rounds one after the other
  pipelined-no-branches  the same policy, the draft drafting round n+1 during round n's verify
                         on the assumption that round n is fully accepted
  pipelined              the same, plus branch pre-drafts for the likeliest rejections
                         (pipeline_branches, the server's default)
  pipelined-overlap      the same, plus the prefill overlap: a turn's first round runs target-only
                         while the draft prefills the prompt and pre-drafts round 2

Reported per latency: tok/s, ratios, the pre-draft hit rate, the draft time hits saved, and target
capacity (the target's busy fraction: verify compute / wall time). A plot of tok/s against latency.
From the orchestrator's round traces (OUT/rounds-<latency>ms.jsonl) two figures that bound what
pipelining can do on the machine at hand: the **ceiling** (the serial runs' own rounds with every
draft hidden: the first round as it was, every later round as long as its verify call) and the
**verify slowdown** (the target's compute per verify at a given k in pipelined runs, where the draft
works beside it, against serial runs, where it is idle: on two real devices 1.0; on one machine the
two processes share memory bandwidth and caches).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parents[2]
# Each system sets what it compares explicitly, whatever the server's config says.
SYSTEMS = {"target-only": {"fixed_k": 0},
           "serial": {"pipeline": False, "overlap_prefill": False},
           "pipelined-no-branches": {"pipeline": True, "pipeline_branches": 0, "overlap_prefill": False},
           "pipelined": {"pipeline": True, "overlap_prefill": False},
           "pipelined-overlap": {"pipeline": True, "overlap_prefill": True}}
PIPELINED = ("pipelined-no-branches", "pipelined", "pipelined-overlap")


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
    # The orchestrator's round trace lines of this request (orchestrator.traces.RoundTrace fields).
    rounds: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


async def _runs(address: str, latency: float, prompts: list[dict], max_new: int) -> list[NetRun]:
    import grpc

    from specdec.tools.client import build_request
    from specdec.v1 import orchestrator_pb2_grpc
    runs = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await stub.Generate(build_request(prompt_ids=prompts[0]["ids"], max_new_tokens=4), timeout=600)  # warm-up
        names = list(SYSTEMS)
        for index, prompt in enumerate(prompts):
            order = names[index % len(names):] + names[:index % len(names)]
            for name in order:
                req = build_request(prompt_ids=prompt["ids"], max_new_tokens=max_new)
                for key, value in SYSTEMS[name].items():
                    setattr(req.speculation, key, value)
                start = time.perf_counter()
                reply = await stub.Generate(req, timeout=1800)
                wall = time.perf_counter() - start
                s = reply.stats
                runs.append(NetRun(latency, name, prompt["id"], s.new_tokens, wall, s.verify_ms, s.predraft_hits,
                                   s.predraft_misses, s.predraft_saved_ms, list(reply.token_ids),
                                   s.predraft_branch_hits))
                print(f"  one-way {latency:g} ms, {prompt['id']}, {name}: {runs[-1].tokens_per_s:.2f} tok/s", flush=True)
    return runs


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
    if len(ordered) != len(runs):
        return False
    for run, rounds in zip(runs, ordered):
        run.rounds = rounds
    return True


def ceiling(run: NetRun) -> float | None:
    """What pipelining could at best make of this serial run: its wall time over the same rounds
    with every draft hidden (the first round as it was, each later one as long as its verify call)."""
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
    pairs = [(len(ms), statistics.mean(ms) / statistics.mean(alone[k])) for k, ms in piped.items() if k in alone]
    total = sum(n for n, _ in pairs)
    return sum(n * ratio for n, ratio in pairs) / total if total else None


def summarize(runs: list[NetRun]) -> list[dict[str, Any]]:
    rows = []
    for latency in sorted({r.latency_ms for r in runs}):
        at = [r for r in runs if r.latency_ms == latency]
        by = {name: rs for name in SYSTEMS if (rs := [r for r in at if r.system == name])}
        base = {r.prompt: r for r in by["target-only"]}
        serial = {r.prompt: r for r in by["serial"]}
        row: dict[str, Any] = {"one_way_ms": latency}
        for name, rs in by.items():
            row[f"{name}_tok_s"] = statistics.median(r.tokens_per_s for r in rs)
            row[f"{name}_target_busy"] = sum(r.verify_ms for r in rs) / max(1e-9, 1000 * sum(r.wall_s for r in rs))
            row[f"{name}_vs_target_only"] = statistics.median(
                r.tokens_per_s / base[r.prompt].tokens_per_s for r in rs if r.prompt in base)
            if name not in PIPELINED:
                continue
            prefix = "" if name == "pipelined" else f"{name}_"
            row[f"{name}_vs_serial"] = statistics.median(
                r.tokens_per_s / serial[r.prompt].tokens_per_s for r in rs if r.prompt in serial)
            hits, misses = sum(r.hits for r in rs), sum(r.misses for r in rs)
            row[f"{prefix}hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
            row[f"{prefix}branch_hit_share"] = sum(r.branch_hits for r in rs) / hits if hits else 0.0
            row[f"{prefix}saved_ms_per_request"] = statistics.mean(r.saved_ms for r in rs)
        ceilings = [c for r in by["serial"] if (c := ceiling(r)) is not None]
        if ceilings:
            row["ceiling_vs_serial"] = statistics.median(ceilings)
        slowdown = verify_slowdown([r for name in PIPELINED for r in by.get(name, [])], by["serial"])
        if slowdown is not None:
            row["verify_slowdown"] = slowdown
        # Greedy: every system must produce the same tokens.
        row["identical"] = all(r.token_ids == base[r.prompt].token_ids for r in at if r.prompt in base)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], fmt: str, *keys: str) -> str:
        return ", ".join(format(r[k], fmt) if k in r else "-" for k in keys)

    def speed(r: dict[str, Any], name: str) -> str:
        return f"{r[name + '_tok_s']:.2f} ({r[name + '_vs_target_only']:.2f}x)" if name + "_tok_s" in r else "-"
    lines = ["| one-way latency | target-only tok/s | serial tok/s (vs target-only) | pipelined, no branches "
             "(vs target-only) | pipelined, branches (vs target-only) | pipelined, branches + prefill overlap "
             "(vs target-only) | pipelined / serial: no branches, branches, + overlap | ceiling: serial rounds "
             "with every draft hidden | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['one_way_ms']:g} ms | {r['target-only_tok_s']:.2f} | {speed(r, 'serial')} "
            f"| {speed(r, 'pipelined-no-branches')} | {speed(r, 'pipelined')} | {speed(r, 'pipelined-overlap')} "
            f"| {cell(r, '.2f', *(name + '_vs_serial' for name in PIPELINED))} "
            f"| {cell(r, '.2f', 'ceiling_vs_serial')} | {'yes' if r['identical'] else 'NO'} |")
    lines += ["", "| one-way latency | hit rate: no branches, branches, + overlap (of hits, from a branch) "
              "| draft time saved per request: no branches, branches, + overlap | target busy: k=0 / serial / "
              "pipelined / + overlap | verify compute, draft busy / draft idle |",
              "|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['one_way_ms']:g} ms "
            f"| {cell(r, '.0%', 'pipelined-no-branches_hit_rate', 'hit_rate', 'pipelined-overlap_hit_rate')} "
            f"({cell(r, '.0%', 'branch_hit_share')}) "
            f"| {cell(r, '.0f', 'pipelined-no-branches_saved_ms_per_request', 'saved_ms_per_request', 'pipelined-overlap_saved_ms_per_request')} ms "
            f"| {r['target-only_target_busy']:.0%} / {r['serial_target_busy']:.0%} / "
            f"{cell(r, '.0%', 'pipelined_target_busy')} / {cell(r, '.0%', 'pipelined-overlap_target_busy')} "
            f"| {cell(r, '.2f', 'verify_slowdown')}x |")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec netbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--latencies-ms", default="0,2,10,25", help="one-way latency per RPC, each direction")
    parser.add_argument("--target-cpus", default="0")
    parser.add_argument("--draft-cpus", default="1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--config", help="orchestrator [speculation] TOML (default for the embedded pair: "
                        "configs/embedded-pair-cpu.toml)")
    parser.add_argument("--calibration-s", type=float, default=10.0)
    parser.add_argument("--smoke", action="store_true", help="tiny random models, 2 prompts, 12 tokens (CI)")
    parser.add_argument("--out", default=str(ROOT / "netbench-out"))
    args = parser.parse_args(argv)

    from specdec.models import load_tokenizer
    from specdec.tools.bench import describe_machine
    from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
    if args.smoke:
        args.target, args.draft, args.max_new_tokens, args.max_prompts = \
            "tiny:seed=0", "tiny:seed=0,noise=0.02", 12, 2
    config = args.config
    if config is None and (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT):
        config = str(DEFAULT_PAIR_CONFIG)
    tokenizer = load_tokenizer(args.target)
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()][:args.max_prompts]
    for p in prompts:
        p["ids"] = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
    latencies = [float(x) for x in args.latencies_ms.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs: list[NetRun] = []
    for latency in latencies:
        orch_args = ["--log-level", "WARNING", "--emulate-one-way-latency-ms", str(latency)]
        orch_args += ["--config", config] if config else []
        worker_args = ["--calibration-s", str(args.calibration_s)]
        cpu_sets = {"target": args.target_cpus, "draft": args.draft_cpus}
        trace = out / f"rounds-{latency:g}ms.jsonl"
        trace.unlink(missing_ok=True)
        orch_args += ["--trace-file", str(trace)]
        with local_services(args.target, args.draft, args.threads, orch_args, worker_args=worker_args,
                            cpu_sets=cpu_sets) as address:
            at = asyncio.run(_runs(address, latency, prompts, args.max_new_tokens))
        if not attach_rounds(at, trace):
            print(f"  {trace}: sessions do not match the requests; no ceiling or slowdown at {latency:g} ms")
        runs += at
    rows = summarize(runs)
    machine = describe_machine()
    command = "specdec netbench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    header = (f"`{command}` — {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, "
              f"{time.time() - started:.0f} s; target `{args.target}` on CPUs {args.target_cpus}, draft "
              f"`{args.draft}` on CPUs {args.draft_cpus}, {args.threads} torch thread(s) each; {len(prompts)} "
              f"prompts x {args.max_new_tokens} tokens, greedy; config {config}.\n\nMachine: {machine['cpu']} "
              f"({machine['cpus']} cpus; flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}.\n")
    plot(rows, out / "netbench.png")
    text = f"# specdec netbench\n\n{header}\n{markdown(rows)}\n![tok/s against latency](netbench.png)\n"
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"command": command, "machine": machine, "rows": rows,
                                                 "runs": [{k: v for k, v in asdict(r).items() if k != "rounds"} for r in runs]}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
