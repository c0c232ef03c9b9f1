"""Per-layer int4 kernel times against the float32 and bf16 paths (python timing, each point the best of
3 passes over enough layers to leave the cache), for the output in int4_kernels_emulated_avx2.txt:
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python docs/bench/amd-epyc-zen4/int4/int4_kernels.py
"""
import time, torch, sys
sys.path.insert(0, ".")
from specdec import linear_path as lp
torch.set_num_threads(2)
print(torch.backends.cpu.get_cpu_capability(), 'bf16 native', torch.ops.mkldnn._is_mkldnn_bf16_supported())
def cold(fn_list, reps=3):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter()
        for f in fn_list: f()
        best = min(best, (time.perf_counter() - t) * 1000 / len(fn_list))
    return best
for N, K, n in [(4864, 896, 12), (896, 4864, 12), (896, 896, 40), (151936, 896, 1)]:
    ws = [torch.randn(N, K) * 0.02 for _ in range(n)]
    xs = {m: torch.randn(m, K) for m in (1, 2, 4)}
    bf = [w.to(torch.bfloat16) for w in ws]
    q32 = [lp.quantize_int4(w)[0] for w in ws]
    q16 = [lp.quantize_int4(w.to(torch.bfloat16))[0] for w in ws]
    for m, x in xs.items():
        xb = x.to(torch.bfloat16)
        r = {'f32 F.linear': cold([lambda w=w: torch.nn.functional.linear(x, w) for w in ws]),
             'f32 weight-left': cold([lambda w=w: lp.weight_left(x, w, None) for w in ws]),
             'bf16 copy': cold([lambda w=w: lp.reduced_linear(x, w, None) for w in bf]),
             'int4 f32 act': cold([lambda q=q: lp.int4_linear(x, q, None) for q in q32]),
             'int4 bf16 act': cold([lambda q=q: lp.int4_linear(xb, q, None) for q in q16])}
        print(f"{N}x{K} M={m}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
