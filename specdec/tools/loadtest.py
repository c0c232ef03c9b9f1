"""`specdec loadtest`: a bounded load test against an orchestrator (any address you run).

N concurrent streams for a fixed number of requests; greedy; every output is checked against a
target-only (k = 0) run of the same prompt. Reports errors by status code and p50/p99 latency.
Bounded in count and time: it stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc


@dataclass
class LoadReport:
    requests: int = 0
    ok: int = 0
    mismatches: int = 0
    errors: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    first_token_ms: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    # Speculation actually happened (summed from the streams' final stats).
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def summary(self) -> dict:
        return {
            "requests": self.requests, "ok": self.ok, "mismatches": self.mismatches,
            "errors": dict(self.errors), "p50_ms": round(percentile(self.latencies_ms, 0.5), 1),
            "p99_ms": round(percentile(self.latencies_ms, 0.99), 1),
            "ttft_p50_ms": round(percentile(self.first_token_ms, 0.5), 1),
            "mean_ms": round(statistics.fmean(self.latencies_ms), 1) if self.latencies_ms else 0.0,
            "tokens_per_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 2),
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values): the smallest value with at least a fraction q of
    the values at or below it, i.e. the ceil(q * n)-th smallest (p50 of [1, 2, 3, 4] is 2, p99 of
    100 values the 99th). q * n is rounded to 9 decimals first, so that 0.07 * 100 (7.000000000000001
    in floating point) picks the 7th value, not the 8th."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), 9))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def prompts_for(count: int, seed: int, vocab_hint: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_hint) for _ in range(rng.randint(4, 24))] for _ in range(count)]


def make_request(prompt: list[int], max_new_tokens: int, fixed_k: int | None) -> orchestrator_pb2.GenerateRequest:
    req = orchestrator_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.prompt_ids.ids.extend(prompt)
    if fixed_k is not None:
        req.speculation.fixed_k = fixed_k
    return req


async def run_load(address: str, concurrency: int, requests: int, max_new_tokens: int = 16,
                   distinct_prompts: int = 8, seed: int = 0, vocab_hint: int = 256, timeout_s: float = 60.0,
                   time_limit_s: float = 300.0, fixed_k: int | None = None) -> LoadReport:
    """`requests` streams, `concurrency` at a time, each checked against its prompt's target-only
    output; fixed_k pins the load requests' k (None: the server's policy)."""
    prompts = prompts_for(distinct_prompts, seed, vocab_hint)
    report = LoadReport()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        expected = {}
        for i, prompt in enumerate(prompts):  # target-only references, one at a time
            ref = await stub.Generate(make_request(prompt, max_new_tokens, 0), timeout=timeout_s)
            expected[i] = list(ref.token_ids)
        semaphore = asyncio.Semaphore(concurrency)
        stop_at = time.monotonic() + time_limit_s

        async def one(n: int) -> None:
            async with semaphore:
                if time.monotonic() > stop_at:
                    report.errors["SKIPPED_TIME_LIMIT"] += 1
                    return
                idx = n % len(prompts)
                start = time.perf_counter()
                ids: list[int] = []
                first = None
                try:
                    async for chunk in stub.GenerateStream(make_request(prompts[idx], max_new_tokens, fixed_k),
                                                           timeout=timeout_s):
                        if first is None and chunk.token_ids:
                            first = (time.perf_counter() - start) * 1000.0
                        ids.extend(chunk.token_ids)
                        if chunk.HasField("stats"):
                            report.draft_tokens += chunk.stats.draft_tokens
                            report.accepted_tokens += chunk.stats.accepted_tokens
                except grpc.aio.AioRpcError as err:
                    report.errors[err.code().name] += 1
                    return
                report.latencies_ms.append((time.perf_counter() - start) * 1000.0)
                report.first_token_ms.append(first or 0.0)
                report.tokens += len(ids)
                if ids == expected[idx]:
                    report.ok += 1
                else:
                    report.mismatches += 1

        started = time.perf_counter()
        report.requests = requests
        await asyncio.gather(*(one(n) for n in range(requests)))
        report.wall_s = time.perf_counter() - started
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--sweep" or a.startswith("--sweep=") for a in argv):
        from specdec.tools.loadsweep import main as sweep_main  # concurrency sweep, spec vs target-only
        sweep_main(argv)
        return
    parser = argparse.ArgumentParser(prog="specdec loadtest", description=__doc__,
                                     epilog="--sweep 1,2,4,8 [...]: concurrency sweep on the pair (specdec loadtest "
                                            "--sweep 1 --help for its options)")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--distinct-prompts", type=int, default=8)
    parser.add_argument("--vocab-hint", type=int, default=256, help="prompt ids are drawn below this")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    report = asyncio.run(run_load(args.address, args.concurrency, args.requests, args.max_new_tokens,
                                  args.distinct_prompts, vocab_hint=args.vocab_hint, timeout_s=args.timeout_s,
                                  time_limit_s=args.time_limit_s))
    print(json.dumps(report.summary(), indent=2))
    sys.exit(0 if report.ok == report.requests else 1)


if __name__ == "__main__":
    main()
