"""Exact enumeration of the production round: the output distribution equals the target's.

No reimplementation of the round: the draft runs `sampling.propose_tokens` (what the draft worker
runs), q crosses the same protobuf conversion as on the wire, and the target runs `verify_sampled` /
`verify_greedy` (what the target worker runs); the orchestrator's rule for k (never past the token
budget) and `VerifyOutcome.emitted` compose rounds. Only the source of randomness is swapped: a
`ScriptedRandomness` answers each decision from a script and, at the first unscripted one, reports
every possible outcome with its probability. A depth-first search re-runs the production code once
per branch, so each leaf is one exact path through it and its weight is the product of the branch
probabilities. Rounds repeat until n tokens are out; the resulting joint distribution of the first n
tokens is compared with the target's autoregressive product. Max |difference| < 1e-9 in float64.

The mapping from a uniform to a decision (`SeededRandomness`) is tested separately below and by the
Monte Carlo and end-to-end tests.
"""
from __future__ import annotations

import collections
import functools
import math
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from specdec.sampling import SparseDist
from orchestrator.rounds import branch_points
from specdec.sampling import (Draft, SamplingConfig, SeededRandomness, propose_tokens, sample_index,
                              target_distribution, uniform, verify_greedy, verify_sampled)

TOLERANCE = 1e-9

LogitsFn = Callable[[tuple[int, ...]], torch.Tensor]


class Branch(Exception):
    """Raised at the first unscripted decision: every outcome with its probability."""

    def __init__(self, options: list[tuple[int, float]]) -> None:
        super().__init__(options)
        self.options = options


class ScriptedRandomness:
    def __init__(self, script: tuple[int, ...]) -> None:
        self.script = script
        self.used = 0

    def _decide(self, options: list[tuple[int, float]]) -> int:
        if self.used < len(self.script):
            self.used += 1
            return self.script[self.used - 1]
        raise Branch([(value, weight) for value, weight in options if weight > 0])

    def choose(self, probs: torch.Tensor, position: int, stream: int, context: int = 0) -> int:
        p = probs.to(torch.float64)
        p = p / p.sum()
        return self._decide([(i, float(p[i])) for i in range(p.shape[0])])

    def accept(self, probability: float, position: int, stream: int, context: int = 0) -> bool:
        return bool(self._decide([(1, probability), (0, 1.0 - probability)]))


def enumerate_paths(run: Callable[[ScriptedRandomness], tuple[int, ...]]) -> list[tuple[tuple[int, ...], float]]:
    """Every (result, probability) of `run` over all decision paths."""
    leaves: list[tuple[tuple[int, ...], float]] = []
    pending: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while pending:
        script, weight = pending.pop()
        try:
            result = run(ScriptedRandomness(script))
        except Branch as branch:
            pending.extend((script + (value,), weight * w) for value, w in branch.options)
            continue
        leaves.append((result, weight))
    return leaves


@dataclass(frozen=True)
class Case:
    cfg: SamplingConfig
    target: LogitsFn
    draft: LogitsFn
    vocab: int
    min_draft_prob: float = 0.0
    max_q: int = 256


def production_round(case: Case, context: tuple[int, ...], k: int, rng) -> tuple[int, ...]:
    """One round as the services run it: propose on the draft, q over the wire, verify on the target."""
    position = len(context)
    fed = list(context)

    def feed(token: int) -> torch.Tensor:
        fed.append(token)
        return case.draft(tuple(fed))

    draft: Draft = propose_tokens(case.draft(context), feed, k, case.cfg, position, case.max_q,
                                  case.min_draft_prob, rng)
    rows = torch.stack([case.target(context + tuple(draft.tokens[:i])) for i in range(len(draft.tokens) + 1)])
    if case.cfg.greedy:
        outcome = verify_greedy(rows, draft.tokens)
    else:
        wire_q = [SparseDist.from_pb(q.to_pb()) for q in draft.q]
        outcome = verify_sampled(rows, draft.tokens, wire_q, case.cfg, position, rng)
    return tuple(outcome.emitted(draft.tokens))


