"""Model refs, parsed without torch (the orchestrator resolves its tokenizer ref with these).

  tiny:seed=N[,noise=X][,layers=L][,hidden=H][,vocab=V][,max_positions=P]  random-weight test model
  tiny:preset=qwen2.5-1.5b,seed=N[,layers=L][,quiet_from=Q,quiet=X]  random weights at a real model's
                                                          shapes, for timing on a device the weights
                                                          cannot travel to (see TinySpec)
  embedded:<name>                                         converted embedded model (see specdec.embedded)
  <dir or hub id>                                         transformers from_pretrained (safetensors only)
  <file>.gguf                                             GGUF file, dequantised by transformers + gguf
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelRefError(ValueError):
    """The model ref cannot be resolved (not found, not converted, malformed)."""


@dataclass(frozen=True)
class ShapePreset:
    """A real model's shapes (Qwen2 architecture), for random-weight stand-ins."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool


# The embedded pair's shapes, as its converted checkpoints have them (separate LM heads: the
# published Qwen2.5 0.5B/1.5B configs tie them; a forward computes the same either way, but a CPU
# never packs a tied weight), and the 7B-class target of the GPU deployment (its config.json). The 7B's
# padded vocabulary differs from the others', so the orchestrator refuses a 7B preset target with a
# 0.5B/1.5B preset draft (their byte tokenizers' fingerprints name the vocabulary): it is for
# scripts/gpu_costs.py, which times models alone.
SHAPE_PRESETS: dict[str, ShapePreset] = {
    "qwen2.5-0.5b": ShapePreset(896, 4864, 24, 14, 2, 151936, False),
    "qwen2.5-1.5b": ShapePreset(1536, 8960, 28, 12, 2, 151936, False),
    "qwen2.5-7b": ShapePreset(3584, 18944, 28, 28, 4, 152064, False),
}


@dataclass(frozen=True)
class TinySpec:
    """A random-weight model. Without `preset`, a tiny Qwen2 for tests. With `preset`, a real model's
    shapes at transformers' own init: the compute per token is the real model's, so a device the
    real weights cannot reach still measures real costs. There `layers` keeps the first L of the
    preset's layers (built at full depth, then cut, so they are the full model's first L), and
    `quiet` scales the output projections of the layers from `quiet_from` on: a target that stays
    close to its own first `quiet_from` layers, whose cut copy is then a draft that agrees with it
    at a rate the scale sets (synthetic agreement, not a real pair's)."""
    seed: int = 0
    noise: float = 0.0        # perturb weights of the seed model: 0 = identical, larger = less agreement
    layers: int = 2
    hidden: int = 64
    vocab: int = 260
    max_positions: int = 4096
    preset: str = ""
    quiet_from: int = 0
    quiet: float = 1.0

    @classmethod
    def parse(cls, ref: str) -> "TinySpec":
        body = ref.split(":", 1)[1] if ":" in ref else ""
        kwargs: dict[str, Any] = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in cls.__dataclass_fields__:
                raise ModelRefError(f"unknown tiny model option {key!r} in {ref!r}")
            try:
                kwargs[key] = value if key == "preset" else float(value) if key in ("noise", "quiet") else int(value)
            except ValueError as exc:
                raise ModelRefError(f"tiny model option {key}={value!r} in {ref!r} is not a number") from exc
        preset = kwargs.get("preset")
        if preset is not None:
            if preset not in SHAPE_PRESETS:
                raise ModelRefError(f"unknown shape preset {preset!r} in {ref!r}; known: {', '.join(SHAPE_PRESETS)}")
            shape = SHAPE_PRESETS[preset]
            if "hidden" in kwargs or "vocab" in kwargs:
                raise ModelRefError(f"{ref!r}: a preset fixes hidden and vocab")
            if "noise" in kwargs:
                raise ModelRefError(f"{ref!r}: noise is for the tiny test models; a preset's pair is cut and quietened")
            kwargs["hidden"], kwargs["vocab"] = shape.hidden, shape.vocab
            kwargs.setdefault("layers", shape.layers)
            if not 1 <= kwargs["layers"] <= shape.layers:
                raise ModelRefError(f"{ref!r}: layers must be 1..{shape.layers} for {preset}")
            if ("quiet" in kwargs) != ("quiet_from" in kwargs):
                raise ModelRefError(f"{ref!r}: quiet and quiet_from go together")
            if not 0 <= kwargs.get("quiet_from", 0) < shape.layers or not 0.0 <= kwargs.get("quiet", 1.0):
                raise ModelRefError(f"{ref!r}: quiet_from must be 0..{shape.layers - 1} and quiet >= 0")
        elif "quiet" in kwargs or "quiet_from" in kwargs:
            raise ModelRefError(f"{ref!r}: quiet and quiet_from need a preset")
        return cls(**kwargs)


def resolve_path(ref: str) -> tuple[str, str | None]:
    """Return (directory or hub id, gguf file name or None) for non-tiny refs."""
    if ref.startswith("embedded:"):
        from specdec import embedded
        name = ref.split(":", 1)[1]
        if name not in embedded.EMBEDDED_MODELS:
            raise ModelRefError(f"unknown embedded model {name!r}; known: {', '.join(embedded.EMBEDDED_MODELS)}")
        if not embedded.is_ready(name):
            raise ModelRefError(f"embedded model {name!r} is not converted yet: run "
                                f"`python -m specdec.embedded {name}` (part of the README setup command)")
        return str(embedded.converted_path(name)), None
    if ref.endswith(".gguf"):
        path = Path(ref)
        if not path.is_file():
            raise ModelRefError(f"GGUF file not found: {ref}")
        return str(path.parent), path.name
    return ref, None
