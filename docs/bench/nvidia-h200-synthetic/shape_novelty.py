"""The H200 netbench traces split by whether the target worker process had run the verify's attention
shape before: python docs/bench/nvidia-h200-synthetic/shape_novelty.py

Each trace file is one pair of worker processes (netbench restarts them per latency). A verify's
forward runs q = target_prefilled + drafted rows on a cache that ends at kv = position + drafted;
rounds are taken in time order, and prompt rounds (more than 2 rows prefilled) left out."""
import glob
import json
import statistics
from pathlib import Path

here = Path(__file__).parent
split: dict[str, list[float]] = {}
for path in sorted(glob.glob(str(here / "netbench*" / "rounds-*.jsonl"))):
    rounds = sorted((json.loads(line) for line in open(path)), key=lambda r: r["ts"])
    seen: set[tuple[int, int]] = set()
    for r in rounds:
        shape = (r["target_prefilled"] + r["drafted"], r["position"] + r["drafted"])
        new = shape not in seen
        seen.add(shape)
        if r["target_prefilled"] <= 2:
            key = f"{'k = 0' if r['k'] == 0 else 'k > 0'}, {'new' if new else 'repeated'} shape"
            split.setdefault(key, []).append(r["verify_ms"])
print("| verifies | rounds | median verify compute ms | over 50 ms |\n|---|---|---|---|")
for key in sorted(split):
    v = split[key]
    print(f"| {key} | {len(v)} | {statistics.median(v):.1f} | {100 * sum(x > 50 for x in v) / len(v):.1f} % |")
