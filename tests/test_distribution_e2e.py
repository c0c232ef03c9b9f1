"""Sampled speculative decoding is lossless end to end: the joint distribution of the first three
generated tokens, sampled through the real gRPC services (orchestrator + draft worker + target
worker) at temperature 1.0, equals the target model's own distribution.

Models: tiny random Qwen2 models (specdec.models.build_tiny_model) restricted to a vocabulary of
VOCAB = 4 token ids, so that the 3-token joint distribution has at most 4**3 = 64 cells and can be
computed exactly. The draft is the target with weight noise: it disagrees with the target often
(acceptance ~0.75), so rejections and residual sampling are exercised. EOS (257) lies outside the
vocabulary, so every generation runs to max_new_tokens.

Reference: the exact target distribution P(y1, y2, y3) = p(y1|x) p(y2|x,y1) p(y3|x,y1,y2), each
factor being `warp(target logits, SamplingConfig(1.0, top_k, top_p))` (the very function both
workers use), renormalised in float64.

Statistic: Pearson's chi-square of the n sampled 3-token outcomes (seeds 0..n-1) against P over
the cells of P's support (df = |support| - 1, no merging: the design keeps every expected count
>= 1). The test rejects when X^2 exceeds the chi-square (1 - ALPHA) quantile or when any sample
falls outside P's support. The seeds are fixed, so a run is reproducible up to the k choices of
the adaptive default policy (they depend on measured timings); ALPHA = 1e-3 keeps false failures
negligible in any case.

Power statement: let P' be ANY output distribution at total-variation distance delta from P, and
m <= delta the mass P' puts outside P's support. On the support, sum |P' - P| = 2 delta - m, so by
Cauchy-Schwarz the noncentrality lambda = n sum (P' - P)^2 / P >= n (2 delta - m)^2 (= 4 n delta^2
when m = 0), and X^2 is approximately noncentral chi-square(df, lambda). The test therefore
rejects P' with probability at least max(1 - (1 - m)^n, P[ncx2(df, n (2 delta - m)^2) > crit]),
minimised over m in [0, delta]. For each variant, n is the smallest multiple of BATCH at which
this minimum is >= MIN_POWER = 0.9 at delta = DELTA = 0.05 (n = 6560 for df = 63 without warping,
n = 3664 for df = 11 with top-k/top-p), and the test asserts that power.

Variants: default k policy vs fixed k = 3; no warping vs top-k = 3 then top-p = 0.73 (both cut the
target's support: 12 cells instead of 64); min_draft_prob off vs MIN_DRAFT_PROB (checked: with probability
between 0.1 and 0.9 the early stop fires where it can change the output); and the pipelined,
decode-graph, prefill-overlap and guard-flipping rounds of POLICIES. Eight of the 24 variants run in
the default suite (DEFAULT_SUITE: among them fixed k = 3 with min_draft_prob on, which once biased
the output at T > 0, with and without warping; the default policy with top-k/top-p; pipelined
pre-drafts with and without the early stop); the other 16 are marked slow.

Negative control: the same samples are also compared with a deliberately wrong reference, the
target's conditionals sharpened to temperature CONTROL_TEMPERATURE on the same support (TV 0.069
warped, 0.114 unwarped, from P); the statistic must reject it.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

import tests.stack as stack_module
from orchestrator.traces import load_traces
from orchestrator import rounds
from orchestrator.config import SpeculationConfig
from specdec.contract import SamplingConfig
from specdec.model_refs import TinySpec
from specdec.models import LoadedModel, build_tiny_model
from specdec.tokenizers import ByteTokenizer
from specdec.sampling import warp
from specdec.v1 import orchestrator_pb2

VOCAB = 4
TARGET_REF = f"tiny:seed=2,hidden=8,vocab={VOCAB}"
DRAFT_REF = f"tiny:seed=2,hidden=8,noise=0.3,vocab={VOCAB}"
PROMPT = [1, 2, 3, 0]
NEW_TOKENS = 3
TEMPERATURE = 1.0

ALPHA = 1e-3                 # significance level of the goodness-of-fit test
DELTA = 0.05                 # total-variation distance the test must detect ...
MIN_POWER = 0.9              # ... with at least this probability
BATCH = 16                   # concurrent Generate calls
MAX_SAMPLES = 8000           # bounds the runtime of one variant
MIN_EXPECTED = 1.0           # smallest expected cell count for the chi-square approximation
# min_draft_prob per warping, chosen so that the early stop fires at a position whose outcome it can
# change (after a first draft token the target can accept); the test checks this.
MIN_DRAFT_PROB = {"nowarp": 0.4, "topk3-topp0.73": 0.6}
CONTROL_TEMPERATURE = 0.7
# The workers' KV-cached forwards differ from the reference's full forwards by float rounding
# (~1e-6): the target's cumulative masses must keep clear of top_p so the support cannot flip.
MIN_TOP_P_MARGIN = 1e-4

Joint = dict[tuple[int, ...], float]

# "default": the server's cost policy, its k adaptive per round. These models' draft costs what their
# target does and 16 requests share the target, so left to itself it drafted 0.13 tokens per request
# (even with the target 10 ms further away: the load prices drafts out) and the samples tested
# target-only rounds. With min_k = 1 its adaptive k (1..max_k) shapes every request's first round.
POLICIES: dict[str, dict[str, int]] = {"fixed3": {"fixed_k": 3}, "default": {"min_k": 1},
                                        # k = 1 and 2 extra tokens: pre-drafts are used within the
                                        # first 3 tokens (a hit needs 2 tokens left after a round).
                                        "pipelined-k1": {"fixed_k": 1, "pipeline": True},
                                        # The same on the draft's decode graph (static buffers: what
                                        # a CUDA graph replays), batches of steps taking turns on it.
                                        "graph-pipelined-k1": {"fixed_k": 1, "pipeline": True},
                                        # The server's prefill overlap, with the default policy.
                                        "overlap": {},
                                        # The pair guard switching epochs after every counted round.
                                        "guard-flips": {}}
# The pair guard would soon run these tiny models target-only (their draft does not pay): the
# variants that test speculative paths keep it off, and "guard-flips" tests it.
SERVER_SPECULATION = {"default": SpeculationConfig(guard=False),
                      "overlap": SpeculationConfig(overlap_prefill=True, guard=False),
                      "guard-flips": SpeculationConfig(guard_spec_rounds=1, guard_off_rounds=1, guard_margin=0.0,
                                                     guard_rounds_per_session=0)}
EXTRA_TOKENS = {"pipelined-k1": 2, "graph-pipelined-k1": 2}   # generated past NEW_TOKENS; the first NEW_TOKENS are tested
WARPINGS: dict[str, SamplingConfig] = {
    "nowarp": SamplingConfig(TEMPERATURE),
    "topk3-topp0.73": SamplingConfig(TEMPERATURE, top_k=3, top_p=0.73),
}
DEFAULT_SUITE = {("fixed3", "nowarp", MIN_DRAFT_PROB["nowarp"]), ("default", "topk3-topp0.73", 0.0),
                 ("pipelined-k1", "nowarp", 0.0), ("graph-pipelined-k1", "topk3-topp0.73", 0.0),
                 ("overlap", "nowarp", 0.0), ("guard-flips", "nowarp", 0.0),
                 # The early stop with warping, and with pipelined pre-drafts.
                 ("fixed3", "topk3-topp0.73", MIN_DRAFT_PROB["topk3-topp0.73"]),
                 ("pipelined-k1", "nowarp", MIN_DRAFT_PROB["nowarp"])}
VARIANTS = [
    pytest.param(policy, warping, min_draft_prob, id=f"{policy}-{warping}-mdp{min_draft_prob}",
                 marks=() if (policy, warping, min_draft_prob) in DEFAULT_SUITE else pytest.mark.slow)
    for policy in POLICIES for warping in WARPINGS for min_draft_prob in (0.0, MIN_DRAFT_PROB[warping])
]

# ----------------------------------------------------------------------------- models

_MODELS: dict[str, LoadedModel] = {}


def small_vocab_model(ref: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The tiny model of `ref` restricted to its first `vocab` token ids.

    build_tiny_model cannot build a vocabulary below 259 (PAD = 258 is the embedding's
    padding_idx), so the model is built with the default 260 ids and its embedding and LM-head rows
    are cut to the first `vocab`: its logits are the full model's logits on ids < vocab.
    """
    assert dtype == torch.float32, "the exact reference is computed in float32"
    if ref not in _MODELS:
        spec = TinySpec.parse(ref)
        model = build_tiny_model(dataclasses.replace(spec, vocab=TinySpec.vocab))
        with torch.no_grad():
            embed = torch.nn.Embedding(spec.vocab, spec.hidden)
            embed.weight.copy_(model.get_input_embeddings().weight[:spec.vocab])
            head = torch.nn.Linear(spec.hidden, spec.vocab, bias=False)
            head.weight.copy_(model.get_output_embeddings().weight[:spec.vocab])
        model.set_input_embeddings(embed)
        model.set_output_embeddings(head)
        model.config.vocab_size = spec.vocab
        tokenizer = ByteTokenizer(spec.vocab)
        _MODELS[ref] = LoadedModel(ref, model.eval(), tokenizer, spec.vocab, spec.max_positions,
                                   tokenizer.eos_token_ids)
    return _MODELS[ref]


