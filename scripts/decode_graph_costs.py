"""The decode graph in a worker core, on a GPU: does it capture and pass the startup check, what a
one-token step costs eager and replayed, and whether greedy decoding through it follows the eager steps.

    python scripts/decode_graph_costs.py --models "tiny:preset=qwen2.5-1.5b,seed=1,layers=24" --out decode_graph.json

For each model: a WorkerCore on the device (as a worker builds it), enable_decode_graph(capture=True),
then one-token steps at each context through WorkerCore.feed, eager (no decoder) and on the graph, and
two greedy continuations of one random prompt, one per path, compared token by token (random
weights have tiny logit margins, so bf16 near-ties may part them: the first index where they differ
is reported, not asserted).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from specdec.models import configure_attention, load_model, resolve_dtype, synchronize
from specdec.worker_core import WorkerCore


def step_times(core: WorkerCore, context: int, reps: int, graph: bool) -> float:
    decoder = core.decode_graph
    core.decode_graph = decoder if graph else None
    try:
        gen = torch.Generator().manual_seed(context)
        session = core.empty_session()
        core.feed(session, torch.randint(0, core.vocab_size, (context,), generator=gen).tolist(), logits_rows=1)
        times = []
        for _ in range(reps + 2):
            token = int(torch.randint(0, core.vocab_size, (1,), generator=gen))
            synchronize(core.device)
            start = time.perf_counter()
            core.feed(session, [token], logits_rows=1)
            synchronize(core.device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[2:])  # the first steps warm the path (and copy the prefix in)
    finally:
        core.decode_graph = decoder


def greedy(core: WorkerCore, prompt: list[int], steps: int, graph: bool) -> list[int]:
    decoder = core.decode_graph
    core.decode_graph = decoder if graph else None
    try:
        session = core.empty_session()
        logits = core.feed(session, prompt, logits_rows=1)
        out = []
        for _ in range(steps):
            token = int(logits[-1].argmax())
            out.append(token)
            logits = core.feed(session, [token], logits_rows=1)
        return out
    finally:
        core.decode_graph = decoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="model refs, separated by |")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--greedy-steps", type=int, default=48)
    parser.add_argument("--buffer-lengths", default="512,4096", help="bare decoders timed at these buffer lengths")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    configure_attention(device)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                  "torch": torch.__version__, "models": {}}
    for ref in filter(None, (r.strip() for r in args.models.split("|"))):
        dtype = resolve_dtype(args.dtype, "draft", device)
        core = WorkerCore(load_model(ref, dtype, str(device)), "draft")
        started = time.perf_counter()
        core.enable_decode_graph(capture=device.type == "cuda", max_len=args.max_len)
        entry: dict[str, object] = {"dtype": str(dtype), "decode_path": core.decode_path,
                                    "enable_s": round(time.perf_counter() - started, 2)}
        if core.decode_graph is not None:
            for context in (int(c) for c in args.contexts.split(",")):
                eager = step_times(core, context, args.reps, graph=False)
                replayed = step_times(core, context, args.reps, graph=True)
                entry[f"step_ms@{context}"] = {"eager": round(eager, 3), "graph": round(replayed, 3),
                                               "graph/eager": round(replayed / eager, 3)}
            # The buffer's length sets what each step's attention spans (transformers expands the KV
            # heads under a mask), and the steps of a batch take turns on the one buffer.
            from specdec.decode_graph import GraphDecoder, step_ms

            entry["turns_ms@128"] = round(step_ms(core.decode_graph, core.empty_session, core.vocab_size, 128, args.reps,
                                                  sessions=2), 3)
            for length in (int(n) for n in args.buffer_lengths.split(",") if n):
                bare = GraphDecoder(core.model, length, capture=device.type == "cuda")
                entry[f"bare_step_ms@128,buffer={length}"] = round(step_ms(bare, core.empty_session, core.vocab_size, 128,
                                                                           args.reps), 3)
                del bare
            prompt = torch.randint(0, core.vocab_size // 2, (24,), generator=torch.Generator().manual_seed(7)).tolist()
            a = greedy(core, prompt, args.greedy_steps, graph=False)
            b = greedy(core, prompt, args.greedy_steps, graph=True)
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            entry["greedy"] = {"steps": args.greedy_steps, "identical": a == b, "first_difference": first}
        results["models"][ref] = entry  # type: ignore[index]
        print(json.dumps({ref: entry}), flush=True)
        del core
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    failed = [ref for ref, e in results["models"].items() if not str(e["decode_path"]).startswith("CUDA graph")]  # type: ignore[union-attr]
    if device.type == "cuda" and failed:
        raise SystemExit(f"no decode graph for {', '.join(failed)}")


if __name__ == "__main__":
    main()