def generation_distribution(case: Case, n_tokens: int, k_for: Callable[[tuple[int, ...]], int],
                            round_fn=production_round) -> dict[tuple[int, ...], float]:
    """Exact joint distribution of the first n_tokens generated, round after round."""

    @functools.lru_cache(maxsize=None)
    def dist(context: tuple[int, ...], remaining: int) -> dict[tuple[int, ...], float]:
        if remaining == 0:
            return {(): 1.0}
        # The orchestrator's rule: a round yields up to k+1 tokens, never past the budget.
        k = max(0, min(k_for(context), remaining - 1))
        out: dict[tuple[int, ...], float] = {}
        for emitted, weight in enumerate_paths(lambda rng: round_fn(case, context, k, rng)):
            emitted = emitted[:remaining]
            for tail, w in dist(context + emitted, remaining - len(emitted)).items():
                out[emitted + tail] = out.get(emitted + tail, 0.0) + weight * w
        return out

    return dist((), n_tokens)


def target_joint(case: Case, n_tokens: int) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(case.vocab), repeat=n_tokens):
        prob = 1.0
        for i in range(n_tokens):
            if case.cfg.greedy:
                prob *= float(int(torch.argmax(case.target(seq[:i]))) == seq[i])
            else:
                prob *= float(target_distribution(case.target(seq[:i]), case.cfg)[seq[i]])
        out[seq] = prob
    return out


def max_abs_difference(case: Case, n_tokens: int, k_for: Callable[[tuple[int, ...]], int],
                       round_fn=production_round) -> float:
    got = generation_distribution(case, n_tokens, k_for, round_fn)
    want = target_joint(case, n_tokens)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE
    assert set(got) <= set(want)
    return max(abs(got.get(seq, 0.0) - p) for seq, p in want.items())


# ----------------------------------------------------------------------------- pseudo-models

def table_model(seed: int, vocab: int, scale: float = 2.0) -> LogitsFn:
    """Deterministic pseudo-model: logits are a fixed random function of the prefix."""
    @functools.lru_cache(maxsize=None)
    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, vocab, prefix)) & 0x7FFFFFFF)
        return torch.randn(vocab, generator=g) * scale
    return logits


def restricted(model: LogitsFn, vocab: int, allowed: list[int]) -> LogitsFn:
    """The model's logits with every token outside `allowed` at -inf (disjoint supports)."""
    @functools.lru_cache(maxsize=None)
    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        out = torch.full((vocab,), float("-inf"))
        out[allowed] = model(prefix)[allowed]
        return out
    return logits


def make_case(name: str, vocab: int) -> Case:
    """The early-stop thresholds let the draft start at the root and stop at some deeper positions,
    at vocabulary 3 and 4 (test_the_early_stop_cases_really_stop_early checks it)."""
    target, draft = table_model(1, vocab), table_model(2, vocab)
    t1 = SamplingConfig(temperature=1.0, seed=0)
    cases = {
        "temperature": Case(SamplingConfig(temperature=0.7), target, draft, vocab),
        "hot": Case(SamplingConfig(temperature=1.8), target, draft, vocab),
        "top_k": Case(SamplingConfig(temperature=1.0, top_k=2), target, draft, vocab),
        "top_p": Case(SamplingConfig(temperature=1.2, top_p=0.7), target, draft, vocab),
        "all_options": Case(SamplingConfig(temperature=0.9, top_k=vocab - 1, top_p=0.85), target, draft, vocab),
        "p_equals_q": Case(t1, target, target, vocab),
        "disjoint": Case(t1, restricted(target, vocab, [0, 1]), restricted(draft, vocab, list(range(2, vocab))),
                         vocab),
        "truncated_q": Case(t1, target, draft, vocab, max_q=2),
        "min_draft_prob": Case(t1, target, draft, vocab, min_draft_prob=0.475),
        "min_draft_prob_top_p": Case(SamplingConfig(temperature=0.8, top_p=0.9), target, draft, vocab,
                                     min_draft_prob=0.52),
        "greedy": Case(SamplingConfig(), target, draft, vocab),
        "greedy_min_draft_prob": Case(SamplingConfig(), target, draft, vocab, min_draft_prob=0.475),
    }
    return cases[name]


CASE_NAMES = ["temperature", "hot", "top_k", "top_p", "all_options", "p_equals_q", "disjoint", "truncated_q",
              "min_draft_prob", "min_draft_prob_top_p", "greedy", "greedy_min_draft_prob"]


def varying_k(max_k: int) -> Callable[[tuple[int, ...]], int]:
    """k chosen per round from the history, as an adaptive policy does (including k = 0)."""
    return lambda context: (7 * sum(context) + 3 * len(context) + 1) % (max_k + 1)


# ----------------------------------------------------------------------------- the proofs