@pytest.fixture
def small_vocab_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_stack's workers load the small-vocabulary models (the orchestrator's ByteTokenizer and
    the workers' tokenizer fingerprints then agree on the vocabulary size)."""
    monkeypatch.setattr(stack_module, "cached_model", small_vocab_model)


@torch.no_grad()
def last_logits(model: torch.nn.Module, context: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([context]), use_cache=False).logits[0, -1]


def next_token_probs(model: torch.nn.Module, context: list[int], cfg: SamplingConfig) -> torch.Tensor:
    probs = warp(last_logits(model, context), cfg).to(torch.float64)
    return probs / probs.sum()


def exact_joint(model: torch.nn.Module, prompt: list[int], cfg: SamplingConfig, length: int,
                sharpen: float = 1.0) -> Joint:
    """P(y1..y_length | prompt) for every sequence in the support, by the chain rule.

    sharpen != 1 raises every warped conditional to that power (renormalised on the same support):
    the wrong reference of the negative control.
    """
    joint: Joint = {(): 1.0}
    for _ in range(length):
        longer: Joint = {}
        for prefix, mass in joint.items():
            probs = next_token_probs(model, prompt + list(prefix), cfg) ** sharpen
            probs = probs / probs.sum()
            for token in torch.nonzero(probs > 0).flatten().tolist():
                longer[prefix + (token,)] = mass * float(probs[token])
        joint = longer
    return joint


