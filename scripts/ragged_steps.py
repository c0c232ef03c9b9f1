"""What a batched decode step costs per session: the ragged forward (specdec/ragged.py) over B sessions
of one new row each, against one session alone.

    python scripts/ragged_steps.py --model tiny:preset=qwen2.5-1.5b,seed=1 --device cuda [--sessions 1,2,4,8]

The linear layers run once over all rows; the cache update and attention run per session. Where a
step is launch-bound (a GPU in eager mode), the per-session part is what grows with B: step(B) /
step(1) says how far batching is from free. On the H200 (2026-11-27, loadtest ITL) a step of 8
sessions cost 3.5x one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.models import crop_cache, load_model, new_cache, resolve_dtype, synchronize
from specdec.ragged import RaggedForward, RaggedItem


@torch.inference_mode()
def step_ms(forward: RaggedForward, model: torch.nn.Module, sessions: int, context: int, reps: int,
            device: torch.device) -> float:
    caches = []
    for i in range(sessions):  # contexts a little apart: ragged, as in service
        cache = new_cache(model)
        model(input_ids=torch.randint(0, 250, (1, context + 8 * i), device=device), past_key_values=cache, use_cache=True)
        caches.append(cache)
    lengths = [c.get_seq_length() for c in caches]
    times = []
    for _ in range(reps + 2):  # two warm-ups
        items = [RaggedItem(c, [5], 1) for c in caches]
        synchronize(device)
        start = time.perf_counter()
        forward(items)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        for cache, length in zip(caches, lengths):
            crop_cache(cache, length)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (the target's rule) | float32 | bfloat16")
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "target", args.device)
    loaded = load_model(args.model, dtype, args.device)
    device = next(loaded.model.parameters()).device
    forward = RaggedForward(loaded.model)
    counts = [int(n) for n in args.sessions.split(",")]
    step_ms(forward, loaded.model, max(counts), args.context, 2, device)  # warms every shape's kernels
    rows = []
    for sessions in counts:
        rows.append({"sessions": sessions, "step_ms": round(step_ms(forward, loaded.model, sessions, args.context,
                                                                   args.reps, device), 3)})
    alone = rows[0]["step_ms"]
    print(f"{args.model} on {device} ({dtype}), context {args.context}, median of {args.reps}")
    print("| sessions | step ms | x one session | ms per added session |\n|---|---|---|---|")
    for row in rows:
        added = (row["step_ms"] - alone) / (row["sessions"] - rows[0]["sessions"]) if row is not rows[0] else 0.0
        print(f"| {row['sessions']} | {row['step_ms']:.2f} | {row['step_ms'] / alone:.2f}x | {added:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": str(device), "dtype": str(dtype), "context": args.context,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