# Every case at k = 1 (vocabulary 4) and k = 3 (vocabulary 3); the main ones at k = 2 and 4 too. The
# search tree grows as vocab^k, so the vocabulary shrinks with k. k+1 tokens span one whole round
# with its bonus token, and the rounds that follow a rejection.
FIXED_K_CASES = ([(name, 1) for name in CASE_NAMES] + [(name, 3) for name in CASE_NAMES]
                 + [(name, 2) for name in ("temperature", "min_draft_prob", "disjoint")]
                 + [(name, 4) for name in ("min_draft_prob", "disjoint")])


@pytest.mark.parametrize("name,k", FIXED_K_CASES)
def test_fixed_k_matches_target_exactly(name: str, k: int) -> None:
    case = make_case(name, vocab=4 if k == 1 else 3)
    assert max_abs_difference(case, n_tokens=k + 1, k_for=lambda _: k) < TOLERANCE


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_draft_prob", "disjoint", "greedy_min_draft_prob"])
def test_adaptive_k_matches_target_exactly(name: str) -> None:
    case = make_case(name, vocab=3)
    assert max_abs_difference(case, n_tokens=4, k_for=varying_k(4)) < TOLERANCE


def test_bonus_token_when_every_draft_is_accepted() -> None:
    case = make_case("p_equals_q", vocab=3)
    paths = enumerate_paths(lambda rng: production_round(case, (), 3, rng))
    # p == q: all 3 drafts accepted, plus the bonus token (q's float32 transport leaves p/q a hair
    # under 1 at some tokens, so rejection paths exist with negligible weight).
    assert sum(weight for emitted, weight in paths if len(emitted) == 4) > 1 - 1e-6


def test_min_draft_prob_stops_before_drawing() -> None:
    """The stop rule looks at the draft's distribution, not at a drawn token: with a threshold above
    every max probability nothing is drafted, and the round is plain target sampling."""
    case = make_case("min_draft_prob", vocab=4)
    case = Case(case.cfg, case.target, case.draft, case.vocab, min_draft_prob=1.0)
    paths = enumerate_paths(lambda rng: production_round(case, (), 3, rng))
    assert all(len(emitted) == 1 for emitted, _ in paths)


@pytest.mark.parametrize("name", ["min_draft_prob", "min_draft_prob_top_p", "greedy_min_draft_prob"])
def test_the_early_stop_cases_really_stop_early(name: str) -> None:
    """In the early-stop cases the stop fires on some paths and not on others (k = 3, vocab 3, rounds
    starting at the contexts the proofs above reach), so their exactness covers drafts of every length."""
    case = make_case(name, vocab=3)
    starts = [()] + [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    lengths: set[int] = set()
    for start in starts:
        def drafted(rng, start: tuple[int, ...] = start) -> tuple[int, ...]:
            fed = list(start)

            def feed(token: int) -> torch.Tensor:
                fed.append(token)
                return case.draft(tuple(fed))
            return tuple(propose_tokens(case.draft(start), feed, 3, case.cfg, len(start), case.max_q,
                                        case.min_draft_prob, rng).tokens)
        lengths |= {len(tokens) for tokens, _ in enumerate_paths(drafted)}
    assert 3 in lengths and min(lengths) < 3, lengths


# ----------------------------------------------------------------------------- pipelined schedules

def _propose(case: Case, context: tuple[int, ...], k: int, rng) -> Draft:
    fed = list(context)

    def feed(token: int) -> torch.Tensor:
        fed.append(token)
        return case.draft(tuple(fed))
    return propose_tokens(case.draft(context), feed, k, case.cfg, len(context), case.max_q, case.min_draft_prob, rng)


# The pre-drafts the orchestrator holds between rounds: (the prefix each assumed, its tokens, their q,
# how many leading tokens are guesses to check rather than drafts: 1 for the bonus guess of the main
# pre-draft, 0 for a branch, whose assumed prefix already ends with its guess of the correction).
Ahead = tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[SparseDist, ...], int], ...] | None


