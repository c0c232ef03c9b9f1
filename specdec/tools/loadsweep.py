"""`specdec loadtest --sweep 1,2,4,8`: concurrent streams against the pair, speculation vs target-only.

For each concurrency level N, N closed-loop streams each run `--requests-per-stream` greedy requests
one after another (the bench's prompts, chat-templated), first with the server's default k policy,
then with k = 0 (target-only) through the same services. Reports per level: aggregate tok/s, p50 and
p99 inter-token latency (each chunk's gap spread over the tokens it carried, so a speculative round's
burst counts as that many tokens), p50 and p99 time to first token, and how many outputs differ from
the same prompt run alone (identity under batching). Bounded: a fixed number of requests, each with
a deadline; it stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.tools.loadtest import make_request, percentile

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Level:
    mode: str                  # "speculative" | "target-only"
    streams: int
    requests: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    mismatches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0
    k_sum: int = 0
    guard_off_rounds: int = 0  # rounds the pair guard ran target-only

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "streams": self.streams, "requests": self.requests, "tokens": self.tokens,
                "tokens_per_s": round(self.tokens / self.wall_s, 2) if self.wall_s else 0.0,
                "itl_p50_ms": round(percentile(self.itl_ms, 0.5), 1),
                "itl_p99_ms": round(percentile(self.itl_ms, 0.99), 1),
                "ttft_p50_ms": round(percentile(self.ttft_ms, 0.5), 1),
                "ttft_p99_ms": round(percentile(self.ttft_ms, 0.99), 1),
                "mismatches": self.mismatches, "errors": self.errors,
                "acceptance": round(self.accepted_tokens / self.draft_tokens, 3) if self.draft_tokens else None,
                "mean_k": round(self.k_sum / self.rounds, 2) if self.rounds else 0.0,
                "guard_off_share": round(self.guard_off_rounds / self.rounds, 3) if self.rounds else 0.0,
                "wall_s": round(self.wall_s, 1)}


async def _one(stub: Any, prompt_ids: list[int], max_new: int, fixed_k: int | None, timeout_s: float,
               level: Level) -> list[int] | None:
    import grpc
    req = make_request(prompt_ids, max_new, fixed_k)
    ids: list[int] = []
    start = last = time.perf_counter()
    try:
        async for chunk in stub.GenerateStream(req, timeout=timeout_s):
            now = time.perf_counter()
            if chunk.token_ids:
                if not ids:
                    level.ttft_ms.append((now - start) * 1000.0)
                else:
                    level.itl_ms.extend([(now - last) * 1000.0 / len(chunk.token_ids)] * len(chunk.token_ids))
                ids.extend(chunk.token_ids)
                last = now
            if chunk.HasField("stats"):
                level.draft_tokens += chunk.stats.draft_tokens
                level.accepted_tokens += chunk.stats.accepted_tokens
                level.rounds += chunk.stats.rounds
                level.k_sum += sum(chunk.stats.k_per_round)
                level.guard_off_rounds += chunk.stats.guard_off_rounds
    except grpc.aio.AioRpcError as err:
        level.errors[err.code().name] = level.errors.get(err.code().name, 0) + 1
        return None
    level.tokens += len(ids)
    return ids


async def sweep(address: str, prompts: list[list[int]], levels: list[int], requests_per_stream: int,
                max_new: int, timeout_s: float) -> tuple[list[Level], dict[int, list[int]]]:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        alone = Level("reference", 1)
        references = {}
        for i, prompt in enumerate(prompts):  # each prompt alone, target-only: what identity means
            references[i] = await _one(stub, prompt, max_new, 0, timeout_s, alone)
        results = []
        for mode, fixed_k in (("speculative", None), ("target-only", 0)):
            for streams in levels:
                level = Level(mode, streams)

                async def stream(s: int) -> None:
                    for r in range(requests_per_stream):
                        idx = (s + r * streams) % len(prompts)
                        level.requests += 1
                        ids = await _one(stub, prompts[idx], max_new, fixed_k, timeout_s, level)
                        if ids is not None and ids != references[idx]:
                            level.mismatches += 1
                started = time.perf_counter()
                await asyncio.gather(*(stream(s) for s in range(streams)))
                level.wall_s = time.perf_counter() - started
                print(json.dumps(level.summary()), flush=True)
                results.append(level)
    return results, references


def markdown(levels: list[Level]) -> str:
    rows = ["| mode | streams | tok/s | x one stream | ITL p50 / p99 ms | TTFT p50 / p99 ms | acceptance | mean k | "
            "guard: rounds off | differs from alone | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {lv.mode: lv.summary()["tokens_per_s"] for lv in levels if lv.streams == 1}
    for lv in levels:
        s = lv.summary()
        ratio = s["tokens_per_s"] / base[lv.mode] if base.get(lv.mode) else 0.0
        rows.append(f"| {lv.mode} | {lv.streams} | {s['tokens_per_s']:.2f} | {ratio:.2f}x | "
                    f"{s['itl_p50_ms']:.0f} / {s['itl_p99_ms']:.0f} | {s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | "
                    f"{s['acceptance'] if s['acceptance'] is not None else '-'} | {s['mean_k']} | "
                    f"{s['guard_off_share']:.0%} | "
                    f"{lv.mismatches}/{lv.requests} | "
                    f"{sum(lv.errors.values())} |")
    spec = {lv.streams: lv.summary()["tokens_per_s"] for lv in levels if lv.mode == "speculative"}
    plain = {lv.streams: lv.summary()["tokens_per_s"] for lv in levels if lv.mode == "target-only"}
    rows.append("\nspeculative / target-only at the same load: " + ", ".join(
        f"{n} streams {spec[n] / plain[n]:.2f}x" for n in spec if plain.get(n)))
    return "\n".join(rows)


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("speculative", "o-"), ("target-only", "s--")):
        pts = [lv for lv in levels if lv.mode == mode]
        left.plot([lv.streams for lv in pts], [lv.summary()["tokens_per_s"] for lv in pts], style, label=mode)
        right.plot([lv.streams for lv in pts], [lv.summary()["itl_p99_ms"] for lv in pts], style, label=mode)
    left.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="throughput")
    right.set(xlabel="concurrent streams", ylabel="p99 inter-token latency (ms)", title="latency")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec loadtest --sweep", description=__doc__)
    parser.add_argument("--sweep", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--address", help="an orchestrator to test (default: start the pair locally)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--max-batch 1'")
    parser.add_argument("--config", help="orchestrator [speculation] TOML (default for the embedded pair: "
                        "configs/embedded-pair-cpu.toml)")
    parser.add_argument("--target-cpus", help="pin the target worker to these CPUs (taskset list), e.g. 0")
    parser.add_argument("--draft-cpus", help="pin the draft worker to these CPUs, e.g. 1: two devices emulated")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "loadtest"))
    args = parser.parse_args(argv)

    from specdec.tokenizers import load_tokenizer
    from specdec.tools.bench import describe_machine
    from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
    levels = [int(n) for n in args.sweep.split(",")]
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True)
               for line in open(args.prompts) if line.strip()][: max(levels)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def run(address: str) -> tuple[list[Level], dict[int, list[int]]]:
        return asyncio.run(sweep(address, prompts, levels, args.requests_per_stream, args.max_new_tokens,
                                 args.timeout_s))
    if args.address:
        results, _ = run(args.address)
    else:
        default_pair = (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT)
        config_file = args.config or (str(DEFAULT_PAIR_CONFIG) if default_pair else None)
        config = ["--config", config_file] if config_file else []
        orch_args = ["--log-level", "WARNING", "--max-k", "8", "--max-concurrent", str(max(levels) * 2)] + config
        cpu_sets = {role: cpus for role, cpus in (("target", args.target_cpus), ("draft", args.draft_cpus)) if cpus}
        threads = 1 if cpu_sets else 0  # pinned to one CPU each: one torch thread, no oversubscription
        with local_services(args.target, args.draft, threads, orch_args, worker_args=args.worker_args.split(),
                            cpu_sets=cpu_sets) as address:
            results, _ = run(address)
    machine = describe_machine()
    command = "specdec loadtest " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    report = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
              "duration_s": round(time.time() - started, 1), "machine": machine, "target": args.target,
              "draft": args.draft, "max_new_tokens": args.max_new_tokens,
              "requests_per_stream": args.requests_per_stream, "worker_args": args.worker_args,
              "cpu_sets": {"target": args.target_cpus, "draft": args.draft_cpus},
              "levels": [lv.summary() for lv in results], "raw": [asdict(lv) for lv in results]}
    (out / "loadtest.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "loadtest.png")
    md = (f"`{command}` ({report['started']} UTC, {report['duration_s']:.0f} s). Machine: {machine['cpu']} "
          f"({machine['cpus']} cpus; flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}.\n\n"
          + markdown(results) + "\n\n![loadtest](loadtest.png)\n")
    (out / "loadtest.md").write_text(md)
    print(md)