def top_p_margin(model: torch.nn.Module, prompt: list[int], cfg: SamplingConfig, joint: Joint) -> float:
    """Smallest distance between top_p and a cumulative mass that decides the top-p cut, over the
    contexts the joint distribution reaches (inf without top-p)."""
    if cfg.top_p >= 1.0:
        return float("inf")
    contexts = {cell[:i] for cell in joint for i in range(len(cell))}
    margin = float("inf")
    for prefix in contexts:
        probs = warp(last_logits(model, prompt + list(prefix)), dataclasses.replace(cfg, top_p=1.0))
        kept = torch.sort(probs.to(torch.float64), descending=True).values
        kept = kept[kept > 0]
        mass_before = torch.cumsum(kept, dim=0) - kept
        margin = min(margin, float((mass_before - cfg.top_p).abs().min()))
    return margin


def total_variation(a: Joint, b: Joint) -> float:
    return 0.5 * sum(abs(a.get(cell, 0.0) - b.get(cell, 0.0)) for cell in a.keys() | b.keys())

# ----------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Fit:
    n: int
    chi2: float
    df: int
    p_value: float
    tv: float          # empirical TV between the sample's frequencies and the reference
    outside: int       # samples outside the reference's support

    def rejects(self, alpha: float = ALPHA) -> bool:
        return self.outside > 0 or self.p_value < alpha

    def __str__(self) -> str:
        return (f"n={self.n} X2={self.chi2:.1f} df={self.df} p={self.p_value:.3g} "
                f"empirical TV={self.tv:.4f} outside support={self.outside}")


def pearson_fit(counts: Counter[tuple[int, ...]], reference: Joint) -> Fit:
    n = sum(counts.values())
    cells = sorted(reference)
    probs = np.array([reference[cell] for cell in cells])
    observed = np.array([counts.get(cell, 0) for cell in cells], dtype=np.float64)
    chi2 = float(((observed - n * probs) ** 2 / (n * probs)).sum())
    df = len(cells) - 1
    outside = n - int(observed.sum())
    tv = 0.5 * (float(np.abs(observed / n - probs).sum()) + outside / n)
    return Fit(n, chi2, df, float(stats.chi2.sf(chi2, df)), tv, outside)