def pipelined_round(case: Case, context: tuple[int, ...], k: int, remaining: int, ahead: Ahead, first: bool,
                    overlap: bool, pipeline: bool, max_k: int, rng, branches: int = 0
                    ) -> tuple[tuple[int, ...], Ahead]:
    """One round of orchestrator.rounds.Round.run's schedule, on the production sampling functions.

    A pre-draft from the previous round is used on a hit (the prefix is the assumed one plus its
    guessed tokens, and k > 0). Prefill overlap: a first round with k > 0 verifies nothing and
    pre-drafts k+1 after the context. Pipelining: a round with drafts pre-drafts len(drafts)+2 after
    them, and with `branches` also after drafts[:j] + the runner-up at the branch points
    (orchestrator.rounds.branch_points). A rejection discards the main pre-draft. The pre-drafts'
    decisions are made before the verify's, as in service, where they run during the verify."""
    drafts: list[int] | None = None
    qs: list[SparseDist] = []
    for assumed, tokens, q, guessed in (ahead or ()) if k > 0 else ():
        if len(tokens) > guessed and context == assumed + tokens[:guessed]:
            drafts, qs = list(tokens[guessed:guessed + k]), list(q[guessed:guessed + k])
            break
    new_ahead: list = []
    if drafts is None and k > 0 and overlap and first and remaining >= 3:
        pre = _propose(case, context, min(k, remaining - 2) + 1, rng)
        new_ahead, drafts = [(context, tuple(pre.tokens), tuple(pre.q), 1)], []
    elif drafts is None:
        draft = _propose(case, context, k, rng) if k > 0 else Draft()
        drafts, qs = list(draft.tokens), list(draft.q)
        alternatives, probs = draft.alternatives, draft.token_probs
    else:  # drafts from a hit: their runner-ups as the pre-draft reported them
        alternatives, probs = None, None
    if pipeline and drafts and remaining - (len(drafts) + 1) >= 2:
        depth = min(len(drafts) + 1, max_k, remaining - len(drafts) - 2) + 1
        assumed = context + tuple(drafts)
        pre = _propose(case, assumed, depth, rng)
        new_ahead = [(assumed, tuple(pre.tokens), tuple(pre.q), 1)]
        if branches and alternatives is not None:
            for j, alt in branch_points(drafts, probs, alternatives, remaining, branches):
                depth = min(len(drafts) + 1, max_k, remaining - (j + 1) - 1)
                branch_at = context + tuple(drafts[:j]) + (alt,)
                pre = _propose(case, branch_at, depth, rng)
                new_ahead.append((branch_at, tuple(pre.tokens), tuple(pre.q), 0))
    rows = torch.stack([case.target(context + tuple(drafts[:i])) for i in range(len(drafts) + 1)])
    if case.cfg.greedy:
        outcome = verify_greedy(rows, drafts)
    else:
        wire_q = [SparseDist.from_pb(q.to_pb()) for q in qs]
        outcome = verify_sampled(rows, drafts, wire_q, case.cfg, len(context), rng)
    if outcome.accepted_len < len(drafts):
        new_ahead = [entry for entry in new_ahead if entry[3] == 0]  # a rejection cancels the main pre-draft
    return tuple(outcome.emitted(drafts)), tuple(new_ahead) or None


def pipelined_distribution(case: Case, n_tokens: int, k_for: Callable[[tuple[int, ...]], int], overlap: bool,
                           pipeline: bool, max_k: int = 3, round_fn=None, branches: int = 0
                           ) -> dict[tuple[int, ...], float]:
    """Exact joint distribution of the first n_tokens under the pipelined schedule: the state carried
    from round to round is the context and the pending pre-draft."""
    def dist(context: tuple[int, ...], remaining: int, ahead: Ahead, first: bool) -> dict[tuple[int, ...], float]:
        if remaining == 0:
            return {(): 1.0}
        k = max(0, min(k_for(context), remaining - 1))
        out: dict[tuple[int, ...], float] = {}
        for (emitted, next_ahead), weight in enumerate_paths(
                lambda rng: (round_fn or pipelined_round)(case, context, k, remaining, ahead, first, overlap,
                                                         pipeline, max_k, rng, branches)):
            emitted = emitted[:remaining]
            for tail, w in dist(context + emitted, remaining - len(emitted), next_ahead, False).items():
                out[emitted + tail] = out.get(emitted + tail, 0.0) + weight * w
        return out
    return dist((), n_tokens, None, True)


@pytest.mark.parametrize("overlap,pipeline,branches", [(False, True, 0), (True, False, 0), (True, True, 0),
                                                       (False, True, 2)],
                         ids=["pipelined", "prefill-overlap", "both", "pipelined-branches"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "disjoint", "p_equals_q", "min_draft_prob", "greedy"])
