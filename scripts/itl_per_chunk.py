"""Inter-token latency per chunk, recomputed from a loadtest.json written before 2026-11-28.

Until then `specdec loadtest --sweep` reported ITL per token: each message's gap divided by the tokens
it carried, once per token. A speculative round of n tokens arrives as one message, so its gap counted
as n gaps of a n-th of it, and the p99 understated what a client waits. The raw per-token values
(`raw[].itl_ms`) hold each message's gap n times in a row, so runs of equal values give the messages
back (gap = value x run length; two adjacent messages with bit-equal gaps would merge, which the
check against the recorded message count would show).

    python scripts/itl_per_chunk.py docs/bench/.../loadtest.json [...]
"""
from __future__ import annotations

import json
import sys
from itertools import groupby

from specdec.tools.loadtest import percentile


def chunk_gaps(per_token: list[float]) -> list[float]:
    return [value * len(list(run)) for value, run in groupby(per_token)]


def main(paths: list[str]) -> None:
    for path in paths:
        report = json.load(open(path))
        print(f"\n{path}\n| mode | streams | repeat | ITL p50 / p99 ms, per token (as reported) | per chunk | "
              "messages: rebuilt / recorded |\n|---|---|---|---|---|---|")
        p99: dict[tuple[str, int, int], float] = {}
        for level in report["raw"]:
            gaps = chunk_gaps(level["itl_ms"])
            recorded = len(level["arrivals"]) - level["requests"]  # every message after each request's first
            key = (level["mode"], level["streams"], level["repeat"])
            p99[key] = percentile(gaps, 0.99)
            print(f"| {level['mode']} | {level['streams']} | {level['repeat'] + 1} | "
                  f"{percentile(level['itl_ms'], 0.5):.0f} / {percentile(level['itl_ms'], 0.99):.0f} | "
                  f"{percentile(gaps, 0.5):.0f} / {p99[key]:.0f} | {len(gaps)} / {recorded} |")
        most = max(streams for _, streams, _ in p99)
        for (mode, streams, repeat), value in sorted(p99.items()):
            alone = p99.get((mode, 1, repeat))
            if streams == most and alone:
                print(f"- {mode}, repeat {repeat + 1}: p99 per chunk at {most} streams / 1 stream = "
                      f"{value:.0f} / {alone:.0f} = {value / alone:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
