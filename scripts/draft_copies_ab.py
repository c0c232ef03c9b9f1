"""A/B of the embedded draft's forward on a 64-token context, with and without the reduced copies its
startup GEMM path chose (int4, or bf16 with --int4 off), the rest of the plan the same, alternated 5
times (each point the best of 3); then each one's greedy agreement with the float32 target
(teacher-forced one-token steps over the target's own greedy continuations of 5 chat prompts, 48
tokens each; AGREE=0 skips it). Run from the repository root after `make setup`:
    .venv/bin/python scripts/draft_copies_ab.py
Prefix ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 to emulate an
AVX2-only CPU (a float32 draft then). Figures: docs/adaptive-k.md, "The int4 copies"."""
import dataclasses
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
logging.basicConfig(level=logging.INFO, format="%(message)s")
from specdec import models, linear_path
from specdec.worker_core import WorkerCore
from specdec.calibration import calibrate
torch.set_num_threads(2)
kinds = models.reduced_copy_kinds('auto', 'draft', 'cpu', int4=os.environ.get('INT4', 'auto') == 'auto')
dtype = models.resolve_dtype('auto', 'draft')
print('capability', torch.backends.cpu.get_cpu_capability(), 'draft dtype', dtype, 'copy kinds', kinds)
core = WorkerCore(models.load_model('embedded:qwen2.5-coder-0.5b', dtype=dtype), 'draft')
calibrate(core, 8, 20.0, reduced_kind=kinds)
print('GEMM path:', core.gemm_path)
model = core.model
mods = [m for m in model.modules() if isinstance(m, linear_path.PathLinear)]
saved = [(m.reduced, m.plan) for m in mods]
def copies(on: bool) -> None:
    """The chosen plan with its copies, or the same plan without them."""
    for m, (r, p) in zip(mods, saved):
        m.reduced, m.plan = (r, p) if on else (None, dataclasses.replace(p, reduced_rows=0))
ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
@torch.inference_mode()
def step(rows):
    cache = models.new_cache(model)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    ts = []
    for _ in range(3):
        models.crop_cache(cache, 64)
        t = time.perf_counter(); model(input_ids=ids[:, :rows], past_key_values=cache, use_cache=True, logits_to_keep=rows)
        ts.append((time.perf_counter() - t) * 1000)
    return min(ts)
res = {True: {}, False: {}}
for rep in range(5):
    for on in ((True, False) if rep % 2 == 0 else (False, True)):
        copies(on)
        for rows in (1, 2, 3, 4, 5, 9, 16):
            res[on].setdefault(rows, []).append(step(rows))
for rows in res[True]:
    a, b = res[True][rows], res[False][rows]
    print(f"draft forward, {rows} rows @64: copies {statistics.median(a):.1f} ms ({min(a):.1f}-{max(a):.1f}), "
          f"without {statistics.median(b):.1f} ms ({min(b):.1f}-{max(b):.1f})", flush=True)
if os.environ.get('AGREE', '1') == '1':
    prompts = ["def quicksort(arr):", "Write a short story about a robot who learns to paint.",
               "What is the capital of Australia and why was it chosen?", "Solve: if 3x + 7 = 22, what is x? Explain.",
               "Write a polite email asking a colleague to review my pull request."]
    tgt = models.load_model('embedded:qwen2.5-coder-1.5b', dtype=torch.float32)
    seqs = []
    with torch.inference_mode():
        for p in prompts:
            pid = torch.tensor([tgt.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)])
            seqs.append((pid, tgt.model.generate(pid, max_new_tokens=48, do_sample=False)[0, pid.shape[1]:].tolist()))
    del tgt
    @torch.inference_mode()
    def agree():
        hit = tot = 0
        for pid, out in seqs:
            cache = models.new_cache(model)
            pred = model(input_ids=pid, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().item()
            for t in out:
                hit += pred == t; tot += 1
                pred = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().item()
        return hit / tot
    for on in (True, False):
        copies(on); print(f"greedy agreement with the target, copies {on}: {agree():.3f}", flush=True)
