"""Sampling building blocks, and a Monte Carlo check of the round with the service's own seeded
randomness (propose_tokens + verify_sampled, uniforms from the counter-based hash) against the target.
The exact proof of the rule is tests/test_lossless_enumeration.py."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from scipy.stats import chisquare

from specdec import sampling
from specdec.contract import EMPTY_CONTEXT_KEY, extend_context_key
from specdec.sampling import (SamplingConfig, SeededRandomness, acceptance_probability, propose_tokens,
                              target_distribution, verify_greedy, verify_sampled, warp)

V = 5


@functools.lru_cache(maxsize=None)
def table_logits(seed: int, prefix: tuple[int, ...], scale: float = 2.0) -> torch.Tensor:
    """Deterministic pseudo-model: logits depend on (seed, prefix)."""
    g = torch.Generator().manual_seed(hash((seed, prefix)) & 0xFFFFFFFF)
    return torch.randn(V, generator=g) * scale


def disjoint_logits(which: int, prefix: tuple[int, ...]) -> torch.Tensor:
    """Target puts its mass on tokens {0,1}, draft on {3,4}: supports never overlap."""
    logits = torch.full((V,), -1e9)
    ids = [0, 1] if which == 0 else [3, 4]
    logits[ids] = table_logits(which, prefix)[ids]
    return logits


CASES = {
    # name: (cfg, target logits fn, draft logits fn)
    "temperature": (SamplingConfig(temperature=0.8), lambda p: table_logits(1, p), lambda p: table_logits(2, p)),
    "top_k": (SamplingConfig(temperature=1.0, top_k=3), lambda p: table_logits(1, p), lambda p: table_logits(2, p)),
    "top_p": (SamplingConfig(temperature=1.2, top_p=0.7), lambda p: table_logits(1, p), lambda p: table_logits(2, p)),
    "p_equals_q": (SamplingConfig(temperature=1.0), lambda p: table_logits(1, p), lambda p: table_logits(1, p)),
    "disjoint": (SamplingConfig(temperature=1.0), lambda p: disjoint_logits(0, p), lambda p: disjoint_logits(1, p)),
    "all_options": (SamplingConfig(temperature=0.7, top_k=4, top_p=0.9), lambda p: table_logits(3, p),
                    lambda p: table_logits(4, p)),
}


def target_seq_prob(target, seq: tuple[int, ...], cfg: SamplingConfig) -> float:
    prob = 1.0
    for i in range(len(seq)):
        prob *= float(target_distribution(target(seq[:i]), cfg)[seq[i]])
    return prob


def run_round(target, draft, cfg: SamplingConfig, k: int, seed: int, max_q: int = V,
              verify=verify_sampled) -> tuple[int, ...]:
    """One real round (propose_tokens, then verify) with the service's seeded randomness."""
    cfg = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p, seed)
    fed: list[int] = []

    def feed(token: int) -> torch.Tensor:
        fed.append(token)
        return draft(tuple(fed))

    proposal = propose_tokens(draft(()), feed, k, cfg, 0, max_q, 0.0, SeededRandomness(seed))
    drafts = proposal.tokens
    rows = torch.stack([target(tuple(drafts[:i])) for i in range(k + 1)])
    outcome = verify(rows, drafts, proposal.q, cfg, 0)
    return tuple(drafts[:outcome.accepted_len]) + (outcome.next_token,)


def monte_carlo_pvalue(case: str, k: int, n: int, verify=verify_sampled) -> float:
    """Chi-square of the round's first two tokens (extended by the target when 1 token) vs the target."""
    cfg, target, draft = CASES[case]
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        out = run_round(target, draft, cfg, k, seed, verify=verify)
        if len(out) == 1:  # extend with the target alone, deterministic per seed
            nxt = sampling.sample_index(warp(target(out), cfg), sampling.uniform(seed, 99, 7))
            out = out + (nxt,)
        key = out[:2]
        counts[key] = counts.get(key, 0) + 1
    cells = [(a, b) for a in range(V) for b in range(V)]
    expected = [n * target_seq_prob(target, c, cfg) for c in cells]
    keep = [i for i, e in enumerate(expected) if e > 0]
    assert all(counts.get(c, 0) == 0 for i, c in enumerate(cells) if i not in keep), "sampled outside target support"
    observed = [counts.get(cells[i], 0) for i in keep]
    exp = [expected[i] for i in keep]
    exp = [e * sum(observed) / sum(exp) for e in exp]
    return float(chisquare(observed, exp).pvalue)


