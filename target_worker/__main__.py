"""serve-target: python -m target_worker --model embedded:qwen2.5-coder-1.5b --port 50053"""
from __future__ import annotations

import argparse
import asyncio
import logging

from specdec.embedded import DEFAULT_TARGET
from specdec.worker_server import add_worker_args, serve_worker
from target_worker.servicer import SERVICE_NAME, TargetServicer, register


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec serve-target", description="Run the target worker.")
    add_worker_args(parser, DEFAULT_TARGET)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s target %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_worker(args, "target", TargetServicer, register, SERVICE_NAME))


if __name__ == "__main__":
    main()
