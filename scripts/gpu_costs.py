"""Forward costs of the real models' shapes on a device, with random weights (tiny:preset=...).

    python scripts/gpu_costs.py --out DIR [--device cuda] [--presets qwen2.5-0.5b,qwen2.5-1.5b,...]

For each shape: the cost curve the workers measure at startup (specdec.calibration: ms per forward of
t new rows on c cached ones, eager, as in service), HF `generate`'s greedy tok/s (the target-only
anchor, eager), the weights' memory-bound floor, and, where it captures, one-token steps replayed
from a CUDA graph over a static cache (what a graph-captured decode step would cost; the service does
not have one). Then the synthetic pair's agreement: how often the cut draft's greedy token equals the
quiet-tailed target's (random weights: the rate is set by construction, not a real pair's).
Real weights cannot travel to a lent device (64 MiB a call), so shapes are what it can measure.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from specdec.calibration import measure_cost_curve
from specdec.model_refs import SHAPE_PRESETS, TinySpec
from specdec.models import build_tiny_model, configure_attention, synchronize

log = logging.getLogger("gpu_costs")


@torch.inference_mode()
def generate_tok_s(model: torch.nn.Module, device: torch.device, new_tokens: int, prompt: int = 64) -> float:
    ids = torch.randint(0, 256, (1, prompt), device=device)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm
    synchronize(device)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    synchronize(device)
    return new_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def graph_step_ms(model: torch.nn.Module, device: torch.device, context: int = 128, steps: int = 50) -> float:
    """One-token steps replayed from a CUDA graph over a static cache; raises where capture fails."""
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 32)
    prefix = torch.randint(0, 256, (1, context), device=device)
    model(input_ids=prefix, past_key_values=cache, use_cache=True,
          cache_position=torch.arange(context, device=device), logits_to_keep=1)
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    position = torch.tensor([context], device=device)

    def step() -> torch.Tensor:
        return model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                     logits_to_keep=1).logits

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for i in range(steps):
        position.fill_(context + i)
        start = time.perf_counter()
        graph.replay()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[5:])


@torch.inference_mode()
def greedy_agreement(target: torch.nn.Module, draft: torch.nn.Module, device: torch.device, new_tokens: int = 64) -> float:
    ids = torch.randint(0, 256, (4, 24), device=device, generator=None)
    out = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    t_logits = target(out).logits[:, 23:-1]
    d_logits = draft(out).logits[:, 23:-1]
    return (t_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-1.5b@24,qwen2.5-7b",
                        help="comma list; NAME@L is the preset cut to its first L layers")
    parser.add_argument("--budget-s", type=float, default=6.0, help="each cost curve's measuring budget")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bandwidth-tbs", type=float, default=0.0, help="for the floor (0: skip)")
    parser.add_argument("--pair", default="tiny:preset=qwen2.5-1.5b,seed=1,quiet_from=24,quiet=0.3|"
                                          "tiny:preset=qwen2.5-1.5b,seed=1,layers=24",
                        help="target|draft refs whose greedy agreement is measured ('' to skip)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    configure_attention(device)  # the attention backend the workers use
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                  "torch": torch.__version__, "dtype": args.dtype, "shapes": {}}
    for item in filter(None, args.presets.split(",")):
        name, _, cut = item.partition("@")
        ref = f"tiny:preset={name},seed=1" + (f",layers={cut}" if cut else "")
        started = time.perf_counter()
        model = build_tiny_model(TinySpec.parse(ref), device).to(dtype)
        params = sum(p.numel() for p in model.parameters())
        gathered = model.get_input_embeddings().weight.numel() if not SHAPE_PRESETS[name].tie_embeddings else 0
        entry: dict[str, object] = {"ref": ref, "params": params, "build_s": round(time.perf_counter() - started, 1)}
        curve = measure_cost_curve(model, SHAPE_PRESETS[name].vocab, max_tokens=16, contexts=(128, 1024),
                                   budget_s=args.budget_s, reps=5, load_tokens=(32, 64, 128))
        entry["curve"] = [list(p) for p in curve.points]
        entry["hf_generate_tok_s"] = round(generate_tok_s(model, device, args.new_tokens), 1)
        if args.bandwidth_tbs:
            entry["floor_ms"] = round((params - gathered) * dtype.itemsize / (args.bandwidth_tbs * 1e12) * 1e3, 3)
        if device.type == "cuda":
            try:
                entry["graph_step_ms"] = round(graph_step_ms(model, device), 3)
            except Exception as exc:  # noqa: BLE001 - a measurement that may not capture: say why
                entry["graph_step_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log.info("%s: %s", item, {k: v for k, v in entry.items() if k != "curve"})
        results["shapes"][item] = entry  # type: ignore[index]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        (args.out / "gpu_costs.json").write_text(json.dumps(results, indent=1))
    if args.pair:
        target_ref, draft_ref = args.pair.split("|")
        target = build_tiny_model(TinySpec.parse(target_ref), device).to(dtype)
        draft = build_tiny_model(TinySpec.parse(draft_ref), device).to(dtype)
        torch.manual_seed(0)
        results["pair"] = {"target": target_ref, "draft": draft_ref,
                           "greedy_agreement": round(greedy_agreement(target, draft, device, args.new_tokens), 3)}
        log.info("pair: %s", results["pair"])
    (args.out / "gpu_costs.json").write_text(json.dumps(results, indent=1))
    lines = [f"device {results['device']}, torch {results['torch']}, {args.dtype}", "",
             "| shape | params | 1 row ms | 4 rows | 8 rows | 16 rows | 64 rows | 1 row @1024 | HF generate tok/s | graph step ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for item, entry in results["shapes"].items():  # type: ignore[union-attr]
        at = {(t, c): ms for t, c, ms in entry["curve"]}
        cell = lambda t, c=128: f"{at[(t, c)]:.2f}" if (t, c) in at else "-"  # noqa: E731
        lines.append(f"| {item} | {entry['params'] / 1e9:.2f} G | {cell(1)} | {cell(4)} | {cell(8)} | {cell(16)} | "
                     f"{cell(64)} | {cell(1, 1024)} | {entry['hf_generate_tok_s']} | "
                     f"{entry.get('graph_step_ms', entry.get('graph_step_error', '-'))} |")
    if "pair" in results:
        lines += ["", f"synthetic pair greedy agreement: {results['pair']['greedy_agreement']}"]  # type: ignore[index]
    (args.out / "gpu_costs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
