"""What a batched decode step costs per session: the ragged forward (specdec/ragged.py) over B sessions
of one new row each, against one session alone.

    python scripts/ragged_steps.py --model tiny:preset=qwen2.5-1.5b,seed=1 --device cuda [--sessions 1,2,4,8]

The linear layers run once over all rows; the cache update runs per session, and attention per
session or packed into one varlen call per layer (specdec.ragged, `--attention`: each path listed is
measured in this one process, and their logits compared on the same steps). Where a step is
launch-bound (a GPU in eager mode), the per-session part is what grows with B: step(B) / step(1)
says how far batching is from free. On the H200 (2026-11-28, per-session attention) a step of 8
sessions cost 2.07x one.
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
            device: torch.device) -> tuple[float, list[torch.Tensor]]:
    """Median ms of a step of `sessions` one-row sessions, and the first step's logits."""
    caches = []
    generator = torch.Generator().manual_seed(sessions)  # the same contexts for every attention path
    for i in range(sessions):  # contexts a little apart: ragged, as in service
        cache = new_cache(model)
        prompt = torch.randint(0, 250, (1, context + 8 * i), generator=generator).to(device)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        caches.append(cache)
    lengths = [c.get_seq_length() for c in caches]
    times, first = [], []
    for _ in range(reps + 2):  # two warm-ups
        items = [RaggedItem(c, [5], 1) for c in caches]
        synchronize(device)
        start = time.perf_counter()
        logits = forward(items)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        first = first or logits
        for cache, length in zip(caches, lengths):
            crop_cache(cache, length)
    return statistics.median(times[2:]), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto (the target's rule) | float32 | bfloat16")
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--attention", default="auto,per-session",
                        help="attention paths to measure, comma-separated: auto | per-session | packed")
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
    counts = [int(n) for n in args.sessions.split(",")]
    paths: dict[str, list[dict]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for requested in args.attention.split(","):
        forward = RaggedForward(loaded.model, attention=requested)
        if forward.attention_path in paths:
            continue  # "auto" chose a path already measured
        step_ms(forward, loaded.model, max(counts), args.context, 2, device)  # warms every shape's kernels
        rows = []
        for sessions in counts:
            ms, first = step_ms(forward, loaded.model, sessions, args.context, args.reps, device)
            rows.append({"sessions": sessions, "step_ms": round(ms, 3)})
        logits[forward.attention_path] = first  # of the largest batch
        paths[forward.attention_path] = rows
        alone = rows[0]["step_ms"]
        print(f"{args.model} on {device} ({dtype}), attention {forward.attention_path}, context {args.context}, "
              f"median of {args.reps}")
        print("| sessions | step ms | x one session | ms per added session |\n|---|---|---|---|")
        for row in rows:
            added = (row["step_ms"] - alone) / (row["sessions"] - rows[0]["sessions"]) if row is not rows[0] else 0.0
            print(f"| {row['sessions']} | {row['step_ms']:.2f} | {row['step_ms'] / alone:.2f}x | {added:.2f} |")
    comparison = None
    if len(logits) == 2:  # the same steps through both paths: how far apart, and do the greedy picks agree
        a, b = logits.values()
        comparison = {"max_abs_logit_diff": max((x - y).abs().max().item() for x, y in zip(a, b)),
                      "argmax_agree": sum(int(x.argmax() == y.argmax()) for x, y in zip(a, b)), "sessions": len(a)}
        print(f"packed vs per-session, {len(a)} sessions: max |logit difference| "
              f"{comparison['max_abs_logit_diff']:.4g}, greedy picks agree {comparison['argmax_agree']}/{len(a)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": str(device), "dtype": str(dtype), "context": args.context,
                       "paths": paths, "rows": next(iter(paths.values())), "comparison": comparison}, f, indent=1)


if __name__ == "__main__":
    main()
