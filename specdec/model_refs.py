"""Model refs, parsed without torch (the orchestrator resolves its tokenizer ref with these).

  tiny:seed=N[,noise=X][,layers=L][,hidden=H][,vocab=V][,max_positions=P]  random-weight test model
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
class TinySpec:
    seed: int = 0
    noise: float = 0.0        # perturb weights of the seed model: 0 = identical, larger = less agreement
    layers: int = 2
    hidden: int = 64
    vocab: int = 260
    max_positions: int = 4096

    @classmethod
    def parse(cls, ref: str) -> "TinySpec":
        body = ref.split(":", 1)[1] if ":" in ref else ""
        kwargs: dict[str, Any] = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in cls.__dataclass_fields__:
                raise ModelRefError(f"unknown tiny model option {key!r} in {ref!r}")
            kwargs[key] = float(value) if key == "noise" else int(value)
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