def test_pipelined_schedules_match_target_exactly(name: str, overlap: bool, pipeline: bool, branches: int) -> None:
    case = make_case(name, vocab=3)
    got = pipelined_distribution(case, 4, varying_k(2), overlap, pipeline, branches=branches)
    want = target_joint(case, 4)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE and set(got) <= set(want)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) < TOLERANCE


def test_pipelined_enumeration_uses_predrafts_and_has_teeth() -> None:
    """The schedule really takes pre-drafts (hits happen on some paths), and a pre-draft whose q rows
    are off by one position (each token sent with its predecessor's distribution) is caught as biased.
    (Using a pre-draft whose guess was wrong would not be: drafts drawn from any q that travels with
    them are verified losslessly; the guess check is there for acceptance, not for correctness.)"""
    case = make_case("temperature", vocab=3)
    hits = []

    def counting(case, context, k, remaining, ahead, *rest):
        if ahead is not None and k > 0 and any(len(tokens) > guessed and context == assumed + tokens[:guessed]
                                               for assumed, tokens, _, guessed in ahead):
            hits.append(1)
        return pipelined_round(case, context, k, remaining, ahead, *rest)
    pipelined_distribution(case, 4, lambda _: 2, overlap=True, pipeline=True, round_fn=counting)
    assert hits

    def shifted_q(case, context, k, remaining, ahead, *rest):
        if ahead is not None:
            ahead = tuple((assumed, tokens, q[:1] + q[:-1], guessed) for assumed, tokens, q, guessed in ahead)
        return pipelined_round(case, context, k, remaining, ahead, *rest)
    got = pipelined_distribution(case, 4, lambda _: 2, overlap=True, pipeline=True, round_fn=shifted_q)
    want = target_joint(case, 4)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) > 1e-3


def test_branch_predrafts_are_used_exactly_and_a_biased_branch_is_caught() -> None:
    """With branches, some paths take their drafts from a branch (a rejection whose correction was
    the draft's runner-up), the result is still the target's distribution, and a branch whose q is
    not the one its tokens were drawn from is caught."""
    case = make_case("temperature", vocab=3)
    want = target_joint(case, 4)
    branch_hits = []

    def counting(case, context, k, remaining, ahead, *rest):
        if ahead is not None and k > 0 and any(guessed == 0 and len(tokens) and context == assumed
                                               for assumed, tokens, _, guessed in ahead):
            branch_hits.append(1)
        return pipelined_round(case, context, k, remaining, ahead, *rest)
    got = pipelined_distribution(case, 4, lambda _: 1, overlap=False, pipeline=True, round_fn=counting, branches=2)
    assert branch_hits
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) < TOLERANCE

    def wrong_q(case, context, k, remaining, ahead, *rest):
        if ahead is not None:  # branches send their q with the probabilities reversed
            ahead = tuple((assumed, tokens, tuple(SparseDist(d.token_ids, d.probs.flip(0)) for d in q) if guessed == 0
                           else q, guessed) for assumed, tokens, q, guessed in ahead)
        return pipelined_round(case, context, k, remaining, ahead, *rest)
    got = pipelined_distribution(case, 4, lambda _: 1, overlap=False, pipeline=True, round_fn=wrong_q, branches=2)
    assert max(abs(got.get(seq, 0.0) - p) for seq, p in want.items()) > 1e-3


# ----------------------------------------------------------------------------- the harness has teeth

def drop_after_draw_round(case: Case, context: tuple[int, ...], k: int, rng) -> tuple[int, ...]:
    """The rule shipped before this test existed: draw x from q, then drop it and stop drafting when
    q(x) < min_draft_prob. Kept here only as the negative control."""
    position = len(context)
    draft = Draft()
    prefix = context
    for i in range(k):
        q = propose_tokens(case.draft(prefix), lambda t: case.draft(prefix), 1, case.cfg, position + i,
                           case.max_q, 0.0, rng)
        if q.token_probs[0] < case.min_draft_prob:
            break
        draft.tokens += q.tokens
        draft.q += q.q
        prefix = prefix + tuple(q.tokens)
    rows = torch.stack([case.target(context + tuple(draft.tokens[:i])) for i in range(len(draft.tokens) + 1)])
    return tuple(verify_sampled(rows, draft.tokens, draft.q, case.cfg, position, rng).emitted(draft.tokens))


