"""Load blocks in a chosen order, one pair of services: what a mode costs right after another.

`specdec loadtest --sweep` alternates speculation and target-only in ABBA order. This runs any
sequence of blocks at one concurrency, each block N closed-loop streams of `--requests-per-stream`
greedy requests (the bench's prompts, as the sweep takes them), with a round trace, and prints each
block's tok/s and what its steady rounds did (mean target batch, round / draft / verify ms, rounds
the pair guard ran target-only). Blocks: `off` (k = 0, target-only), `k<N>` (fixed k = N), `spec`
(the server's policy, guarded).

    python scripts/load_blocks.py --streams 8 --plan off,k4,off,k4,spec,off,spec --out DIR [--shared-compute off]

Bounded: a fixed number of requests, each with a deadline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdec.tools.loadreport import Level  # noqa: E402
from specdec.tools.loadsweep import _one  # noqa: E402


def block_k(name: str) -> int | None:
    if name == "off":
        return 0
    if name == "spec":
        return None
    if name.startswith("k") and name[1:].isdigit():
        return int(name[1:])
    raise SystemExit(f"unknown block {name!r}: off, spec or k<N>")


async def run_blocks(address: str, prompts: list[list[int]], plan: list[str], streams: int, requests: int,
                     max_new: int) -> list[dict]:
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc
    blocks = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for name in plan:
            fixed_k = block_k(name)
            level = Level(name, streams)
            level.started, started = time.perf_counter(), time.time()

            async def stream(s: int, level: Level = level, fixed_k: int | None = fixed_k) -> None:
                for r in range(requests):
                    await _one(stub, prompts[(s * requests + r) % len(prompts)], max_new, fixed_k, 600.0, level)
            await asyncio.gather(*(stream(s) for s in range(streams)))
            ended = time.time()
            blocks.append({"block": name, "start": started, "end": ended, "tokens": level.tokens,
                           "tokens_per_s": round(level.tokens / (ended - started), 2), "errors": level.errors})
            print(json.dumps(blocks[-1]), flush=True)
    return blocks


def summarise(blocks: list[dict], trace: Path) -> str:
    rounds = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    lines = ["| block | tok/s | rounds | mean target batch | steady k > 0 rounds: round / draft / verify ms (median) "
             "| their target batch | tokens per round | rounds the guard ran off |", "|---|---|---|---|---|---|---|---|"]
    for b in blocks:
        mine = [r for r in rounds if b["start"] <= r["ts"] <= b["end"]]  # a round ends before its tokens arrive
        drafting = [r for r in mine if r["k"] > 0 and r["target_prefilled"] <= 1 and r["draft_prefilled"] <= 2]

        def median(key: str) -> float:
            return statistics.median(r[key] for r in drafting) if drafting else 0.0
        lines.append(
            f"| {b['block']} | {b['tokens_per_s']} | {len(mine)} | "
            f"{statistics.mean(r['target_batch'] for r in mine) if mine else 0.0:.2f} | "
            + (f"{median('round_ms'):.0f} / {median('draft_ms'):.0f} / {median('verify_ms'):.0f} | "
               f"{statistics.mean(r['target_batch'] for r in drafting):.1f} | "
               f"{statistics.mean(r['emitted'] for r in drafting):.2f} | " if drafting else "- | - | - | ")
            + f"{sum(r['guard'] == 'off' for r in mine)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--plan", default="off,k4,off,k4,spec,off,spec")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--shared-compute", choices=("auto", "on", "off"), default="auto",
                        help="the workers' --shared-compute (auto: on, as both run unpinned)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from specdec.tokenizers import load_tokenizer
    from specdec.tools.bench import describe_machine
    from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
    plan = [name.strip() for name in args.plan.split(",") if name.strip()]
    for name in plan:
        block_k(name)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [tokenizer.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True)
               for line in open(ROOT / "bench" / "prompts.jsonl") if line.strip()][:8]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "rounds.jsonl"
    trace.unlink(missing_ok=True)
    orch = ["--log-level", "INFO", "--max-k", "8", "--max-concurrent", str(2 * args.streams),
            "--config", str(DEFAULT_PAIR_CONFIG), "--trace-file", str(trace.resolve())]
    shared = {"auto": None, "on": True, "off": False}[args.shared_compute]
    with local_services(DEFAULT_TARGET, DEFAULT_DRAFT, 0, orch, shared_compute=shared) as address:
        blocks = asyncio.run(run_blocks(address, prompts, plan, args.streams, args.requests_per_stream,
                                        args.max_new_tokens))
    machine = describe_machine()
    report = (f"`python scripts/load_blocks.py {' '.join(sys.argv[1:])}` "
              f"({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC). Machine: {machine['cpu']} "
              f"({machine['cpus']} cpus; flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}.\n\n"
              + summarise(blocks, trace) + "\n")
    (out / "blocks.json").write_text(json.dumps(blocks, indent=1))
    (out / "blocks.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
