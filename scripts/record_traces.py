"""Record round traces on a model pair: python scripts/record_traces.py OUT.jsonl [--fixed-k 8]

Starts the three services locally with --trace-file, sends every prompt of bench/prompts.jsonl, and
stops. A high fixed k observes the most positions (see specdec/tools/simulator.py for why)."""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from specdec.tools.client import build_request
from specdec.tools.demo import local_services
from specdec.embedded import DEFAULT_DRAFT, DEFAULT_TARGET

ROOT = Path(__file__).resolve().parent.parent


async def send_all(address: str, prompts: list[dict], max_new_tokens: int, temperature: float) -> None:
    import grpc
    from specdec.v1 import orchestrator_pb2_grpc
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for i, p in enumerate(prompts):
            req = build_request(p["messages"][0]["content"], chat=True, max_new_tokens=max_new_tokens,
                                temperature=temperature, seed=i)
            reply = await stub.Generate(req, timeout=900)
            print(f"{p['id']}: {reply.stats.new_tokens} tokens, acceptance {reply.stats.acceptance_rate:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--fixed-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--limit", type=int, default=0)
    args = parser.parse_args()
    prompts = [json.loads(line) for line in open(args.prompts) if line.strip()]
    prompts = prompts[:args.limit] if args.limit else prompts
    out = str(Path(args.out).resolve())
    orch_args = ["--trace-file", out, "--policy", "fixed", "--fixed-k", str(args.fixed_k), "--max-k", "16",
                 "--log-level", "WARNING"]
    with local_services(args.target, args.draft, 0, orch_args) as address:
        asyncio.run(send_all(address, prompts, args.max_new_tokens, args.temperature))


if __name__ == "__main__":
    main()