# The exact proof is the enumeration in test_lossless_enumeration.py (every case there); this checks the
# service's own uniforms (hash -> inverse CDF) end to end on the cases with the most varied decisions.
@pytest.mark.parametrize("case", ["all_options", "disjoint", "temperature"])
def test_monte_carlo_distribution_matches_target(case: str) -> None:
    # Seeds are fixed (0..n-1), so this is deterministic, not flaky.
    assert monte_carlo_pvalue(case, k=3, n=4000) > 1e-3


def test_monte_carlo_detects_a_wrong_sampler() -> None:
    """Negative control: resampling from p instead of the residual is biased, and the test sees it."""
    def biased_verify(rows, drafts, qs, cfg, first_position):
        p_all = warp(rows, cfg).double()
        for i, d in enumerate(drafts):
            q = qs[i].to_dense(V)
            if sampling.uniform(cfg.seed, first_position + i, 2) >= acceptance_probability(p_all[i], q, d):
                z = sampling.sample_index(p_all[i], sampling.uniform(cfg.seed, first_position + i, 3))
                return sampling.VerifyOutcome(i, z)
        return sampling.VerifyOutcome(len(drafts), sampling.sample_index(p_all[len(drafts)], 0.5))
    assert monte_carlo_pvalue("temperature", k=3, n=4000, verify=biased_verify) < 1e-6


def test_bonus_token_when_all_accepted() -> None:
    cfg, target, draft = CASES["p_equals_q"]
    outs = [run_round(target, draft, cfg, 4, seed) for seed in range(200)]
    assert all(len(o) == 5 for o in outs)  # p == q: every draft accepted, plus the bonus token


