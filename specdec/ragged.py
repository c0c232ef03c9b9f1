"""One forward pass over several sessions' new tokens (torch, no grpc).

Decode on a small batch is memory-bound: each weight matrix is read once per forward whatever the
number of token rows. So the rows of every session in a batch are concatenated into one [1, R, H]
sequence for the linear layers (embeddings, projections, MLP, norms, LM head), while attention runs
per session against that session's own KV cache, with its own positions and causal mask. No cache is
padded, each stays the session's own (cropped on its own), and sessions of any length and any number
of new tokens share a forward: ragged batching, the way vLLM flattens tokens.

Attention has two paths. "per session": transformers' attention call once per session and layer, as
the model's own forward runs it. "packed": every session's keys concatenated into one varlen tensor
and one variable-length flash-attention call per layer (torch.nn.attention.varlen, CUDA only). On a
launch-bound GPU the per-session calls are what a batch adds to a step (H200, 2026-11-28: 2.65 ms per
added session over 28 layers); packed, a session adds its cache update and its share of one copy of
the keys and values per layer. The packed kernel is checked at startup against per-session attention
on the model's head shapes and scale, decode and chunk shapes with long keys included, and is used
only if it agrees (`attention="auto"`); anything else runs per session, and a packed kernel that
fails in service hands every later forward to the per-session path.

Over 300 lines: the two attention paths share the forward around them, and the packed one's startup
check (with its plain-torch reference) belongs beside it.

Supported: decoder-only models whose layers have the Llama shape (input norm -> self-attention with
q/k/v/o projections and rotary embeddings -> residual -> post-attention norm -> MLP -> residual):
Llama, Mistral, Qwen2 and Qwen3 (q/k norms), without sliding-window layers. Anything else is served one
session per forward (`unsupported_reason` says why). On the per-session path the attention call, the
mask builder and the rotary helper are transformers' own, so a batch of one computes exactly what the
model's forward does.
"""
from __future__ import annotations

import importlib
import inspect
from itertools import accumulate
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# model_type -> the transformers module with its apply_rotary_pos_emb.
_SUPPORTED = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclass
class RaggedItem:
    """One session's part of a batched forward: feed `tokens` on top of `cache`, return the logits of
    the last `logits_rows` of them (0: all)."""
    cache: Any
    tokens: Sequence[int]
    logits_rows: int = 0


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when ragged_forward can run this model, else why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        return f"model type {model_type!r} is not one of {sorted(_SUPPORTED)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "no .model.layers / .lm_head"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window layers"
    if getattr(config, "sliding_window", None) and (model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        return "sliding-window attention"  # the model's own forward masks it; the ragged mask would not
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        # Their frequencies depend on the longest position in the forward: batching would change them.
        return f"rope type {rope_type!r}"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r}"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a layer without q/k/v/o projections"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "a layer without the Llama norm/MLP layout"
    return None


# (query [Tq, Hq, D], key [Tk, Hkv, D], value [Tk, Hkv, D], cu_q, cu_k (int32 [N + 1]), max_q, max_k,
# scale) -> [Tq, Hq, D]: causal attention per sequence, each sequence's queries being the last rows of
# its keys (bottom-right aligned), Hq a multiple of Hkv (grouped-query attention).
PackedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float],
                           torch.Tensor]