def min_power(n: int, df: int, alpha: float = ALPHA, delta: float = DELTA, grid: int = 400) -> float:
    """Lower bound on the rejection probability over all alternatives at TV distance `delta`
    (see the module docstring). On a grid cell [m_i, m_i+1] both detection routes are bounded
    below by their values at the cell's worse end, so the bound holds between grid points too."""
    crit = stats.chi2.isf(alpha, df)
    m = np.linspace(0.0, delta, grid + 1)
    by_outside = -np.expm1(n * np.log1p(-m))                      # 1 - (1 - m)^n
    by_chi2 = stats.ncx2.sf(crit, df, n * (2.0 * delta - m) ** 2)
    return float(np.min(np.maximum(by_outside[:-1], by_chi2[1:])))


def required_samples(df: int) -> int:
    """Smallest multiple of BATCH with min_power >= MIN_POWER (bisection; power grows with n)."""
    lo, hi = 1, MAX_SAMPLES // BATCH
    assert min_power(hi * BATCH, df) >= MIN_POWER, f"df={df} needs more than {MAX_SAMPLES} samples"
    while lo < hi:
        mid = (lo + hi) // 2
        if min_power(mid * BATCH, df) >= MIN_POWER:
            hi = mid
        else:
            lo = mid + 1
    return lo * BATCH

# ----------------------------------------------------------------------------- sampling


@dataclass
class Sample:
    counts: Counter[tuple[int, ...]] = dataclasses.field(default_factory=Counter)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    predraft_hits: int = 0
    guard_off_rounds: int = 0


async def sample_outputs(stack: stack_module.Stack, n: int, cfg: SamplingConfig,
                         speculation: dict[str, float], extra_tokens: int = 0) -> Sample:
    """n generations of NEW_TOKENS + extra_tokens; the first NEW_TOKENS of each are counted (the joint
    of a prefix does not depend on how many tokens follow it)."""
    warping: dict[str, float] = {}
    if cfg.top_k:
        warping["top_k"] = cfg.top_k
    if cfg.top_p < 1.0:
        warping["top_p"] = cfg.top_p
    sample = Sample()
    for start in range(0, n, BATCH):
        replies = await asyncio.gather(*(
            stack.generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS + extra_tokens, temperature=cfg.temperature,
                           seed=seed, speculation=speculation, **warping)
            for seed in range(start, min(start + BATCH, n))))
        for reply in replies:
            assert len(reply.token_ids) == NEW_TOKENS + extra_tokens, list(reply.token_ids)
            assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
            sample.counts[tuple(reply.token_ids[:NEW_TOKENS])] += 1
            sample.predraft_hits += reply.stats.predraft_hits
            sample.guard_off_rounds += reply.stats.guard_off_rounds
            sample.draft_tokens += reply.stats.draft_tokens
            sample.accepted_tokens += reply.stats.accepted_tokens
    return sample

# ----------------------------------------------------------------------------- test