def test_warp_top_k_and_top_p() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = warp(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[2:] == 0).all() and math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    full = torch.softmax(logits, -1)
    probs = warp(logits, SamplingConfig(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (probs > 0).sum() == 2  # the smallest prefix reaching top_p
    probs = warp(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    assert (probs > 0).sum() == 1 and float(probs[0]) == 1.0


def reference_warp(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Temperature, then top-k, then top-p (the smallest most-likely prefix whose mass reaches top_p),
    written out in plain Python floats, independently of specdec.sampling."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = set(order[:top_k] if 0 < top_k < len(scaled) else order)
    peak = max(scaled[i] for i in kept)
    weights = [math.exp(scaled[i] - peak) if i in kept else 0.0 for i in range(len(scaled))]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in sorted(kept, key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += probs[i]
        probs = [p / mass if i in nucleus else 0.0 for i, p in enumerate(probs)]
    return probs


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_warp_matches_an_independent_reference_and_hf_warpers_away_from_temperature_one(temperature: float) -> None:
    """warp is the function both workers and every distribution test's reference use, so a bug in it
    (logits times T, top-p before top-k) would pass them all: here it meets a plain-Python
    reference and transformers' own warpers (what HF generate samples from), at T != 1 too."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    generator = torch.Generator().manual_seed(int(temperature * 10))
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6), (3, 0.95)]:
        for _ in range(5):
            logits = torch.randn(12, generator=generator, dtype=torch.float64) * 2.0
            got = warp(logits, SamplingConfig(temperature, top_k=top_k, top_p=top_p)).to(torch.float64)
            want = torch.tensor(reference_warp(logits.tolist(), temperature, top_k, top_p), dtype=torch.float64)
            assert torch.allclose(got, want, atol=1e-6), (temperature, top_k, top_p, got, want)
            scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
            if top_k:
                scores = TopKLogitsWarper(top_k)(None, scores)
            if top_p < 1.0:
                scores = TopPLogitsWarper(top_p)(None, scores)
            hf = torch.softmax(scores, dim=-1)[0]
            assert torch.allclose(got, hf, atol=1e-6), (temperature, top_k, top_p, got, hf)


def test_verify_greedy() -> None:
    rows = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert verify_greedy(rows, [1, 0]) == sampling.VerifyOutcome(2, 2)  # all accepted, bonus argmax
    assert verify_greedy(rows, [1, 2]) == sampling.VerifyOutcome(1, 0)  # correction at the mismatch
    assert verify_greedy(rows[:1], []) == sampling.VerifyOutcome(0, 1)  # k = 0: plain decoding


def test_uniforms_are_reproducible_and_distinct() -> None:
    """The draft and target processes (and two versions of them in a rolling upgrade) must draw the
    same uniforms: pinned values, and the same values in a process with another hash seed."""
    import os
    import subprocess
    import sys
    pinned = {(7, 3, 1, 0): 0.8349855037922129, (2**63 + 5, 100, 2, 9): 0.3359650900526814}
    for (seed, position, stream, context), value in pinned.items():
        assert sampling.uniform(seed, position, stream, context) == value
    code = ("from specdec import sampling; print(repr(sampling.uniform(7, 3, 1)), "
            "repr(sampling.uniform(2**63 + 5, 100, 2, context=9)))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert [float(v) for v in other.stdout.split()] == list(pinned.values())
    values = {sampling.uniform(7, pos, stream) for pos in range(100) for stream in (1, 2, 3)}
    assert len(values) == 300 and all(0.0 <= v < 1.0 for v in values)


def test_top_p_breaks_ties_by_token_id() -> None:
    """Tied probabilities are ordered by token id (a stable sort), so both workers keep the same set."""
    for vocab, top_p, kept in ((8, 0.3, 3), (4096, 0.01, 41)):
        probs = warp(torch.zeros(vocab), SamplingConfig(temperature=1.0, top_p=top_p))
        assert probs.nonzero().flatten().tolist() == list(range(kept))


def test_tiny_temperature_is_greedy_and_non_finite_is_invalid() -> None:
    assert SamplingConfig(temperature=1e-38).greedy and SamplingConfig(temperature=0.0).greedy
    assert not SamplingConfig(temperature=1e-3).greedy
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
            SamplingConfig(temperature=bad).validate()


def test_the_draft_worker_keys_each_draw_by_its_whole_prefix(monkeypatch) -> None:
    """Each draft draw's context is the key of the session's tokens (extend_context_key chained over
    them), extended by the tokens drafted before it: the same prefix draws the same uniform (a pre-draft reproduces the serial
    draft), another prefix at the same position a fresh one (see
    test_lossless_enumeration.test_a_k_that_reads_thrown_away_drafts_leaves_the_output_the_targets)."""
    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import EMPTY_CONTEXT_KEY, Commit, extend_context_key, prefix_hash
    from specdec.models import load_model
    from specdec.worker_core import WorkerCore

    seen: list[tuple[int, int]] = []
    choose = SeededRandomness.choose
    monkeypatch.setattr(SeededRandomness, "choose", lambda self, probs, position, stream, context=0:
                        seen.append((position, context)) or choose(self, probs, position, stream, context))
    engine = DraftEngine(WorkerCore(load_model("tiny:seed=0,noise=0.03"), "draft"))
    cfg = SamplingConfig(temperature=1.0, seed=3)
    prompt = [5, 6, 7, 8]
    drafts = engine.propose(ProposeParams("a", Commit(0, 0, tuple(prompt)), 3, cfg)).tokens
    context = EMPTY_CONTEXT_KEY
    for token in prompt:
        context = extend_context_key(context, token)
    expected = []
    for i, token in enumerate(drafts):
        expected.append((len(prompt) + i, context))
        context = extend_context_key(context, token)
    assert seen == expected and len({c for _, c in seen}) == 3
    seen.clear()
    assert engine.propose(ProposeParams("b", Commit(0, 0, tuple(prompt)), 3, cfg)).tokens == drafts
    assert seen == expected  # a session with the same prefix draws the same uniforms
    seen.clear()
    engine.propose(ProposeParams("c", Commit(0, 0, tuple(prompt[:-1] + [9])), 1, cfg))
    assert seen[0][0] == len(prompt) and seen[0][1] != expected[0][1]  # same position, another prefix

    def key_of(tokens: list[int]) -> int:
        key = EMPTY_CONTEXT_KEY
        for token in tokens:
            key = extend_context_key(key, token)
        return key

    # The keys are cut with the tokens: a crop, a fork from a longer slot, a fresh start.
    held = engine.core.session_tokens("a")
    for commit, slot, fork_from in ((Commit(3, prefix_hash(held[:3]), (77, 78)), 0, None),
                                    (Commit(2, prefix_hash(held[:2]), (79,)), 1, 0),
                                    (Commit(0, 0, (80,)), 0, None)):
        seen.clear()
        engine.propose(ProposeParams("a", commit, 2, cfg, slot=slot, fork_from=fork_from))
        base = ([] if commit.cache_len == 0 else held[:commit.cache_len]) + list(commit.append_tokens)
        assert seen[0] == (len(base), key_of(base))
        held = engine.core.session_tokens("a")


def test_the_draft_drafts_only_ids_its_tokenizer_knows() -> None:
    """A draft model with padding rows past its tokenizer's ids, beside a target with fewer rows: q and the drafts stay within the tokenizer, so the target
    accepts them (it refused the verify, INVALID_ARGUMENT, for ids past its own rows)."""
    import dataclasses

    from draft_worker.engine import DraftEngine, ProposeParams
    from specdec.contract import Commit
    from specdec.models import ByteTokenizer, load_model
    from specdec.worker_core import WorkerCore
    from target_worker.engine import TargetEngine, VerifyParams

    padded = dataclasses.replace(load_model("tiny:seed=0,vocab=300"), tokenizer=ByteTokenizer(260))
    draft = DraftEngine(WorkerCore(padded, "draft"))
    target = TargetEngine(WorkerCore(load_model("tiny:seed=0,vocab=260"), "target"))
    assert draft.draftable == 260
    prompt = (1, 2, 3, 4)
    for seed in range(10):
        cfg = SamplingConfig(temperature=1.5, seed=seed)
        proposal = draft.propose(ProposeParams(f"s{seed}", Commit(0, 0, prompt), 3, cfg))
        assert all(int(q.token_ids.max()) < 260 for q in proposal.q) and max(proposal.tokens) < 260
        target.verify(VerifyParams(f"s{seed}", Commit(0, 0, prompt), tuple(proposal.tokens), tuple(proposal.q), cfg))


class RecordingRandomness:
    """Accepts the first `accepts` drafts, then rejects; records the keys of every decision."""

    def __init__(self, accepts: int) -> None:
        self.accepts, self.calls = accepts, []

    def accept(self, probability: float, position: int, stream: int, context: int = 0) -> bool:
        self.calls.append(("accept", position, stream, context))
        return len([c for c in self.calls if c[0] == "accept"]) <= self.accepts

    def choose(self, probs: torch.Tensor, position: int, stream: int, context: int = 0) -> int:
        self.calls.append(("choose", position, stream, context))
        return int(torch.argmax(probs))


@pytest.mark.parametrize("accepts", [0, 2, 3])
def test_verify_keys_acceptance_and_target_draws_by_their_whole_prefix(accepts: int) -> None:
    """Each acceptance test and the target's draw are keyed by the tokens before their position (the
    prefix key extended by each accepted draft), as the draft's draws are: text cut by a stop
    condition, or another request with the same seed, meets these positions with fresh uniforms."""
    cfg, target, draft = CASES["temperature"]
    drafts = [1, 2, 0]
    rows = torch.stack([target(tuple(drafts[:i])) for i in range(4)])
    q = [sampling.sparsify(warp(draft(tuple(drafts[:i])), cfg), V) for i in range(3)]
    before = extend_context_key(EMPTY_CONTEXT_KEY, 7)
    rng = RecordingRandomness(accepts)
    outcome = sampling.verify_sampled(rows, drafts, q, cfg, 10, rng, context=before)
    assert outcome.accepted_len == accepts
    keys = [before]
    for token in drafts:
        keys.append(extend_context_key(keys[-1], token))
    expected = [("accept", 10 + i, 2, keys[i]) for i in range(min(accepts + 1, 3))]
    expected.append(("choose", 10 + accepts, 3, keys[accepts]))
    assert rng.calls == expected
    # The service's own uniforms: a different prefix at the same seed and position draws afresh.
    assert sampling.uniform(cfg.seed, 10, 2, keys[0]) != sampling.uniform(cfg.seed, 10, 2, keys[1])
