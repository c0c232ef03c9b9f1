"""Logit warping and the lossless speculative rejection rule (pure torch, no I/O).

Both workers warp with the same function (temperature -> top-k -> top-p), and the draft samples from
exactly the sparse q it sends. Every random decision goes through a `Randomness` object: in service it
is `SeededRandomness`, counter-based uniforms keyed by (seed, absolute position, stream; a draft draw
also by its whole prefix), so results do not depend on which replica ran a call or how often a cache
was rebuilt and a request seed reproduces the whole generation. The exact-enumeration tests swap in
a source that branches on every decision, so they run this very code, not a copy of it.

Probabilities that drive decisions are normalised in float64 (q as it travels in float32, p as warped
in float32), so the draft's sampling, the acceptance test and the residual all use one distribution
each: the rule is exact to float64 rounding, not merely to float32.

Device-true: every function here runs on the device its logits are on (CPU or CUDA). What crosses to
the host is small and bounded: a sparse q (at most max_entries per position), k + 1 argmax ids, k
acceptance probabilities and a sampled index, never a [rows, vocab] tensor.

Over 300 lines: drafting, warping and verification share the Randomness streams and the float64
normalisation above; split apart, the lossless argument would span modules.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from specdec.contract import SamplingConfig, extend_context_key
from specdec.v1 import worker_pb2

R = TypeVar("R")

# Streams of uniforms; each decision at a position uses its own stream.
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_TARGET_SAMPLE = 3

@dataclass(frozen=True)
class SparseDist:
    """A distribution over a few token ids; probs are float32 values that sum to ~1."""
    token_ids: torch.Tensor  # int64 [n]
    probs: torch.Tensor      # float32 [n]

    def prob_of(self, token: int) -> float:
        hit = (self.token_ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0

    def to_pb(self) -> worker_pb2.SparseDistribution:
        return worker_pb2.SparseDistribution(token_ids=self.token_ids.tolist(), probs=self.probs.tolist())

    @classmethod
    def from_pb(cls, msg: worker_pb2.SparseDistribution) -> "SparseDist":
        return cls(token_ids=torch.tensor(list(msg.token_ids), dtype=torch.int64),
                   probs=torch.tensor(list(msg.probs), dtype=torch.float32))

    def to_dense(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """float64 over the vocabulary, renormalised: the exact distribution the draft sampled from."""
        dense = torch.zeros(vocab_size, dtype=torch.float64, device=device)
        dense[self.token_ids.to(device)] = self.probs.to(device=device, dtype=torch.float64)
        return dense / dense.sum()


def uniform(seed: int, position: int, stream: int, context: int = 0) -> float:
    """Counter-based U[0,1) with 53 random bits: a pure function of its arguments."""
    key = struct.pack("<QQQ", seed & (2**64 - 1), position, stream)
    if context:
        key += struct.pack("<Q", context)
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def sample_index(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from a 1-D non-negative vector (normalised here) with a given uniform.

    Runs on probs' device; one transfer of three scalars (total, index, its probability) to the host.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    total = cdf[-1]
    index = torch.searchsorted(cdf, (total * u).reshape(1), right=True)[0].clamp(max=probs.shape[0] - 1)
    total_h, index_h, prob_h = torch.stack([total, index.to(torch.float64),
                                            probs[index].to(torch.float64)]).tolist()
    if not total_h > 0.0:
        raise ValueError("cannot sample from an all-zero distribution")
    idx = int(index_h)
    if prob_h <= 0:
        # Never return a zero-probability index (possible only through float edge cases): step back
        # to the nearest positive entry below, as the inverse CDF would with exact arithmetic.
        below = (probs[:idx] > 0).nonzero()
        idx = int(below[-1, 0]) if below.numel() else 0
    return idx


class Randomness(Protocol):
    """Where every random decision of a round comes from."""

    def choose(self, probs: torch.Tensor, position: int, stream: int, context: int = 0) -> int:
        """An index drawn from the 1-D non-negative vector probs (normalised by its sum); context
        (nonzero) keys the draw to the tokens before the position as well."""
        ...

    def accept(self, probability: float, position: int, stream: int, context: int = 0) -> bool:
        """True with the given probability; context as for choose."""
        ...


@dataclass(frozen=True)
class SeededRandomness:
    """The service's randomness: a pure function of (seed, position, stream[, context])."""
    seed: int

    def choose(self, probs: torch.Tensor, position: int, stream: int, context: int = 0) -> int:
        return sample_index(probs, uniform(self.seed, position, stream, context))

    def accept(self, probability: float, position: int, stream: int, context: int = 0) -> bool:
        return uniform(self.seed, position, stream, context) < probability


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, top-p on the last dim; returns float32 probabilities (zeros outside support).

    Ties are kept or dropped deterministically and identically on both workers: top-k keeps every
    token tied with the k-th score, top-p orders tied probabilities by token id (a stable sort).
    """
    scores = logits.to(torch.float32) / cfg.temperature
    vocab = scores.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def target_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """p: the warped target distribution in float64, normalised (what target-only decoding samples)."""
    p = warp(logits, cfg).to(torch.float64)
    return p / p.sum(dim=-1, keepdim=True)


def sparsify(probs: torch.Tensor, max_entries: int) -> SparseDist:
    """Sparse, renormalised float32 copy of a warped distribution, keeping at most max_entries tokens.

    Truncation lowers acceptance slightly but keeps the method exact, because the draft then samples
    from this very distribution (only the draft runs this, so how ties at the cut fall is free).
    """
    support = int((probs > 0).sum())
    n = max(1, min(support, max_entries))
    values, ids = torch.topk(probs, n)
    values = values.to(torch.float32)
    values = values / values.sum()
    # The only transfer of a drafted position: n <= max_entries ids and probabilities.
    return SparseDist(token_ids=ids.to(torch.int64).cpu(), probs=values.cpu())


# ----------------------------------------------------------------------------- drafting

@dataclass
class Draft:
    """What one Propose drafted: tokens, the q each was sampled from (sampling only), confidences."""
    tokens: list[int] = field(default_factory=list)
    q: list[SparseDist] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    # Max probability at each position considered (drafted ones, and the one an early stop ended at).
    confidences: list[float] = field(default_factory=list)
    # Forwards run after the first (the first position's logits come from applying the commit).
    steps: int = 0
    # The runner-up at each drafted position (token, probability): pipelined rounds pre-draft after
    # the likeliest of these, as guesses of the target's correction token at a rejection.
    alternatives: list[tuple[int, float]] = field(default_factory=list)


def draft_confidence(logits: torch.Tensor, cfg: SamplingConfig,
                     max_entries: int) -> tuple[float, SparseDist | None, int, tuple[int, float]]:
    """(the draft's max probability at this position, q or None when greedy, the greedy token or -1,
    the greedy runner-up (token, probability) or (-1, 0)), before any token is drawn. Greedy: one
    transfer of four scalars."""
    if cfg.greedy:
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        token = torch.argmax(logits)
        others = probs.clone()
        others[token] = -1.0  # the runner-up is the best of the rest (-1: a vocabulary of one)
        alt = torch.argmax(others)
        top, token_id, alt_prob, alt_id = torch.stack(
            [probs[token], token, others[alt], alt]).to(torch.float64).tolist()
        alternative = (int(alt_id), alt_prob) if alt_prob >= 0 else (-1, 0.0)
        return top, None, int(token_id), alternative
    q = sparsify(warp(logits, cfg), max_entries)
    return float(q.probs.max()), q, -1, (-1, 0.0)


def runner_up(q: SparseDist, drawn_index: int) -> tuple[int, float]:
    """q's most probable token other than the one drawn: (token, probability), (-1, 0) if none."""
    if len(q.probs) < 2:
        return -1, 0.0
    probs = q.probs.clone()
    probs[drawn_index] = -1.0
    index = int(torch.argmax(probs))
    return int(q.token_ids[index]), float(q.probs[index])


