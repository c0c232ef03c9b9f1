"""Orchestrator CPU per generated token for detokenising and stop strings, at growing output lengths.

Usage: python scripts/detok_cost.py [tokenizer ref]  (default: the embedded target's tokenizer)
Replays the README as model output, 3 tokens a round, with and without a stop string, and checks
the text against one decode of the whole output.
"""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

from orchestrator.text import TextAssembler
from specdec import embedded
from specdec.tokenizers import load_tokenizer


def main() -> None:
    tok = load_tokenizer(sys.argv[1] if len(sys.argv) > 1 else embedded.DEFAULT_TARGET)
    ids = tok.encode(Path(__file__).resolve().parents[1].joinpath("README.md").read_text() * 4)
    print(f"{platform.processor() or platform.machine()}; tokens available: {len(ids)}")
    for n in (500, 2000, 8000):
        for stop in ([], ["\n\n\n\n###END"]):
            asm = TextAssembler(tok.decode, stop)
            start = time.perf_counter()
            for i in range(0, n, 3):
                asm.add(ids[i:i + 3])
            asm.flush()
            seconds = time.perf_counter() - start
            assert asm.emitted == tok.decode(ids[:len(asm.ids)])
            print(f"{n:5d} tokens, stop string: {'yes' if stop else 'no ':3s}  {seconds * 1e3:7.1f} ms, "
                  f"{seconds / n * 1e6:6.1f} us a token")


if __name__ == "__main__":
    main()