def reference_packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                               cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """PackedAttention in plain torch, one sequence at a time: the startup check's reference. Checks
    the packing it is given as a flash kernel would need it (tests run the packed forward with it)."""
    lengths_q, lengths_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    if not (cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
            and cu_q[-1] == query.shape[0] and cu_k[-1] == key.shape[0] and (lengths_k >= lengths_q).all()
            and max_q == lengths_q.max() and max_k == lengths_k.max()):
        raise ValueError(f"inconsistent packing: cu_q {cu_q.tolist()}, cu_k {cu_k.tolist()}, max {max_q}/{max_k}, "
                         f"{query.shape[0]} queries, {key.shape[0]} keys")
    out = torch.empty_like(query)
    group = query.shape[1] // key.shape[1]
    for qs, qe, ks, ke in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        q = query[qs:qe].transpose(0, 1)                                # [Hq, n, D]
        k = key[ks:ke].transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
        v = value[ks:ke].transpose(0, 1).repeat_interleave(group, dim=0)
        n, length = qe - qs, ke - ks
        # Query row i sits at position length - n + i and sees keys up to it.
        allowed = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
        out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def torch_varlen_attention() -> PackedAttention | None:
    """torch's variable-length flash attention as a PackedAttention, or None where this torch lacks it
    (its keyword arguments changed between releases: causal was `is_causal`, then `window_size`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    takes_scale = "scale" in params
    if "window_size" in params:
        options: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        options = {"is_causal": True}
    else:
        return None
    if "enable_gqa" in params:
        options["enable_gqa"] = True

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, scale: float) -> torch.Tensor:
        if takes_scale:
            return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, scale=scale, **options)
        if abs(scale - query.shape[-1] ** -0.5) > 1e-9:  # a release without `scale`: its default only
            raise ValueError(f"this torch's varlen attention takes no scale, and the model's is {scale}")
        return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **options)
    return attend


def _contiguous_inputs(kernel: PackedAttention, repeat_heads: bool = False) -> PackedAttention:
    """`kernel` given contiguous query, key and value (and, with repeat_heads, as many key/value heads as
    query heads): variants for a torch whose varlen kernel takes strided or grouped inputs wrongly."""
    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any) -> torch.Tensor:
        if repeat_heads:
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        return kernel(query.contiguous(), key.contiguous(), value.contiguous(), *rest)
    return attend


# (query rows, key rows) per sequence of each startup check: short mixed steps, where a misaligned
# causal mask, a crossed sequence boundary or wrongly grouped heads show; then what service sends,
# one-row decodes over long caches (where a kernel may split the keys) and a prompt chunk longer than
# a kernel tile beside a verify.
CHECK_BATCHES = (((1, 5), (3, 9), (2, 2), (1, 1)), ((1, 700), (1, 1), (1, 300)), ((1, 1030), (130, 300), (3, 3)))


def packed_attention_agrees(kernel: PackedAttention, device: torch.device, dtype: torch.dtype, heads: int,
                            kv_heads: int, head_dim: int, scale: float | None = None) -> str | None:
    """None when `kernel` computes what per-session attention does on these head shapes and scale
    (to the dtype's rounding) for every batch of CHECK_BATCHES, else why not."""
    scale = head_dim ** -0.5 if scale is None else scale
    generator = torch.Generator().manual_seed(0)
    for batch in CHECK_BATCHES:
        q_rows, k_rows = [q for q, _ in batch], [k for _, k in batch]
        # Laid out as _attend_packed's are: queries [T, H, D] contiguous; keys and values transposed
        # from [H, T, D] (the concatenated caches).
        query = torch.randn(sum(q_rows), heads, head_dim, generator=generator).to(device, dtype)
        key, value = (torch.randn(kv_heads, sum(k_rows), head_dim, generator=generator).to(device, dtype).transpose(0, 1)
                      for _ in range(2))
        cu_q = torch.tensor(list(accumulate(q_rows, initial=0)), dtype=torch.int32, device=device)
        cu_k = torch.tensor(list(accumulate(k_rows, initial=0)), dtype=torch.int32, device=device)
        try:
            got = kernel(query, key, value, cu_q, cu_k, max(q_rows), max(k_rows), scale).float()
            want = reference_packed_attention(query.float(), key.float(), value.float(), cu_q, cu_k, max(q_rows),
                                              max(k_rows), scale)
            error = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
        except Exception as exc:  # noqa: BLE001 - any failure means: not on this device/dtype/torch
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        tolerance = 1e-4 if dtype == torch.float32 else 0.05  # bf16 rounds to ~0.4%; a misalignment errs by ~1
        if not error <= tolerance:
            return f"differs from per-session attention by {error:.3g} (query, key rows {batch})"
    return None


class RaggedForward:
    """Callable over a list of RaggedItem; returns float32 logits [rows_i, V] per item, in order.

    attention: "auto" (packed where the kernel exists for this device and passes the startup check,
    else per session), "per-session", or "packed" (an error if unavailable). `kernel` replaces torch's
    varlen flash attention (tests run the packed path on a CPU with the reference). The environment
    variable SPECDEC_PACKED_ATTENTION=0 makes "auto" mean per session.
    """

    def __init__(self, model: torch.nn.Module, attention: str = "auto", kernel: PackedAttention | None = None) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"ragged batching unsupported: {reason}")
        if attention not in ("auto", "per-session", "packed"):
            raise ValueError(f"attention must be auto, per-session or packed, not {attention!r}")
        self.model = model
        self.inner = model.model
        self.config = model.config
        module = importlib.import_module(f"transformers.models.{_SUPPORTED[model.config.model_type]}."
                                         f"modeling_{_SUPPORTED[model.config.model_type]}")
        self._rotary = module.apply_rotary_pos_emb
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        self._mask = create_causal_mask
        self._attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                module.eager_attention_forward)
        self.device = next(model.parameters()).device
        self._kernel = self._choose_kernel(attention, kernel)
        self.attention_path = "packed" if self._kernel else "per-session"

    def _choose_kernel(self, attention: str, kernel: PackedAttention | None) -> PackedAttention | None:
        if attention == "per-session" or (attention == "auto" and os.environ.get("SPECDEC_PACKED_ATTENTION") == "0"):
            return None
        if kernel is None and (self.device.type == "cuda" or attention == "packed"):
            kernel = torch_varlen_attention()
        if kernel is None:
            why = "torch.nn.attention.varlen is missing or of a signature not known here" \
                if self.device.type == "cuda" or attention == "packed" else "not a CUDA device"
        else:
            heads, attn = self.config.num_attention_heads, self.inner.layers[0].self_attn
            shapes = (self.device, next(self.model.parameters()).dtype, heads,
                      getattr(self.config, "num_key_value_heads", None) or heads, attn.head_dim, attn.scaling)
            # The kernel as it is, then on copies laid out as plainly as possible (a copy per layer costs little).
            variants = {"strided": kernel, "contiguous": _contiguous_inputs(kernel),
                        "contiguous, heads repeated": _contiguous_inputs(kernel, repeat_heads=True)}
            for layout, variant in variants.items():
                why = packed_attention_agrees(variant, *shapes)
                if why is None:
                    log.info("ragged attention: packed (one variable-length call per layer for every session; "
                             "%s inputs)", layout)
                    return variant
        if attention == "packed":
            raise ValueError(f"packed attention unavailable: {why}")
        log.log(logging.INFO if self.device.type != "cuda" else logging.WARNING,
                "ragged attention: per session (packed unavailable: %s)", why)
        return None

    @torch.inference_mode()
    def __call__(self, items: Sequence[RaggedItem]) -> list[torch.Tensor]:
        lengths = [len(item.tokens) for item in items]
        if not items or min(lengths) == 0:
            raise ValueError("every item needs at least one token")
        starts = list(accumulate(lengths, initial=0))
        ids = torch.tensor([[t for item in items for t in item.tokens]], dtype=torch.long, device=self.device)
        hidden = self.inner.embed_tokens(ids)
        pasts = [item.cache.get_seq_length() for item in items]
        # Built on the host, one copy: a device arange per session would be a launch per session.
        position_ids = torch.tensor([[i for p, n in zip(pasts, lengths) for i in range(p, p + n)]], device=self.device)
        cos, sin = self.inner.rotary_emb(hidden, position_ids)
        if self._kernel:
            # Sequence boundaries of the packed queries and keys (keys: cached plus new), one copy per forward.
            ends = [p + n for p, n in zip(pasts, lengths)]
            cu = torch.tensor([starts, list(accumulate(ends, initial=0))], dtype=torch.int32, device=self.device)
            packing = (cu[0], cu[1], max(lengths), max(ends))
        else:
            # Per-session masks, built before any cache grows (as the model's forward does).
            masks = [self._mask(config=self.config, inputs_embeds=hidden[:, s:e], attention_mask=None,
                                past_key_values=item.cache, position_ids=position_ids[:, s:e])
                     for item, s, e in zip(items, starts, starts[1:])]
        for layer in self.inner.layers[: self.config.num_hidden_layers]:
            residual = hidden
            x = layer.input_layernorm(hidden)
            attended = self._attend_packed(layer, x, items, starts, packing, cos, sin) if self._kernel \
                else self._attend(layer, x, items, starts, masks, cos, sin)
            hidden = residual + attended
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.inner.norm(hidden)
        # The LM head (a [V, H] GEMM) only for the rows each session uses.
        # At most the item's own rows: more would hand it the previous item's logits.
        keep = [e - min(item.logits_rows or (e - s), e - s) for item, s, e in zip(items, starts, starts[1:])]
        rows = torch.cat([hidden[0, k:e] for k, e in zip(keep, starts[1:])])
        logits = self.model.lm_head(rows.unsqueeze(0))[0].float()
        out, offset = [], 0
        for k, e in zip(keep, starts[1:]):
            out.append(logits[offset: offset + e - k])
            offset += e - k
        return out

    def _project(self, attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Projections, q/k norms and the rotary over every row at once (row-wise, so each row's
        # values are what it alone would get). On a GPU each op is a kernel launch, and a step's cost
        # is their count: per session, only what must be.
        shape = (1, x.shape[1], -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)  # [1, heads, rows, head_dim]

    def _attend_packed(self, layer: torch.nn.Module, x: torch.Tensor, items: Sequence[RaggedItem], starts: list[int],
                       packing: tuple[torch.Tensor, torch.Tensor, int, int], cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        q, k, v = self._project(attn, x, cos, sin)
        keys, values = [], []
        for item, s, e in zip(items, starts, starts[1:]):  # the only per-session work: the cache update
            cached_keys, cached_values = item.cache.update(k[:, :, s:e], v[:, :, s:e], attn.layer_idx)
            keys.append(cached_keys[0])
            values.append(cached_values[0])
        cu_q, cu_k, max_q, max_k = packing
        # One session's cache needs no concatenation (a cat of one tensor would still copy it).
        key, value = (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys, dim=1), torch.cat(values, dim=1))
        try:
            out = self._kernel(q[0].transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), cu_q, cu_k, max_q,
                               max_k, attn.scaling)
        except Exception as exc:
            from specdec.scheduler import out_of_memory
            if not out_of_memory(exc):
                # Checked at startup, yet failing on a shape the check did not send: this forward
                # fails (its caches are part-updated; the worker discards them), later ones run per session.
                log.exception("packed attention failed; batched forwards run attention per session from now on")
                self._kernel, self.attention_path = None, "per-session"
            raise
        return attn.o_proj(out.reshape(1, x.shape[1], -1))

    def _attend(self, layer: torch.nn.Module, x: torch.Tensor, items: Sequence[RaggedItem], starts: list[int],
                masks: list[Any], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        q, k, v = self._project(attn, x, cos, sin)
        outputs = []
        for item, s, e, mask in zip(items, starts, starts[1:], masks):
            keys, values = item.cache.update(k[:, :, s:e], v[:, :, s:e], attn.layer_idx)
            out, _ = self._attention(attn, q[:, :, s:e], keys, values, mask, dropout=0.0, scaling=attn.scaling,
                                     sliding_window=getattr(attn, "sliding_window", None))
            outputs.append(out.reshape(1, e - s, -1))
        return attn.o_proj(torch.cat(outputs, dim=1).contiguous())
