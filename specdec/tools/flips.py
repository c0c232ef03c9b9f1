"""`specdec flips`: how often verifying k+1 positions in one forward picks a different greedy token
than decoding them one at a time, per dtype, on this device.

Greedy identity means: the service's output equals HF `generate` in the same dtype on the same
device. HF decodes one token per forward (M = 1); the target verifies k+1 tokens per forward
(M = k+1). In float32 the two GEMM shapes agree to ~1e-6 and an argmax flips only on an exact-ish
tie; in bf16 the accumulation order differs by more, so near-ties can flip. This tool measures the
rate: decode N tokens one at a time, then re-run the same tokens k+1 at a time on the same cache and
count the positions whose argmax differs. Each flip is reported with its top-2 logit margin.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec.calibration import GEMM_PATHS
from specdec.embedded import DEFAULT_TARGET

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FlipCount:
    dtype: str
    k: int
    positions: int = 0
    flips: int = 0
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit at each flip
    gemm_path: str = "F.linear (as HF)"  # what the k+1-position forwards ran
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.flips / self.positions if self.positions else 0.0


@torch.inference_mode()
def count_flips(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int, k: int, dtype_name: str,
                device: torch.device, prepare_verify: Callable[[], str] | None = None) -> FlipCount:
    """Decode each prompt one token at a time (HF `generate`'s path), then re-run the same tokens k+1
    per forward. `prepare_verify`, called between the two, switches the model to the workers' GEMM
    path (linear_path), so the count compares the service's verify with HF's own decode."""
    from specdec.models import new_cache
    result = FlipCount(dtype_name, k)
    started = time.perf_counter()
    sequences: list[list[int]] = []
    for prompt in prompts:
        cache = new_cache(model)
        ids = torch.tensor([prompt], device=device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        sequence: list[int] = []
        for _ in range(new_tokens):  # one at a time, as HF generate decodes
            token = int(torch.argmax(logits))
            sequence.append(token)
            step = torch.tensor([[token]], device=device)
            logits = model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        sequences.append(sequence)
    if prepare_verify is not None:
        result.gemm_path = prepare_verify()
    for prompt, sequence in zip(prompts, sequences):
        # Same tokens, k+1 per forward, on a cache the verify path filled itself: row i predicts
        # sequence[j + i + 1]. The first generated token was predicted by the prompt's last position:
        # that token goes first, as a verify's commit does, then the chunks.
        cache = new_cache(model)
        if len(prompt) > 1:
            model(input_ids=torch.tensor([prompt[:-1]], device=device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        fed = [prompt[-1]] + sequence[:-1]
        for start in range(0, len(fed), k + 1):
            chunk = fed[start:start + k + 1]
            out = model(input_ids=torch.tensor([chunk], device=device), past_key_values=cache, use_cache=True,
                        logits_to_keep=len(chunk)).logits[0].float()
            argmax = torch.argmax(out, dim=-1).tolist()
            top2 = torch.topk(out, 2, dim=-1).values
            for i, predicted in enumerate(argmax):
                expected = sequence[start + i]
                result.positions += 1
                if predicted != expected:
                    result.flips += 1
                    result.margins.append(round(float(top2[i, 0] - top2[i, 1]), 4))
                    # Later rows are conditioned on the one-at-a-time tokens either way (teacher
                    # forcing), so one flip does not cascade into the rest of the chunk.
    result.seconds = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec flips", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--k", type=int, default=4, help="drafts per verify: k+1 positions per forward")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=str(ROOT / "bench" / "prompts.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=9)
    parser.add_argument("--gemm-path", choices=GEMM_PATHS, default="auto",
                        help="auto: the k+1-position forwards run the GEMM path a worker picks at startup "
                             "(linear_path), against HF's one-at-a-time decode; library: F.linear for both")
    parser.add_argument("--out", help="write the counts as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from specdec.models import load_model, load_tokenizer, resolve_device
    from specdec.tools.bench import describe_machine
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.model)
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()][:args.max_prompts]
    prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in rows]
    results: list[FlipCount] = []
    for name in args.dtypes.split(","):
        loaded = load_model(args.model, getattr(torch, name), str(device))
        prepare = None
        if args.gemm_path == "auto":
            from specdec import linear_path

            def prepare(model: torch.nn.Module = loaded.model) -> str:
                return linear_path.choose_and_apply(model, max(args.k + 1, 16), 10.0).summary()
        results.append(count_flips(loaded.model, prompts, args.new_tokens, args.k, name, device, prepare))
        del loaded, prepare  # the closure holds the model too: free it before the next dtype loads
    machine = describe_machine()
    print(f"model {args.model} on {device}; {machine['cpu']} (flags {machine['flags']}); {machine['gpu']}; "
          f"torch {machine['torch']}; {len(prompts)} prompts x {args.new_tokens} tokens, k = {args.k}")
    print("| dtype | positions | flips | rate | top-2 margin at flips | s |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.dtype} | {r.positions} | {r.flips} | {r.rate:.2%} | {r.margins or '-'} | {r.seconds:.0f} |")
    for r in results:
        print(f"{r.dtype} verify path: {r.gemm_path}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine, "model": args.model, "device": str(device),
                                              "results": [asdict(r) | {"rate": r.rate} for r in results]},
                                             indent=1))


if __name__ == "__main__":
    main()
