"""`specdec loadtest --sweep 1,2,4,8`: concurrent streams against the pair, speculation vs target-only.

For each concurrency level N, N closed-loop streams each run R_N greedy requests one after another
(the bench's prompts, chat-templated; R_N is the smallest count of at least `--requests-per-stream`
for which N x R_N is a multiple of the prompt count, so that every level runs each prompt equally
often and "x one stream" compares the same mix of prompts), with the server's default k policy and with
k = 0 (target-only) through the same services. With `--repeats R` the two modes alternate R times per
level in ABBA order (spec, target-only, target-only, spec, ...), so a drift of the machine's speed over
the run falls on both modes alike; the report gives each repeat's ratio and their spread. The order
also flips from one level to the next (AB at 1 stream, BA at 2, ...), so that with one repeat neither
mode always takes the first block after a change of load. The reference runs (each prompt alone,
target-only) and one uncounted speculative request come first, so neither worker's warm-up falls in
a measured block (until 2026-11-28 the draft's fell in the first one, speculative at 1 stream). Reports per
level: aggregate tok/s, p50 and p99 inter-token latency per chunk (the gap a client waits between two
messages of a stream; a speculative round's tokens come in one message, so its gap counts once, as
vLLM's benchmark counts it), beside it the same gaps spread over the tokens each chunk carried (per
token: before 2026-11-28 the only ITL reported, which understates a speculative tail), p50 time per
output token (TPOT: a request's time after its first message over the tokens after it), p50 and
p99 time to first token, and how many outputs differ from the same prompt run alone (identity under batching).
Throughput is given twice: over the whole block (until the last stream's last request ends) and
while all N streams were busy (until the first stream ran out of requests). A closed loop with a
fixed request count ends in a drain, in which fewer than N streams run; speculation, whose requests
vary in duration, drains longer than target-only, whose requests under one batch all take the same
steps. The busy figure compares the two at the same load. Bounded: a fixed number of requests, each
with a deadline; it stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.tools.loadreport import Level, epochs_markdown, markdown, plot
from specdec.tools.loadtest import make_request

ROOT = Path(__file__).resolve().parents[2]


async def _one(stub: Any, prompt_ids: list[int], max_new: int, fixed_k: int | None, timeout_s: float,
               level: Level) -> list[int] | None:
    import grpc
    req = make_request(prompt_ids, max_new, fixed_k)
    ids: list[int] = []
    arrivals: list[tuple[float, int]] = []
    start = last = first = time.perf_counter()
    first_tokens = 0
    try:
        async for chunk in stub.GenerateStream(req, timeout=timeout_s):
            now = time.perf_counter()
            if chunk.token_ids:
                arrivals.append((now - level.started, len(chunk.token_ids)))
                if not ids:
                    level.ttft_ms.append((now - start) * 1000.0)
                    first, first_tokens = now, len(chunk.token_ids)
                else:
                    level.chunk_gap_ms.append((now - last) * 1000.0)
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
    if len(ids) > first_tokens:
        level.tpot_ms.append((last - first) * 1000.0 / (len(ids) - first_tokens))
    level.tokens += len(ids)
    level.arrivals.extend(arrivals)  # a failed request's tokens count in neither figure
    return ids


def balanced_requests_per_stream(levels: list[int], prompts: int, minimum: int) -> dict[int, int]:
    """Per level N: the smallest R >= minimum (and >= 1) with N x R a multiple of the prompt count, so
    that the level's N x R requests run each prompt equally often (prompt_plan). For 8 prompts, at
    least 2 requests per stream and levels 1, 2, 4, 8: 8, 4, 2, 2."""
    out = {}
    for streams in levels:
        step = prompts // math.gcd(streams, prompts)  # R must be a multiple of this
        out[streams] = step * max(1, math.ceil(max(1, minimum) / step))
    return out


def prompt_plan(streams: int, requests_per_stream: int, prompts: int) -> list[list[int]]:
    """The prompt index of each stream's requests: the level's N x R request slots take the prompts
    round-robin, each stream a run of R consecutive slots. Each stream gets a mix and the streams
    together cover them all (with as many streams as prompts, slot s + r * streams pinned each stream
    to one prompt, and its duration to that prompt's acceptance; runs 15-16 used s + r, which at 4
    streams x 2 requests covered only 5 of the 8 prompts). Where N x R is a multiple of the prompt
    count, every prompt runs N x R / prompts times."""
    return [[(s * requests_per_stream + r) % prompts for r in range(requests_per_stream)] for s in range(streams)]


async def sweep(address: str, prompts: list[list[int]], levels: list[int], requests_per_stream: int | Mapping[int, int],
                max_new: int, timeout_s: float, repeats: int = 1) -> tuple[list[Level], dict[int, list[int]]]:
    """Run the sweep against the orchestrator at `address` (see sweep_on)."""
    import grpc

    from specdec.v1 import orchestrator_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        return await sweep_on(orchestrator_pb2_grpc.OrchestratorStub(channel), prompts, levels, requests_per_stream,
                              max_new, timeout_s, repeats)


def block_order(level_index: int, repeat: int) -> tuple[tuple[str, int | None], ...]:
    """The two modes' blocks (name, fixed k) in the order they run: ABBA over the repeats of a
    level, and flipped at every other level."""
    modes: tuple[tuple[str, int | None], ...] = (("speculative", None), ("target-only", 0))
    return modes if (level_index + repeat) % 2 == 0 else modes[::-1]


async def sweep_on(stub: Any, prompts: list[list[int]], levels: list[int],
                   requests_per_stream: int | Mapping[int, int], max_new: int, timeout_s: float,
                   repeats: int = 1) -> tuple[list[Level], dict[int, list[int]]]:
    """requests_per_stream: the same count at every level, or one per level (main passes
    balanced_requests_per_stream, so that each level runs every prompt equally often)."""
    per_level = (dict(requests_per_stream) if isinstance(requests_per_stream, Mapping)
                 else {streams: requests_per_stream for streams in levels})
    alone = Level("reference", 1)
    references = {}
    for i, prompt in enumerate(prompts):  # each prompt alone, target-only: what identity means
        references[i] = await _one(stub, prompt, max_new, 0, timeout_s, alone)
    # One speculative request, not counted: the references warmed the target only, and the draft's
    # first use (its warm-up) fell into the first speculative block at 1 stream, the denominator of
    # every "x one stream" of speculation.
    await _one(stub, prompts[0], max_new, None, timeout_s, Level("warm-up", 1))
    results = []
    for level_index, streams in enumerate(levels):
        plan = prompt_plan(streams, per_level[streams], len(prompts))
        for repeat in range(repeats):
            for mode, fixed_k in block_order(level_index, repeat):
                level = Level(mode, streams, repeat, requests_per_stream=per_level[streams])

                async def stream(s: int, level: Level = level, fixed_k: int | None = fixed_k) -> None:
                    for idx in plan[s]:
                        level.requests += 1
                        level.prompts_run.append(idx)
                        ids = await _one(stub, prompts[idx], max_new, fixed_k, timeout_s, level)
                        if ids is not None and ids != references[idx]:
                            level.mismatches += 1
                    level.stream_ends.append(time.perf_counter() - level.started)
                level.started = time.perf_counter()
                await asyncio.gather(*(stream(s) for s in range(streams)))
                level.wall_s = time.perf_counter() - level.started
                print(json.dumps(level.summary()), flush=True)
                results.append(level)
    return results, references


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec loadtest --sweep", description=__doc__)
    parser.add_argument("--sweep", default="1,2,4,8", help="concurrency levels")
    parser.add_argument("--address", help="an orchestrator to test (default: start the pair locally)")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="at least this many per stream; a level runs more where needed so that its streams "
                             "run every prompt equally often (1, 2, 4, 8 streams on 8 prompts: 8, 4, 2, 2)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the two modes this many times per level (ABBA), to measure the spread")
    parser.add_argument("--trace-file", help="the orchestrator appends one JSON line per round here")
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
    per_stream = balanced_requests_per_stream(levels, len(prompts), args.requests_per_stream)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def run(address: str) -> tuple[list[Level], dict[int, list[int]]]:
        return asyncio.run(sweep(address, prompts, levels, per_stream, args.max_new_tokens, args.timeout_s,
                                 args.repeats))
    if args.address:
        results, _ = run(args.address)
    else:
        default_pair = (args.target, args.draft) == (DEFAULT_TARGET, DEFAULT_DRAFT)
        config_file = args.config or (str(DEFAULT_PAIR_CONFIG) if default_pair else None)
        config = ["--config", config_file] if config_file else []
        # INFO: the pair guard's flips back to speculating and its load restarts reach the log.
        orch_args = ["--log-level", "INFO", "--max-k", "8", "--max-concurrent", str(max(levels) * 2)] + config
        if args.trace_file:
            Path(args.trace_file).unlink(missing_ok=True)  # the orchestrator appends: start from this run's rounds
            orch_args += ["--trace-file", str(Path(args.trace_file).resolve())]
        cpu_sets = {role: cpus for role, cpus in (("target", args.target_cpus), ("draft", args.draft_cpus)) if cpus}
        threads = 1 if cpu_sets else 0  # pinned to one CPU each: one torch thread, no oversubscription
        with local_services(args.target, args.draft, threads, orch_args, worker_args=args.worker_args.split(),
                            cpu_sets=cpu_sets, logs_dir=out / "logs") as address:
            results, _ = run(address)
        if args.trace_file:
            from orchestrator.traces import compress
            compress(args.trace_file)  # the orchestrator has stopped: its plain JSONL becomes .gz if so named
    machine = describe_machine()
    command = "specdec loadtest " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    report = {"command": command, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
              "duration_s": round(time.time() - started, 1), "machine": machine, "target": args.target,
              "draft": args.draft, "max_new_tokens": args.max_new_tokens,
              "prompts": len(prompts), "min_requests_per_stream": args.requests_per_stream,
              "requests_per_stream": {str(n): r for n, r in per_stream.items()},
              "repeats": args.repeats, "worker_args": args.worker_args,
              "cpu_sets": {"target": args.target_cpus, "draft": args.draft_cpus},
              "levels": [lv.summary() for lv in results], "raw": [asdict(lv) for lv in results]}
    (out / "loadtest.json").write_text(json.dumps(report, indent=1))
    plot(results, out / "loadtest.png")
    md = (f"`{command}` ({report['started']} UTC, {report['duration_s']:.0f} s). Machine: {machine['cpu']} "
          f"({machine['cpus']} cpus; flags {machine['flags']}); {machine['gpu']}; torch {machine['torch']}.\n\n"
          f"Requests per stream by level: {', '.join(f'{n} streams {r}' for n, r in per_stream.items())}: each "
          f"level runs each of the {len(prompts)} prompts equally often.\n\n"
          + markdown(results) + "\n\n![loadtest](loadtest.png)\n")
    (out / "loadtest.md").write_text(md)
    print(md)
    if args.trace_file and Path(args.trace_file).exists():
        from orchestrator.traces import load_traces
        epochs = ("Rounds by policy and pair-guard mode, in the order they ended (`fixed`: the target-only "
                  "blocks and the references; guard `-`: not guarded), from " + args.trace_file + ":\n\n"
                  + epochs_markdown(load_traces(args.trace_file)) + "\n")
        (out / "epochs.md").write_text(epochs)
        print(epochs)
