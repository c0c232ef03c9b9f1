"""Random-weight stand-ins at a real model's shapes (tiny:preset=...): what a device the real weights
cannot travel to measures with. The cut copy must be the full model's first layers, and the quiet
tail must move the full model towards it."""
from __future__ import annotations

import pytest
import torch

from specdec import model_refs
from specdec.model_refs import SHAPE_PRESETS, ModelRefError, ShapePreset, TinySpec
from specdec.models import build_tiny_model, load_model

MINI = ShapePreset(hidden=64, intermediate=96, layers=6, heads=4, kv_heads=2, vocab=300, tie_embeddings=True)


@pytest.fixture
def mini_preset(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(model_refs.SHAPE_PRESETS, "mini", MINI)
    return "mini"


def test_a_preset_ref_takes_the_presets_dimensions() -> None:
    spec = TinySpec.parse("tiny:preset=qwen2.5-1.5b,seed=3")
    assert (spec.hidden, spec.vocab, spec.layers, spec.seed) == (1536, 151936, 28, 3)
    cut = TinySpec.parse("tiny:preset=qwen2.5-1.5b,seed=3,layers=24,quiet_from=2,quiet=0.5")
    assert (cut.layers, cut.quiet_from, cut.quiet) == (24, 2, 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("preset, embedded_name", [("qwen2.5-0.5b", "qwen2.5-coder-0.5b"),
                                                   ("qwen2.5-1.5b", "qwen2.5-coder-1.5b")])
def test_the_embedded_pairs_presets_match_its_converted_configs(preset: str, embedded_name: str) -> None:
    """The shapes a GPU run times are the ones the embedded pair has (needs `make setup`'s models)."""
    import json

    from specdec import embedded
    assert embedded.is_ready(embedded_name), f"{embedded_name} is not converted: run `make setup` first"
    config = json.loads((embedded.converted_path(embedded_name) / "config.json").read_text())
    shape = SHAPE_PRESETS[preset]
    assert (shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads, shape.vocab,
            shape.tie_embeddings) == (config["hidden_size"], config["intermediate_size"],
                                      config["num_hidden_layers"], config["num_attention_heads"],
                                      config["num_key_value_heads"], config["vocab_size"],
                                      bool(config.get("tie_word_embeddings", False)))


@pytest.mark.parametrize("ref, message", [
    ("tiny:preset=llama-9000", "unknown shape preset"),
    ("tiny:preset=qwen2.5-0.5b,layers=25", "layers must be 1..24"),
    ("tiny:preset=qwen2.5-0.5b,hidden=64", "fixes hidden and vocab"),
    ("tiny:seed=1,quiet=0.5", "need a preset"),
    ("tiny:seed=x", "not a number"),
    ("tiny:preset=qwen2.5-1.5b,noise=0.1", "noise is for the tiny test models"),
    ("tiny:preset=qwen2.5-1.5b,quiet=0.3", "go together"),
    ("tiny:preset=qwen2.5-1.5b,quiet_from=-1,quiet=0.3", "quiet_from must be 0..27"),
    ("tiny:preset=qwen2.5-1.5b,quiet_from=28,quiet=0.3", "quiet_from must be 0..27"),
])
def test_bad_preset_refs_are_refused(ref: str, message: str) -> None:
    with pytest.raises(ModelRefError, match=message):
        TinySpec.parse(ref)


@torch.inference_mode()
def test_the_cut_copy_is_the_full_models_first_layers(mini_preset: str) -> None:
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    full = build_tiny_model(TinySpec.parse(f"tiny:preset={mini_preset},seed=5"))
    cut = build_tiny_model(TinySpec.parse(f"tiny:preset={mini_preset},seed=5,layers=4"))
    silent_tail = build_tiny_model(TinySpec.parse(f"tiny:preset={mini_preset},seed=5,quiet_from=4,quiet=0"))
    half_tail = build_tiny_model(TinySpec.parse(f"tiny:preset={mini_preset},seed=5,quiet_from=4,quiet=0.5"))
    assert len(cut.model.layers) == 4 and cut.config.num_hidden_layers == 4
    # Layers whose output projections are zero add nothing to the residual stream.
    torch.testing.assert_close(silent_tail(ids).logits, cut(ids).logits)
    far = (full(ids).logits - cut(ids).logits).abs().mean()
    near = (half_tail(ids).logits - cut(ids).logits).abs().mean()
    assert 0 < near < far


def test_a_preset_loads_as_a_worker_model(mini_preset: str) -> None:
    loaded = load_model(f"tiny:preset={mini_preset},seed=1,layers=2", torch.bfloat16, "cpu")
    assert loaded.vocab_size == MINI.vocab and loaded.tokenizer.vocab_size == MINI.vocab
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_the_gpu_cost_script_reports_every_shape_and_the_pair(mini_preset: str, tmp_path, monkeypatch) -> None:
    """scripts/gpu_costs.py, run on the CPU: what a lent GPU's one call runs first must not fail there."""
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_costs.py"
    monkeypatch.setattr(sys, "argv", [
        str(script), "--device", "cpu", "--dtype", "float32", "--presets", f"{mini_preset},{mini_preset}@2",
        "--budget-s", "0.5", "--new-tokens", "4", "--bandwidth-tbs", "0.000001",
        "--pair", f"tiny:preset={mini_preset},seed=1,quiet_from=2,quiet=0.3|tiny:preset={mini_preset},seed=1,layers=2",
        "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    report = json.loads((tmp_path / "gpu_costs.json").read_text())
    assert set(report["shapes"]) == {mini_preset, f"{mini_preset}@2"}
    for entry in report["shapes"].values():
        assert {t for t, _, _ in entry["curve"]} >= {1, 16} and entry["hf_generate_tok_s"] > 0
        assert entry["floor_ms"] > 0
    assert report["shapes"][f"{mini_preset}@2"]["params"] < report["shapes"][mini_preset]["params"]
    assert 0.0 <= report["pair"]["greedy_agreement"] <= 1.0
    assert "| mini@2 |" in (tmp_path / "gpu_costs.md").read_text()


def test_the_ragged_step_script_reports_each_session_count(tmp_path, monkeypatch) -> None:
    """scripts/ragged_steps.py (a stage of scripts/gpu_session.sh), run on the CPU."""
    import json
    import runpy
    import sys
    from pathlib import Path

    import specdec.ragged

    script = Path(__file__).resolve().parents[1] / "scripts" / "ragged_steps.py"
    out = tmp_path / "ragged.json"
    # Both attention paths, as on a GPU: the packed one with the reference kernel (torch's is CUDA-only).
    monkeypatch.setattr(specdec.ragged, "torch_varlen_attention", lambda: specdec.ragged.reference_packed_attention)
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny:seed=1", "--sessions", "1,3", "--reps", "2",
                                      "--context", "16", "--attention", "packed,per-session", "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    report = json.loads(out.read_text())
    assert set(report["paths"]) == {"packed", "per-session"}
    for rows in report["paths"].values():
        assert [row["sessions"] for row in rows] == [1, 3] and all(row["step_ms"] > 0 for row in rows)
    comparison = report["comparison"]
    assert comparison["sessions"] == 3 and comparison["argmax_agree"] == 3 and comparison["max_abs_logit_diff"] < 1e-3


def test_the_attention_shape_script_times_new_and_repeated_shapes(tmp_path, monkeypatch) -> None:
    """scripts/attention_shapes.py (the gpu_session.sh stage that settles the cuDNN question), on the CPU."""
    import json
    import os
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "attention_shapes.py"
    out = tmp_path / "attention.json"
    monkeypatch.setenv("SPECDEC_CUDNN_ATTENTION", "0")  # the script sets it; restored after the test
    monkeypatch.setattr(sys, "argv", [str(script), "--model", "tiny:seed=1", "--device", "cpu", "--dtype", "float32",
                                      "--cudnn", "off", "--context", "16", "--steps", "4", "--out", str(out)])
    runpy.run_path(str(script), run_name="__main__")
    report = json.loads(out.read_text())
    assert set(report["ms"]) == {"new", "repeat"} and report["cudnn_sdp_enabled"] is None
    assert all(len(v) == 2 and min(v) > 0 for by_rows in report["ms"].values() for v in by_rows.values())
    assert os.environ["SPECDEC_CUDNN_ATTENTION"] == "0"


def test_cuda_devices_turn_cudnn_attention_off_unless_asked(monkeypatch) -> None:
    """cuDNN attention builds a graph per new (rows, key length) pair, which decoding almost never
    repeats (specdec.models.configure_attention): off on CUDA by default, on with
    SPECDEC_CUDNN_ATTENTION=1, untouched on a CPU."""
    from specdec import models

    calls: list[bool] = []
    monkeypatch.setattr(models.torch.backends.cuda, "enable_cudnn_sdp", calls.append)
    monkeypatch.delenv("SPECDEC_CUDNN_ATTENTION", raising=False)
    assert models.configure_attention(torch.device("cpu")) is False and calls == []
    assert models.configure_attention(torch.device("cuda")) is False and calls == [False]
    monkeypatch.setenv("SPECDEC_CUDNN_ATTENTION", "1")
    assert models.configure_attention(torch.device("cuda", 0)) is True and calls == [False, True]