def test_enumeration_detects_dropping_a_drawn_token() -> None:
    case = make_case("min_draft_prob", vocab=4)
    assert max_abs_difference(case, 3, lambda _: 2, round_fn=drop_after_draw_round) > 1e-3


def test_enumeration_detects_a_wrong_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resampling from p instead of norm(max(0, p - q)) after a rejection is biased."""
    from specdec import sampling
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p / p.sum())
    case = make_case("temperature", vocab=4)
    assert max_abs_difference(case, 3, lambda _: 2) > 1e-3


# ----------------------------------------------------------------------------- the service's randomness

def test_seeded_randomness_maps_uniforms_to_decisions() -> None:
    rng = SeededRandomness(seed=11)
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3])
    u = uniform(11, 5, 1)
    assert rng.choose(probs, 5, 1) == sample_index(probs, u)
    assert rng.accept(0.4, 5, 2) == (uniform(11, 5, 2) < 0.4)
    # Inverse CDF: the interval of each index has its probability's width, zero-width never drawn.
    assert sample_index(probs, 0.0) == 0 and sample_index(probs, 0.1999) == 0
    assert sample_index(probs, 0.2001) == 2 and sample_index(probs, 0.6999) == 2
    assert sample_index(probs, 0.7001) == 3 and sample_index(probs, 0.999999) == 3


def _log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(x) if x > 0 else float("-inf") for x in probs], dtype=torch.float32)


def test_a_k_that_reads_thrown_away_drafts_leaves_the_output_the_targets() -> None:
    """Monte Carlo with the service's own randomness, where the enumeration above cannot look: its
    decisions are fresh by construction. After a rejection the next round drafts the positions of
    the drafts it threw away; a policy may depend on those drafts (here on the previous round's
    drafted count, which an early stop makes depend on them). Keyed by position alone the draw was
    then made with the same uniform, and the output was biased: chi^2 1298 (df 5) at n = 8000, P(t1
    = 1 | t0 = 2) 0.77 against 0.5. Keyed by the prefix (the draft worker's context), it is not."""
    from specdec.worker_core import WorkerSession
    cfg = SamplingConfig(temperature=1.0)
    min_draft_prob, n_tokens, samples = 0.45, 2, 3000

    def draft(prefix: tuple[int, ...]) -> torch.Tensor:  # at position 2, confident only after a 0
        if len(prefix) == 2:
            return _log_probs([0.9, 0.1, 0.0] if prefix[1] == 0 else [1 / 3, 1 / 3, 1 / 3])
        return _log_probs([0.5, 0.5, 0.0])

    def target(prefix: tuple[int, ...]) -> torch.Tensor:
        return _log_probs([[0.2, 0.2, 0.6], [0.5, 0.5, 0.0]][len(prefix)] if len(prefix) < 2 else [0.4, 0.3, 0.3])

    def generate(seed: int) -> tuple[int, ...]:
        rng, ctx, last = SeededRandomness(seed), (), None
        while len(ctx) < n_tokens:
            # k from the last round: fewer after a rejection, fewer still if it drafted 2 (the early stop fired)
            k = 3 if last is None else (2 if last[1] == last[0] else (1 if last[0] == 2 else 0))
            fed = list(ctx)
            d = propose_tokens(draft(ctx), lambda t: (fed.append(t), draft(tuple(fed)))[1], k, cfg, len(ctx), 256,
                               min_draft_prob, rng, WorkerSession(None, list(ctx)).context_key())  # as the draft
            rows = torch.stack([target(ctx + tuple(d.tokens[:i])) for i in range(len(d.tokens) + 1)])
            out = verify_sampled(rows, d.tokens, [SparseDist.from_pb(q.to_pb()) for q in d.q], cfg, len(ctx), rng,
                                 WorkerSession(None, list(ctx)).context_key())  # as the target
            ctx, last = ctx + tuple(out.emitted(d.tokens)), (len(d.tokens), out.accepted_len)
        return ctx[:n_tokens]

    counts = collections.Counter(generate(seed) for seed in range(samples))
    chi2 = 0.0
    for a, b in itertools.product(range(3), repeat=2):
        expected = samples * float(target_distribution(target(()), cfg)[a] * target_distribution(target((a,)), cfg)[b])
        if expected > 0:
            chi2 += (counts[a, b] - expected) ** 2 / expected
        else:
            assert counts[a, b] == 0
    assert chi2 < 30.0  # df 5: p ~ 1.5e-5; the seeds are fixed, so the test is deterministic