def draft_steps(first_logits: torch.Tensor, k: int, cfg: SamplingConfig, first_position: int,
                max_entries: int, min_draft_prob: float, rng: Randomness,
                context: int = 0) -> Generator[int, torch.Tensor, Draft]:
    """Draft up to k tokens starting at absolute position first_position, as a generator.

    Yields each drafted token that must run through the draft model and receives the logits that
    predict the next position (the caller batches that forward with other sessions' or runs it
    alone). The last drafted token is not fed: the target verifies it, and the next commit appends
    whatever follows. Returns the Draft.

    Early stop (min_draft_prob > 0): drafting stops BEFORE a position whose draft distribution has
    max probability below the threshold. The decision depends only on the already drafted prefix,
    never on the value of a token drawn at that position, so accept / resample still reproduces the
    target exactly. (Dropping a token after drawing it because its probability was low would bias the
    output; for greedy the two rules coincide.)

    context: the key of the tokens before first_position (contract.extend_context_key chained over
    them: WorkerSession.context_key), extended by each drafted token, so that each draw is keyed by
    its whole prefix. Keyed by position alone, a round after a rejection would draw its drafts with
    the uniforms of the drafts it threw away, on which the k policy may have depended (an early
    stop's drafted count): the drafted token was then no longer distributed as q
    (docs/correctness.md, "Randomness").
    """
    draft = Draft()
    logits = first_logits
    for i in range(k):
        confidence, q, greedy_token, alternative = draft_confidence(logits, cfg, max_entries)
        draft.confidences.append(confidence)
        if min_draft_prob > 0 and confidence < min_draft_prob:
            break
        if q is None:
            token = greedy_token
            prob = confidence
        else:
            index = rng.choose(q.probs, first_position + i, STREAM_DRAFT, context)
            token, prob = int(q.token_ids[index]), float(q.probs[index])
            alternative = runner_up(q, index)
            draft.q.append(q)
        draft.alternatives.append(alternative)
        draft.tokens.append(token)
        draft.token_probs.append(prob)
        if context:
            context = extend_context_key(context, token)
        if i < k - 1:
            logits = yield token
            draft.steps += 1
    return draft


