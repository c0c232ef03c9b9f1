"""Forward time over attention shapes a process has run before, against new ones, with cuDNN
attention on or off (one process per setting: the choice and cuDNN's per-shape graphs are
process-wide).

Decoding almost never repeats a (query rows, key length) pair: the context grows every step and a
verify adds k + 1 rows. On the H200 (2026-11-27) the traces put a forward of a new shape at a median
76.5 ms against 32 ms for a repeated one; cuDNN's per-shape graph build is the suspect
(specdec.models.configure_attention, which turns it off by default). This measures it directly:

    python scripts/attention_shapes.py --model tiny:preset=qwen2.5-1.5b,seed=1 --device cuda --cudnn off --out off.json

"new": steps of 1 and 3 rows (a decode step, a k = 2 verify) on a growing context, each shape run
once; "repeat": the same steps, each cropped back and run again at the shape it just ran.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny:preset=qwen2.5-1.5b,seed=1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cudnn", choices=["on", "off"], required=True)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["SPECDEC_CUDNN_ATTENTION"] = "1" if args.cudnn == "on" else "0"
    from specdec.models import crop_cache, load_model, new_cache, synchronize  # reads the variable at load

    device = torch.device(args.device)
    loaded = load_model(args.model, getattr(torch, args.dtype), args.device)
    model = loaded.model
    ids = torch.randint(0, min(1000, loaded.vocab_size), (1, args.context + 4 * args.steps), device=device)

    def forward(cache, rows: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids[:, :rows], past_key_values=cache, use_cache=True, logits_to_keep=rows)
        synchronize(device)
        return (time.perf_counter() - start) * 1000.0

    times: dict[str, dict[int, list[float]]] = {"new": {1: [], 3: []}, "repeat": {1: [], 3: []}}
    with torch.inference_mode():
        cache = new_cache(model)
        model(input_ids=ids[:, :args.context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for i in range(args.steps):
            rows = 1 if i % 2 == 0 else 3
            length = cache.get_seq_length()
            times["new"][rows].append(forward(cache, rows))      # a (rows, length) pair not run before
            crop_cache(cache, length)
            times["repeat"][rows].append(forward(cache, rows))   # the same pair again
    report = {
        "model": args.model, "device": args.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "cudnn_requested": args.cudnn,
        "cudnn_sdp_enabled": bool(torch.backends.cuda.cudnn_sdp_enabled()) if device.type == "cuda" else None,
        "torch": torch.__version__, "context": args.context, "steps": args.steps,
        "median_ms": {kind: {str(rows): round(statistics.median(v), 2) for rows, v in by_rows.items()}
                      for kind, by_rows in times.items()},
        "ms": {kind: {str(rows): [round(x, 2) for x in v] for rows, v in by_rows.items()}
               for kind, by_rows in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["median_ms"]), "cudnn", args.cudnn, "enabled:", report["cudnn_sdp_enabled"])


if __name__ == "__main__":
    main()
