"""Ragged forward step, the per-session loop before (a file of specdec/ragged.py from git) and after (the
working tree), interleaved in one process: python docs/bench/amd-epyc-zen4/ragged-ab/ab.py OLD.py [REFS...]"""
import sys, time, statistics, importlib.util, torch
sys.path.insert(0, ".")
from specdec.model_refs import TinySpec, ShapePreset
from specdec import model_refs
from specdec.models import build_tiny_model, new_cache, crop_cache
from specdec.ragged import RaggedForward, RaggedItem
spec = importlib.util.spec_from_file_location("ragged_old", sys.argv.pop(1)); old = importlib.util.module_from_spec(spec); sys.modules["ragged_old"] = old; spec.loader.exec_module(old)
torch.set_num_threads(2)
model_refs.SHAPE_PRESETS["small"] = ShapePreset(256, 512, 12, 4, 2, 4096, True)
refs = sys.argv[1:] or ["tiny:preset=small,seed=1"]
for ref in refs:
    model = build_tiny_model(TinySpec.parse(ref)).eval()
    new_f, old_f = RaggedForward(model), old.RaggedForward(model)
    for B in (1, 8):
        caches = []
        for i in range(B):
            c = new_cache(model); model(input_ids=torch.randint(0, 250, (1, 128 + 8 * i)), past_key_values=c, use_cache=True); caches.append(c)
        lens = [c.get_seq_length() for c in caches]
        times = {"old": [], "new": []}
        for rep in range(30):
            for name, f in (("old", old_f), ("new", new_f)) if rep % 2 else (("new", new_f), ("old", old_f)):
                items = [RaggedItem(c, [5], 1) for c in caches]
                t = time.perf_counter(); out = f(items); times[name].append((time.perf_counter() - t) * 1e3)
                for c, l in zip(caches, lens): crop_cache(c, l)
        o = [RaggedItem(c, [5], 1) for c in caches]; a = old_f(o); [crop_cache(c, l) for c, l in zip(caches, lens)]
        b = new_f([RaggedItem(c, [5], 1) for c in caches]); [crop_cache(c, l) for c, l in zip(caches, lens)]
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        mo, mn = statistics.median(times["old"][3:]), statistics.median(times["new"][3:])
        print(f"{ref} B={B}: old {mo:.2f} ms, new {mn:.2f} ms, new/old {mn/mo:.3f}, bitwise equal {same}", flush=True)
