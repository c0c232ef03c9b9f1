"""Logit warping and the lossless speculative rejection rule (pure torch, no I/O).

Both workers warp with the same function (temperature -> top-k -> top-p), and the draft samples from
exactly the sparse q it sends. Randomness comes from counter-based uniforms keyed by
(seed, absolute position, stream), so results do not depend on which replica ran a call or how often
a cache was rebuilt: a request seed reproduces the whole generation.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

# Streams of uniforms; each decision at a position uses its own stream.
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_TARGET_SAMPLE = 3


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids; probs are float32 values that sum to ~1."""
    token_ids: torch.Tensor  # int64 [n]
    probs: torch.Tensor      # float32 [n]

    def prob_of(self, token: int) -> float:
        hit = (self.token_ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        dense = torch.zeros(vocab_size, dtype=torch.float64)
        dense[self.token_ids] = self.probs.to(torch.float64)
        return dense


def uniform(seed: int, position: int, stream: int) -> float:
    """Counter-based U[0,1) with 53 random bits: a pure function of its arguments."""
    digest = hashlib.blake2b(struct.pack("<QQQ", seed & (2**64 - 1), position, stream),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p on the last dim; returns float32 probabilities (zeros outside support)."""
    scores = logits.to(torch.float32) / cfg.temperature
    vocab = scores.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from a 1-D non-negative vector (normalised here) with a given uniform."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64), right=True)[0])
    idx = min(idx, probs.shape[0] - 1)
    # Never return a zero-probability index (possible only through float edge cases).
    while probs[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def sparsify(probs: torch.Tensor, max_entries: int) -> SparseDist:
    """Sparse, renormalised float32 copy of a warped distribution, keeping at most max_entries tokens.

    Truncation lowers acceptance slightly but keeps the method exact, because the draft then samples
    from this very distribution.
    """
    support = int((probs > 0).sum())
    n = max(1, min(support, max_entries))
    values, ids = torch.topk(probs, n)
    values = values.to(torch.float32)
    values = values / values.sum()
    return SparseDist(token_ids=ids.to(torch.int64), probs=values)


def draft_sample(logits: torch.Tensor, cfg: SamplingConfig, position: int,
                 max_entries: int) -> tuple[int, float, SparseDist | None]:
    """Draft one token at an absolute position. Returns (token, its probability, q or None when greedy)."""
    if cfg.greedy:
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        token = int(torch.argmax(logits))
        return token, float(probs[token]), None
    q = sparsify(warp(logits, cfg), max_entries)
    i = sample_index(q.probs, uniform(cfg.seed, position, STREAM_DRAFT))
    return int(q.token_ids[i]), float(q.probs[i]), q


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x)/q(x)) for dense p and q."""
    qx = float(q[token])
    if qx <= 0.0:
        return 0.0
    return min(1.0, float(p[token]) / qx)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when p == q numerically (rejection then has probability 0)."""
    residual = torch.clamp(p.to(torch.float64) - q.to(torch.float64), min=0.0)
    total = float(residual.sum())
    if total <= 1e-12:
        return p.to(torch.float64) / float(p.sum())
    return residual / total


@dataclass(frozen=True)
class VerifyOutcome:
    accepted_len: int
    next_token: int


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> VerifyOutcome:
    """target_logits: [len(draft)+1, V]. Accept while the draft equals the target's argmax."""
    argmax = torch.argmax(target_logits, dim=-1).tolist()
    for i, token in enumerate(draft_tokens):
        if token != argmax[i]:
            return VerifyOutcome(i, argmax[i])
    return VerifyOutcome(len(draft_tokens), argmax[len(draft_tokens)])


def verify_sampled(target_logits: torch.Tensor, draft_tokens: list[int], q: list[SparseDist],
                   cfg: SamplingConfig, first_position: int) -> VerifyOutcome:
    """Lossless rejection sampling (Leviathan et al. / Chen et al.).

    target_logits: [len(draft)+1, V]; row i is the target's distribution for the token at absolute
    position first_position + i. q[i] is the draft's distribution the i-th draft token was sampled from.
    """
    if len(q) != len(draft_tokens):
        raise ValueError(f"need one q per draft token, got {len(q)} for {len(draft_tokens)}")
    p_all = warp(target_logits, cfg).to(torch.float64)
    vocab = p_all.shape[-1]
    for i, token in enumerate(draft_tokens):
        position = first_position + i
        p = p_all[i]
        q_dense = q[i].to_dense(vocab)
        if uniform(cfg.seed, position, STREAM_ACCEPT) < acceptance_probability(p, q_dense, token):
            continue
        residual = residual_distribution(p, q_dense)
        return VerifyOutcome(i, sample_index(residual, uniform(cfg.seed, position, STREAM_TARGET_SAMPLE)))
    position = first_position + len(draft_tokens)
    bonus = sample_index(p_all[len(draft_tokens)], uniform(cfg.seed, position, STREAM_TARGET_SAMPLE))
    return VerifyOutcome(len(draft_tokens), bonus)
