"""Where the 0.5B draft's GEMM-path measurement spends its time, per shape and phase (one thread, pinned
by the caller): taskset -c 1 .venv/bin/python docs/bench/amd-epyc-zen4/draft-startup/measure_profile.py"""
import time, torch, logging, os
os.environ.setdefault("SPECDEC_MODELS_DIR", "/work/main/.models")
from specdec.models import load_model, resolve_dtype
from specdec import linear_path as lp
torch.set_num_threads(1)
m = load_model("embedded:qwen2.5-coder-0.5b", resolve_dtype("auto", "draft"), "cpu").model
rec = []
def wrap(cls, name):
    orig = getattr(cls, name)
    def f(self, *a, **k):
        t = time.perf_counter(); r = orig(self, *a, **k); rec.append((name, a[:1] if name == "time" else (), round(time.perf_counter() - t, 3))); return r
    setattr(cls, name, f)
wrap(lp._ShapeTimer, "__init__"); wrap(lp._ShapeTimer, "time"); wrap(lp._ShapeTimer, "drop_disagreeing")
t = time.perf_counter()
choice = lp.measure(m, 16, 60, reduced_kind="int4")
print("total", round(time.perf_counter() - t, 2))
shape_i = -1
for name, a, dt in rec:
    if name == "__init__": shape_i += 1; print(f"--- shape {shape_i}")
    print(f"  {name} {a} {dt}")
