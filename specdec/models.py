"""Model and tokenizer loading for workers and the orchestrator.

Model refs:
  tiny:seed=N[,noise=X][,layers=L][,hidden=H][,vocab=V]  random-weight test model built in-process
  embedded:<name>                                         converted embedded model (see specdec.embedded)
  <dir or hub id>                                         transformers from_pretrained (safetensors only)
  <file>.gguf                                             GGUF file, dequantised by transformers + gguf
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


class ModelRefError(ValueError):
    """The model ref cannot be resolved (not found, not converted, malformed)."""


# ----------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """Byte-level tokenizer for the tiny test models: ids 0-255 are bytes, then specials."""

    BOS, EOS, PAD = 256, 257, 258
    SPECIALS = {BOS: "<s>", EOS: "</s>", PAD: "<pad>"}

    def __init__(self, vocab_size: int = 260) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text)

    def fingerprint(self) -> str:
        return f"bytes-{self.vocab_size}"

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.EOS]


class HFTokenizer:
    """Thin adapter so the orchestrator sees one tokenizer interface."""

    def __init__(self, tok: Any, eos_ids: list[int]) -> None:
        self._tok = tok
        self._eos = eos_ids

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def fingerprint(self) -> str:
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        digest = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in vocab).encode()).hexdigest()
        return digest[:16]

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)


Tokenizer = ByteTokenizer | HFTokenizer


# ----------------------------------------------------------------------------- tiny models

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


def build_tiny_model(spec: TinySpec) -> torch.nn.Module:
    """A small Qwen2-architecture model with deterministic random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=False,
        # Large init spreads the logits so argmax ties (and fp-order flips) are vanishingly rare.
        initializer_range=0.3, bos_token_id=ByteTokenizer.BOS, eos_token_id=ByteTokenizer.EOS,
        pad_token_id=ByteTokenizer.PAD,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    if spec.noise > 0:
        gen = torch.Generator().manual_seed(10_000 + spec.seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * spec.noise * param.std())
    model.generation_config.eos_token_id = ByteTokenizer.EOS
    model.generation_config.pad_token_id = ByteTokenizer.PAD
    return model.eval()


# ----------------------------------------------------------------------------- loading

@dataclass
class LoadedModel:
    ref: str
    model: torch.nn.Module
    tokenizer: Tokenizer
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]


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


def _eos_ids(model: torch.nn.Module, tok: Any) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return sorted(ids)


def load_tokenizer(ref: str) -> Tokenizer:
    if ref.startswith("tiny"):
        return ByteTokenizer(TinySpec.parse(ref).vocab)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    path, gguf = resolve_path(ref)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(path)
    eos: set[int] = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    for loader in (GenerationConfig, AutoConfig):
        try:
            cfg = loader.from_pretrained(path, gguf_file=gguf) if gguf else loader.from_pretrained(path)
        except (OSError, ValueError):
            continue
        value = getattr(cfg, "eos_token_id", None)
        eos.update([value] if isinstance(value, int) else list(value or []))
    return HFTokenizer(tok, sorted(eos))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bf16_is_fast() -> bool:
    """True where the CPU has native bf16 matmuls (AVX512-BF16 / AMX) or a CUDA device is used."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, role: str) -> torch.dtype:
    """`auto`: the target stays float32 (its numerics define the output; batched bf16 forwards can
    flip near-tie argmaxes versus one-token decoding), the draft uses bf16 where it is fast (the
    draft's numerics only change acceptance, never the output)."""
    if name == "auto":
        return torch.bfloat16 if role == "draft" and bf16_is_fast() else torch.float32
    if name not in DTYPES:
        raise ModelRefError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(ref: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load a model for inference. Weights come from safetensors (or GGUF); never from pickle."""
    if ref.startswith("tiny"):
        spec = TinySpec.parse(ref)
        model = build_tiny_model(spec).to(device=resolve_device(device), dtype=dtype)
        tok = ByteTokenizer(spec.vocab)
        return LoadedModel(ref, model, tok, spec.vocab, spec.max_positions, tok.eos_token_ids)
    from transformers import AutoModelForCausalLM
    path, gguf = resolve_path(ref)
    log.info("loading model %s (%s)", ref, path)
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": None if gguf else True}
    if gguf:
        kwargs["gguf_file"] = gguf
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device=resolve_device(device), dtype=dtype).eval()
    tok = load_tokenizer(ref)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    max_ctx = int(getattr(model.config, "max_position_embeddings", 4096))
    eos = sorted(set(_eos_ids(model, tok)) | set(tok.eos_token_ids))
    return LoadedModel(ref, model, tok, vocab, max_ctx, eos)


def set_torch_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    elif os.environ.get("SPECDEC_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["SPECDEC_TORCH_THREADS"]))


# ----------------------------------------------------------------------------- KV cache helpers

def new_cache(model: torch.nn.Module) -> Any:
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


_CROP_TAKES_REMOVAL = "tokens_to_remove" in inspect.signature(
    __import__("transformers").DynamicCache.crop).parameters


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache (API differs across transformers versions)."""
    current = cache.get_seq_length()
    if length >= current:
        return
    # transformers >= 5 takes a negative count of tokens to drop; 4.x took the absolute length.
    cache.crop(-(current - length) if _CROP_TAKES_REMOVAL else length)


def cache_nbytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total
