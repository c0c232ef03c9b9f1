"""serve-draft: python -m draft_worker --model embedded:qwen2.5-coder-0.5b --port 50052"""
from __future__ import annotations

import argparse
import asyncio
import logging

from draft_worker.servicer import SERVICE_NAME, DraftServicer, register
from specdec.embedded import DEFAULT_DRAFT
from specdec.worker_server import add_worker_args, serve_worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec serve-draft", description="Run the draft worker.")
    add_worker_args(parser, DEFAULT_DRAFT)
    parser.add_argument("--max-q-entries", type=int, default=256,
                        help="max entries of the sparse draft distribution sent per position")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s draft %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_worker(args, "draft", lambda core, limits: DraftServicer(core, args.max_q_entries, limits),
                             register, SERVICE_NAME))


if __name__ == "__main__":
    main()
