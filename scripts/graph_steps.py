"""What CUDA-graph capture would take off an eager decode step: a projection for issues 16 and 17, not
a serving path (the workers run eager steps on per-session DynamicCaches).

    python scripts/graph_steps.py --models "tiny:preset=qwen2.5-1.5b,seed=1|tiny:...,layers=24" --device cuda

Per model, one-row decode steps at a fixed context, median of --reps:
- eager: the model's forward on a DynamicCache, each step cropped back (what a worker's k = 0 step runs);
- static eager: the same on a StaticCache (transformers'), the step rewritten in place;
- graph: that static step captured once as a CUDA graph and replayed (no Python, no launches per op).
On a launch-bound GPU the eager step's cost is its Python and kernel launches, not the weights' bytes:
graph / eager says how much of it capture removes, and graph(draft) / graph(target) is the cost ratio
c the pair would have with it (eager on the H200, 2026-11-28: about 0.8, which no acceptance beats).
The greedy token of the last step is compared across the three (a capture that computed something else
would show). On a CPU only the two eager kinds run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from specdec.models import crop_cache, load_model, new_cache, resolve_dtype, synchronize


def timed(step: Callable[[], torch.Tensor], reps: int, device: torch.device, after: Callable[[], None] = lambda: None
          ) -> tuple[float, int]:
    """Median ms of `step` (three warm-ups), and the greedy token of its last output."""
    times, logits = [], None
    for _ in range(reps + 3):
        synchronize(device)
        start = time.perf_counter()
        logits = step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        after()
    assert logits is not None
    return statistics.median(times[3:]), int(logits[0, -1].argmax())


@torch.inference_mode()
def measure(ref: str, device_name: str, context: int, reps: int) -> dict:
    dtype = resolve_dtype("auto", "target", device_name)
    model = load_model(ref, dtype, device_name).model
    device = next(model.parameters()).device
    prompt = torch.randint(0, 250, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
    token = torch.tensor([[5]], device=device)
    out: dict = {"model": ref, "device": str(device), "dtype": str(dtype), "context": context, "reps": reps}

    cache = new_cache(model)
    model(input_ids=prompt, past_key_values=cache, use_cache=True)
    out["eager_ms"], out["eager_token"] = timed(
        lambda: model(input_ids=token, past_key_values=cache, use_cache=True).logits, reps, device,
        lambda: crop_cache(cache, context))

    from transformers import StaticCache
    static = StaticCache(config=model.config, max_cache_len=context + 8)
    model(input_ids=prompt, past_key_values=static, cache_position=torch.arange(context, device=device),
          use_cache=True)
    position = torch.tensor([context], device=device)
    position_ids = position.view(1, 1)

    def rewind() -> None:
        # transformers 5's StaticCache writes at a per-layer device counter that each update advances
        # (a captured graph advances it too): set back to `context`, so every step writes the same slot.
        for layer in static.layers:
            layer.cumulative_length.fill_(context)

    def static_step() -> torch.Tensor:  # the same step each time (rewound after it, untimed)
        return model(input_ids=token, past_key_values=static, cache_position=position, position_ids=position_ids,
                     use_cache=True).logits
    out["static_ms"], out["static_token"] = timed(static_step, reps, device, rewind)

    if device.type == "cuda":
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's docs ask
                for _ in range(3):
                    static_step()
                    rewind()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = static_step()
            rewind()

            def replay() -> torch.Tensor:
                graph.replay()
                return captured
            out["graph_ms"], out["graph_token"] = timed(replay, reps, device, rewind)
        except Exception as exc:  # a host sync inside the forward, an op capture refuses: say which
            out["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="model refs separated by |: the target first, then the draft")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    rows = [measure(ref, args.device, args.context, args.reps) for ref in args.models.split("|")]
    print("| model | eager ms | static eager ms | graph ms | graph / eager | same greedy token |\n|---|---|---|---|---|---|")
    for row in rows:
        graph = row.get("graph_ms")
        same = len({row[k] for k in ("eager_token", "static_token", "graph_token") if k in row}) == 1
        graph_cell = f"{graph:.2f}" if graph else row.get("graph_error", "-")
        ratio = f"{graph / row['eager_ms']:.3f}" if graph else "-"
        print(f"| {row['model']} | {row['eager_ms']:.2f} | {row['static_ms']:.2f} | {graph_cell} | {ratio} | {same} |")
    if len(rows) == 2:
        for kind in ("eager_ms", "static_ms", "graph_ms"):
            if rows[0].get(kind) and rows[1].get(kind):
                print(f"c = draft / target, {kind[:-3]}: {rows[1][kind] / rows[0][kind]:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
