"""Model loading for the workers (torch). Refs are parsed in specdec.model_refs, tokenizers loaded in
specdec.tokenizers; both are torch-free so the orchestrator can use them.

Over 300 lines: loading with its device, dtype and attention rules, and the few DynamicCache helpers
(new, crop, copy, size) that every caller of a loaded model needs.
"""
from __future__ import annotations

import copy
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from specdec.model_refs import SHAPE_PRESETS, ModelRefError, TinySpec, resolve_path
from specdec.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- tiny models

def build_tiny_model(spec: TinySpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A small Qwen2-architecture model with deterministic random weights (a preset's: on `device`)."""
    if spec.preset:
        return _build_preset_model(spec, device)
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


def _build_preset_model(spec: TinySpec, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A real model's shapes with random weights (TinySpec): built at full depth from the seed, so
    a cut copy holds the full model's first layers, then cut to `layers`, with the output
    projections of the layers from `quiet_from` on scaled by `quiet`. Built on `device`, where a
    GPU draws billions of weights in a blink and two CPU cores take half a minute: the same seed
    gives the same weights on the same kind of device (the CPU and CUDA generators differ)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SHAPE_PRESETS[spec.preset]
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=spec.max_positions, tie_word_embeddings=shape.tie_embeddings,
        rope_theta=1_000_000.0, initializer_range=0.02, bos_token_id=ByteTokenizer.BOS,
        eos_token_id=ByteTokenizer.EOS, pad_token_id=ByteTokenizer.PAD,
    )
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if spec.quiet != 1.0:
        with torch.no_grad():
            for layer in model.model.layers[spec.quiet_from:]:
                layer.self_attn.o_proj.weight.mul_(spec.quiet)
                layer.mlp.down_proj.weight.mul_(spec.quiet)
    if spec.layers < shape.layers:
        model.model.layers = model.model.layers[:spec.layers]
        model.config.num_hidden_layers = spec.layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:spec.layers]
    model.generation_config.eos_token_id = ByteTokenizer.EOS
    model.generation_config.pad_token_id = ByteTokenizer.PAD
    return model.eval()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock timing covers it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- loading

@dataclass
class LoadedModel:
    ref: str
    model: torch.nn.Module
    tokenizer: Tokenizer
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """True on CUDA, and on CPUs with native bf16 matmuls (AVX512-BF16 / AMX)."""
    if torch.device(device).type == "cuda":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, role: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The weights' dtype for a role on a device.

    `auto` on CUDA: bf16 for both roles, as vLLM, TGI and SGLang serve (float32 halves the
    memory-bound speed and doubles the memory). Greedy identity is then defined against HF
    `generate` in bf16 on the same device; `float32` stays selectable as the exact mode.
    `auto` on CPU: the target stays float32 (its numerics define the output, and on CPUs without
    bf16 units float32 is also the fast path), the draft uses bf16 where the CPU has native bf16
    (the draft's numerics change acceptance only, never the output).
    """
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if role == "draft" and bf16_is_fast(device) else torch.float32
    if name in ("exact", "fp32"):
        return torch.float32
    if name in ("bf16",):
        return torch.bfloat16
    if name not in DTYPES:
        raise ModelRefError(f"unknown dtype {name!r}; choose auto, exact, {', '.join(DTYPES)}")
    return DTYPES[name]


def reduced_copy_kinds(name: str, role: str, device: torch.device | str = "cpu", int4: bool = True) -> tuple[str, ...]:
    """The kinds of smaller weight copy the GEMM path may run a draft's few-row products on (linear_path,
    "reduced"), in order of preference: calibration measures the first, and the next only where the
    copies of the one before kept too little of the draft's distributions or won no shape's timing. Only a CPU draft under
    `--dtype auto`: never the target (its numerics are the output) and never an explicit dtype
    (float32 asked for is float32).
    - int4 (`--int4 auto`), where ATen's CPU int4 kernel runs (its products are bf16 whatever the
      draft's dtype): a quarter of bf16's bytes per one-token step.
    - bf16, for a draft `auto` keeps in float32 (no native bf16): ATen's bf16 matrix-vector kernels
      still read half the bytes there, while its bf16 GEMMs are slow for prompts and batches, which
      stay float32. After int4 where both apply: bf16 rounding keeps more of a distribution than
      4-bit levels (a draft trained in bf16 may lose more to int4 than the embedded one)."""
    if name != "auto" or role != "draft" or torch.device(device).type != "cpu":
        return ()
    from specdec import linear_path
    kinds = (linear_path.INT4,) if int4 and linear_path.int4_supported() else ()
    return kinds if bf16_is_fast(device) else kinds + (linear_path.BF16,)


def resolve_device(name: str = "auto") -> torch.device:
    """`auto`: the first CUDA device if there is one, else the CPU. A CUDA device that is not there
    is a configuration error, reported before any weights are loaded."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ModelRefError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelRefError(f"device {name!r} asked for, but torch sees no CUDA device "
                            f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelRefError(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ModelRefError(f"device type {device.type!r} is not supported; choose cpu or cuda")
    return device


def configure_attention(device: torch.device) -> bool:
    """Whether cuDNN attention stays on for a CUDA device (process-wide; every model loads through
    here, so in-process references use the workers' backend). Off unless SPECDEC_CUDNN_ATTENTION=1:
    cuDNN builds a graph per new (query, key) length pair, which decoding meets every step. On the
    H200 a new shape cost a median 76.5 against 32 ms a step (2129 traced rounds, 2026-11-27);
    scripts/attention_shapes.py measured it on 2026-11-28: on, 57.5 ms new against 18.5 repeated
    (one row); off, 31.5 against 30.5."""
    if device.type != "cuda":
        return False
    keep = os.environ.get("SPECDEC_CUDNN_ATTENTION", "0") == "1"
    torch.backends.cuda.enable_cudnn_sdp(keep)
    log.info("cuDNN attention %s (SPECDEC_CUDNN_ATTENTION=%d)", "on" if keep else "off", int(keep))
    return keep


def load_model(ref: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load a model for inference. Weights come from safetensors (or GGUF); never from pickle."""
    where = resolve_device(device)
    configure_attention(where)
    if ref.startswith("tiny"):
        spec = TinySpec.parse(ref)
        model = build_tiny_model(spec, where).to(device=where, dtype=dtype)
        tok = ByteTokenizer(spec.vocab)
        return LoadedModel(ref, model, tok, spec.vocab, spec.max_positions, tok.eos_token_ids)
    from transformers import AutoModelForCausalLM
    path, gguf = resolve_path(ref)
    log.info("loading model %s (%s)", ref, path)
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": None if gguf else True}
    if gguf:
        kwargs["gguf_file"] = gguf
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device=where, dtype=dtype).eval()
    tok = load_tokenizer(ref)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    max_ctx = int(getattr(model.config, "max_position_embeddings", 4096))
    eos = sorted(set(_eos_ids(model, tok)) | set(tok.eos_token_ids))
    model.generation_config.eos_token_id = eos  # HF generate (the bench's references) stops where the service does
    return LoadedModel(ref, model, tok, vocab, max_ctx, eos)


def set_torch_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    elif os.environ.get("SPECDEC_TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["SPECDEC_TORCH_THREADS"]))


@torch.no_grad()
def own_tensors(model: torch.nn.Module) -> None:
    """Copy every parameter and buffer into process memory.

    A safetensors checkpoint is memory-mapped: its tensors are views of the file. When some weights
    are replaced (linear_path packs them), the mapping stays alive while any tensor from it does, and
    the file pages the packing read stay mapped: a packed 1.5B target showed 12 GB of RSS, 6 of them
    clean file pages the kernel could reclaim but that every RSS-based monitor (and a container's
    memory limit, until reclaimed) counts. Owning the rest lets the mapping go; what stays is the
    model's own size, all of it resident."""
    for param in model.parameters():
        param.data = param.data.clone()
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.clone()


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


def copy_cache(cache: Any, length: int) -> Any:
    """An independent copy of a DynamicCache's first `length` positions (a branch of a session).
    Where every layer is a plain DynamicLayer (its length is its tensors'), only those positions are
    copied: deepcopy is handed each layer's K/V already sliced (its memo), so a long cache is not
    copied whole to be cropped after. Other layers (sliding-window ones keep a length of their own)
    are copied whole and cropped by their own rules."""
    from transformers.cache_utils import DynamicLayer
    layers = getattr(cache, "layers", None)
    memo: dict[int, Any] = {}
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        for layer in layers:
            for tensor in (layer.keys, layer.values):
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                    memo[id(tensor)] = tensor[..., :length, :].clone()
    copied = copy.deepcopy(cache, memo)
    crop_cache(copied, length)  # a no-op where the memo sliced every layer
    return copied


def estimate_kv_bytes_per_token(model: torch.nn.Module) -> int:
    """2 (K and V) x layers x KV heads x head dim x element size; 0 if the config does not say."""
    cfg = getattr(model, "config", None)
    try:
        layers = cfg.num_hidden_layers
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        element = next(model.parameters()).element_size()
    except (AttributeError, StopIteration, TypeError, ZeroDivisionError):
        return 0
    return int(2 * layers * heads * head_dim * element)


def cache_nbytes(cache: Any) -> int:
    """The memory a cache holds: its tensors' storage, which after a crop (views of the longer tensors)
    is more than the positions kept, until the next forward's concatenation copies them."""
    storages: dict[int, int] = {}
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())