@pytest.mark.parametrize(("policy", "warping", "min_draft_prob"), VARIANTS)
async def test_first_tokens_follow_target_distribution(small_vocab_models: None, policy: str, warping: str,
                                                       min_draft_prob: float, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    cfg = WARPINGS[warping]
    target = small_vocab_model(TARGET_REF).model
    reference = exact_joint(target, PROMPT, cfg, NEW_TOKENS)
    assert abs(sum(reference.values()) - 1.0) < 1e-9

    # Design checks: sample size and power, chi-square approximation, a meaningful draft and threshold.
    df = len(reference) - 1
    n = required_samples(df)
    power = min_power(n, df)
    assert power >= MIN_POWER, f"power {power:.3f} at TV {DELTA} with n={n}, df={df}"
    assert n * min(reference.values()) >= MIN_EXPECTED, "a cell's expected count is too small"
    uniform = {cell: 1.0 / len(reference) for cell in reference}
    assert total_variation(reference, uniform) > 0.15, "the target's distribution is nearly uniform"
    draft = small_vocab_model(DRAFT_REF).model
    assert total_variation(reference, exact_joint(draft, PROMPT, cfg, NEW_TOKENS)) > 0.2, "draft ~ target"
    if min_draft_prob > 0:
        # The stop is decided before drawing, from the draft's max probability at the next position.
        # It matters when it fires at position 1, or at position 2 after a first token the target
        # can accept (after one it always rejects, the output is the same either way).
        q1, p1 = next_token_probs(draft, PROMPT, cfg), next_token_probs(target, PROMPT, cfg)
        matters = 1.0 if float(q1.max()) < min_draft_prob else sum(
            float(q1[x]) for x in range(VOCAB)
            if q1[x] > 0 and p1[x] > 0 and float(next_token_probs(draft, PROMPT + [x], cfg).max()) < min_draft_prob)
        assert 0.1 < matters < 0.9, f"min_draft_prob={min_draft_prob}: the early stop matters with p={matters:.3f}"
    assert top_p_margin(target, PROMPT, cfg, reference) >= MIN_TOP_P_MARGIN, "top-p cut too close to call"
    control = exact_joint(target, PROMPT, cfg, NEW_TOKENS, sharpen=1.0 / CONTROL_TEMPERATURE)
    control_tv = total_variation(reference, control)
    assert 0.05 <= control_tv <= 0.2, f"control reference at TV {control_tv:.3f}: not a near miss"

    speculation: dict[str, float] = dict(POLICIES[policy])
    if min_draft_prob > 0:
        speculation["min_draft_prob"] = min_draft_prob
    # The server keeps its default speculation config ("default" policy = its k policy; min_draft_prob 0).
    if policy == "overlap":  # the test's prompt is short: let it count as one worth overlapping
        monkeypatch.setattr(rounds, "OVERLAP_MIN_PREFILL", 0)
    pipelined = bool(speculation.get("pipeline")) or policy == "overlap"
    trace_file = tmp_path / "rounds.jsonl" if pipelined else None
    stack = await stack_module.start_stack(target_ref=TARGET_REF, draft_ref=DRAFT_REF, max_concurrent=BATCH,
                                           max_queue=2 * BATCH,
                                           speculation=SERVER_SPECULATION.get(policy, SpeculationConfig()),
                                           trace_file=str(trace_file) if trace_file else None)
    if policy.startswith("graph-"):
        stack.draft.core.enable_decode_graph(capture=False, max_len=64, smallest=8)
        assert stack.draft.core.decode_graph is not None, stack.draft.core.decode_path
        stack.draft.core.graph_batch_limit = BATCH
    try:
        sample = await sample_outputs(stack, n, cfg, speculation, EXTRA_TOKENS.get(policy, 0))
        graph_steps = stack.draft.core.counters.graph_steps
    finally:
        await stack.close()
    if policy.startswith("graph-"):
        assert graph_steps > n, f"{graph_steps} decode-graph steps in {n} requests"

    assert sample.draft_tokens > 0, "the speculative path never ran"
    if policy == "default":  # speculative rounds shape most samples, not a few
        assert sample.draft_tokens >= n, f"drafted {sample.draft_tokens} tokens in {n} requests"
    if pipelined:
        # Pre-draft hits must shape the tested tokens: hit rounds that begin within the first
        # NEW_TOKENS (a hit past them, in the extra tokens, tests nothing here). "overlap": round 1
        # is sampled by the target alone while the draft pre-drafts; round 2 uses that pre-draft
        # on a hit (orchestrator/rounds.py). How often depends on the cost policy's k under the
        # test's concurrent load.
        in_window = sum(1 for t in load_traces(trace_file)
                        if t.predraft == "hit" and t.position - len(PROMPT) < NEW_TOKENS)
        print(f"pre-draft hits within the tested tokens: {in_window} in {n} requests")
        assert in_window > 0.025 * n, f"pre-draft hits within the tested tokens: {in_window} in {n} requests"
    if policy == "guard-flips":  # both kinds of epoch are in the sample
        assert sample.guard_off_rounds > 0.05 * n, f"{sample.guard_off_rounds} forced k = 0 rounds in {n} requests"
    fit = pearson_fit(sample.counts, reference)
    control_fit = pearson_fit(sample.counts, control)
    acceptance = sample.accepted_tokens / sample.draft_tokens
    summary = (f"{fit}; design: alpha={ALPHA}, power >= {power:.3f} against any TV >= {DELTA}; "
               f"drafted {sample.draft_tokens / n:.2f} tokens/request, acceptance {acceptance:.2f}; "
               f"control (target sharpened to T={CONTROL_TEMPERATURE}, TV {control_tv:.3f}): {control_fit}")
    print(summary)
    assert not fit.rejects(), f"output distribution differs from the target's: {summary}"
    # Negative control: the same samples reject a reference that is wrong by TV ~0.1.
    assert control_fit.rejects(), f"the statistic did not reject a wrong reference: {summary}"