def drive(steps: Generator[Any, Any, R], respond: Callable[[Any], Any]) -> R:
    """Run a step generator to completion, answering each yielded request with respond(request)."""
    try:
        request = next(steps)
        while True:
            request = steps.send(respond(request))
    except StopIteration as stop:
        return stop.value
    finally:
        steps.close()  # after an error in respond(): runs the call's cleanup (unpins its session)


def propose_tokens(first_logits: torch.Tensor, feed: Callable[[int], torch.Tensor], k: int,
                   cfg: SamplingConfig, first_position: int, max_entries: int, min_draft_prob: float,
                   rng: Randomness, context: int = 0) -> Draft:
    """draft_steps with `feed(token)` running each drafted token through the draft model."""
    return drive(draft_steps(first_logits, k, cfg, first_position, max_entries, min_draft_prob, rng, context),
                 feed)


# ----------------------------------------------------------------------------- verification

def acceptance_probabilities(p: torch.Tensor, q: torch.Tensor, tokens: list[int]) -> list[float]:
    """min(1, p_i(x_i)/q_i(x_i)) for dense rows p[i], q[i] and drafted tokens x_i, on their device
    (0 where q_i(x_i) = 0); only the len(tokens) results cross to the host."""
    rows = torch.arange(len(tokens), device=p.device)
    index = torch.tensor(tokens, dtype=torch.int64, device=p.device)
    p_x, q_x = p[rows, index], q[rows, index]
    ratio = torch.clamp(p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x)), max=1.0)
    return torch.where(q_x > 0, ratio, torch.zeros_like(ratio)).tolist()


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x)/q(x)) for dense p and q."""
    return acceptance_probabilities(p[None], q[None], [token])[0]


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

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        """The tokens a round adds to the output: the accepted drafts, then the correction or bonus."""
        return list(draft_tokens[:self.accepted_len]) + [self.next_token]


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> VerifyOutcome:
    """target_logits: [len(draft)+1, V]. Accept while the draft equals the target's argmax."""
    argmax = torch.argmax(target_logits, dim=-1).tolist()
    for i, token in enumerate(draft_tokens):
        if token != argmax[i]:
            return VerifyOutcome(i, argmax[i])
    return VerifyOutcome(len(draft_tokens), argmax[len(draft_tokens)])


def verify_sampled(target_logits: torch.Tensor, draft_tokens: list[int], q: list[SparseDist],
                   cfg: SamplingConfig, first_position: int, rng: Randomness | None = None,
                   context: int = 0) -> VerifyOutcome:
    """Lossless rejection sampling (Leviathan et al. / Chen et al.).

    target_logits: [len(draft)+1, V]; row i is the target's distribution for the token at absolute
    position first_position + i. q[i] is the draft's distribution the i-th draft token was sampled from.

    context: the key of the tokens before first_position (contract.extend_context_key chained over
    them), extended by each draft token: the acceptance test and the target's draw at a position are
    keyed by its whole prefix, as the draft's draw is. A turn that follows text cut by a stop
    condition, or another request with the same seed, then reaches the same positions with fresh
    uniforms, which earlier outcomes (that the k policies learned from) did not use
    (docs/correctness.md, "Randomness").
    """
    if len(q) != len(draft_tokens):
        raise ValueError(f"need one q per draft token, got {len(q)} for {len(draft_tokens)}")
    rng = rng or SeededRandomness(cfg.seed)
    p_all = target_distribution(target_logits, cfg)
    vocab, device = p_all.shape[-1], p_all.device
    k = len(draft_tokens)
    if k:
        q_dense = torch.stack([qi.to_dense(vocab, device) for qi in q])
        accept_probs = acceptance_probabilities(p_all[:k], q_dense, draft_tokens)
    for i in range(k):
        position = first_position + i
        if rng.accept(accept_probs[i], position, STREAM_ACCEPT, context):
            if context:
                context = extend_context_key(context, draft_tokens[i])
            continue
        return VerifyOutcome(i, rng.choose(residual_distribution(p_all[i], q_dense[i]), position,
                                           STREAM_TARGET_SAMPLE, context))
    position = first_position + len(draft_tokens)
    return VerifyOutcome(len(draft_tokens), rng.choose(p_all[len(draft_tokens)], position, STREAM_TARGET_SAMPLE,
                                                       context))
