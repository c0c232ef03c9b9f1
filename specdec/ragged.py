"""One forward pass over several sessions' new tokens (torch, no grpc).

Decode on a small batch is memory-bound: each weight matrix is read once per forward whatever the
number of token rows. So the rows of every session in a batch are concatenated into one [1, R, H]
sequence for the linear layers (embeddings, projections, MLP, norms, LM head), while attention runs
per session against that session's own KV cache, with its own positions and causal mask. No cache is
padded or copied, each stays the session's own (cropped on its own), and sessions of any length and
any number of new tokens share a forward: ragged batching, the way vLLM flattens tokens.

Supported: decoder-only models whose layers have the Llama shape (input norm -> self-attention with
q/k/v/o projections and rotary embeddings -> residual -> post-attention norm -> MLP -> residual):
Llama, Mistral, Qwen2 and Qwen3 (q/k norms), without sliding-window layers. Anything else is served one
session per forward (`unsupported_reason` says why). The attention call, the mask builder and the
rotary helper are transformers' own, so a batch of one computes exactly what the model's forward does.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
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


class RaggedForward:
    """Callable over a list of RaggedItem; returns float32 logits [rows_i, V] per item, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"ragged batching unsupported: {reason}")
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

    @torch.inference_mode()
    def __call__(self, items: Sequence[RaggedItem]) -> list[torch.Tensor]:
        lengths = [len(item.tokens) for item in items]
        if not items or min(lengths) == 0:
            raise ValueError("every item needs at least one token")
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        ids = torch.tensor([[t for item in items for t in item.tokens]], dtype=torch.long, device=self.device)
        hidden = self.inner.embed_tokens(ids)
        pasts = [item.cache.get_seq_length() for item in items]
        positions = torch.cat([torch.arange(p, p + n, device=self.device) for p, n in zip(pasts, lengths)])
        position_ids = positions.unsqueeze(0)
        cos, sin = self.inner.rotary_emb(hidden, position_ids)
        # Per-session masks, built before any cache grows (as the model's forward does).
        masks = [self._mask(config=self.config, inputs_embeds=hidden[:, s:e], attention_mask=None,
                            past_key_values=item.cache, position_ids=position_ids[:, s:e])
                 for item, s, e in zip(items, starts, starts[1:])]
        for layer in self.inner.layers[: self.config.num_hidden_layers]:
            residual = hidden
            hidden = residual + self._attend(layer, layer.input_layernorm(hidden), items, starts, masks, cos, sin)
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

    def _attend(self, layer: torch.nn.Module, x: torch.Tensor, items: Sequence[RaggedItem], starts: list[int],
                masks: list[Any], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        # Projections, q/k norms and the rotary over every row at once (row-wise, so each row's
        # values are what it alone would get); the cache update and attention per session. On a GPU
        # each op is a kernel launch, and a step's cost is their count: per session, only what must be.
        shape = (1, x.shape[1], -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        outputs = []
        for item, s, e, mask in zip(items, starts, starts[1:], masks):
            keys, values = item.cache.update(k[:, :, s:e], v[:, :, s:e], attn.layer_idx)
            out, _ = self._attention(attn, q[:, :, s:e], keys, values, mask, dropout=0.0, scaling=attn.scaling,
                                     sliding_window=getattr(attn, "sliding_window", None))
            outputs.append(out.reshape(1, e - s, -1))
        return attn.o_proj(torch.cat(outputs, dim=1).contiguous())
