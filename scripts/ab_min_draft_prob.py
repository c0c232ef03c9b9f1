"""Interleaved A/B of min_draft_prob values on the embedded pair (cost policy), greedy and sampled.

python scripts/ab_min_draft_prob.py [--values 0 0.6] [--prompts 6] [--max-new-tokens 48]
Each prompt runs every value back to back, alternating the order, in one set of services."""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import grpc

from specdec.tools.client import build_request
from specdec.tools.demo import DEFAULT_PAIR_CONFIG, local_services
from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.models import load_tokenizer
from specdec.v1 import orchestrator_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


async def run(address: str, prompts: list[list[int]], values: list[float], max_new: int) -> None:
    results: dict[tuple[str, float], list[float]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        await stub.Generate(build_request(prompt_ids=prompts[0], max_new_tokens=4), timeout=600)  # warm-up
        for mode in ("greedy", "sampled"):
            for i, prompt in enumerate(prompts):
                for value in (values if i % 2 == 0 else list(reversed(values))):
                    req = build_request(prompt_ids=prompt, max_new_tokens=max_new, seed=i, policy="cost",
                                        temperature=0.7 if mode == "sampled" else 0.0)
                    req.speculation.min_draft_prob = value
                    reply = await stub.Generate(req, timeout=600)
                    results.setdefault((mode, value), []).append(reply.stats.tokens_per_second)
    for (mode, value), tps in sorted(results.items()):
        print(f"{mode:8s} min_draft_prob={value:<4g} median {statistics.median(tps):.2f} tok/s  "
              f"{[round(x, 2) for x in tps]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--values", type=float, nargs="+", default=[0.0, 0.6])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    tok = load_tokenizer(DEFAULT_TARGET)
    lines = [json.loads(line) for line in open(ROOT / "bench" / "prompts.jsonl") if line.strip()]
    prompts = [tok.apply_chat_template(p["messages"]) for p in lines[:args.prompts]]
    with local_services(DEFAULT_TARGET, DEFAULT_DRAFT, 0,
                        ["--log-level", "WARNING", "--config", str(DEFAULT_PAIR_CONFIG)]) as address:
        asyncio.run(run(address, prompts, args.values, args.max_new_tokens))


if __name__ == "__main__":
    main()
