"""serve-orchestrator: python -m orchestrator --draft HOST:PORT --target HOST:PORT"""
from __future__ import annotations

import argparse
import asyncio
import logging

from orchestrator.app import add_args, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec serve-orchestrator", description="Run the orchestrator.")
    add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s orchestrator %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
