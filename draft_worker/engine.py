"""Draft engine: apply the commit, then draft up to k tokens (no grpc)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.contract import MAX_K, CallStats, Commit, SamplingConfig
from specdec.errors import InvalidRequest
from specdec.sampling import SeededRandomness, SparseDist, draft_steps
from specdec.worker_core import CallSteps, ForwardStep, WorkerCore


@dataclass(frozen=True)
class ProposeParams:
    session_id: str
    commit: Commit
    k: int
    sampling: SamplingConfig
    min_draft_prob: float = 0.0
    slot: int = 0                  # which of the session's cache slots the call runs on (0: its own)
    fork_from: int | None = None   # first copy that slot's committed prefix into `slot` (a branch)


@dataclass
class ProposeResult:
    tokens: list[int] = field(default_factory=list)
    q: list[SparseDist] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    alternatives: list[tuple[int, float]] = field(default_factory=list)  # runner-up (token, prob) per draft
    cache_len: int = 0
    slot: int = 0                  # the slot the call ran on
    stats: CallStats = field(default_factory=CallStats)


class DraftEngine:
    def __init__(self, core: WorkerCore, max_q_entries: int = 256) -> None:
        self.core = core
        # Upper bound on q entries sent per position: bytes grow with k, not the vocabulary.
        self.max_q_entries = max_q_entries
        # Draft only ids the tokenizer knows: a model's logits can have padding rows past them (sized
        # for fast matmuls), and a target with fewer rows would refuse such ids in q. Lossless: q is
        # what the draft samples from; the target's own draws are left alone.
        self.draftable = min(core.vocab_size, len(core.loaded.tokenizer))

    def propose(self, params: ProposeParams) -> ProposeResult:
        """One call alone (no scheduler): each step its own forward."""
        return self.core.run_alone(self.propose_steps(params))

    def propose_steps(self, params: ProposeParams) -> CallSteps:
        """The call as forward steps: the commit's catch-up forward, then one per drafted token."""
        if not 0 <= params.k <= MAX_K:
            raise InvalidRequest(f"k must be in [0, {MAX_K}], got {params.k}")
        if not 0.0 <= params.min_draft_prob <= 1.0:
            raise InvalidRequest(f"min_draft_prob must be in [0, 1], got {params.min_draft_prob}")
        try:
            params.sampling.validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        result = ProposeResult(slot=params.slot)
        stats = result.stats
        with self.core.timed() as timer:
            session, logits = yield from self.core.begin_steps(params.session_id, params.commit, (), stats,
                                                               params.slot, params.fork_from, grow_by=params.k)
            try:
                # The commit's forward is catch-up (prefill, or the tokens the target just produced);
                # timed apart so the orchestrator sees the per-token drafting cost on its own.
                stats.catchup_ms = timer.elapsed_ms()
                position = len(session.tokens)
                # The context, or the whole KV budget, may not have room for k more tokens.
                k = max(0, min(params.k, self.core.max_context - position, self.core.budget_tokens() - position))
                drafting = draft_steps(logits[-1, :self.draftable], k, params.sampling, position, self.max_q_entries,
                                       params.min_draft_prob, SeededRandomness(params.sampling.seed),
                                       context=session.context_key())  # draws keyed by the whole prefix
                # Each drafted token becomes a one-token forward step of this session.
                try:
                    token = next(drafting)
                    while True:
                        stats.fed_tokens += 1
                        step_logits = yield ForwardStep(session, [token], 1)
                        token = drafting.send(step_logits[-1, :self.draftable])
                except StopIteration as stop:
                    draft = stop.value
                result.tokens, result.q, result.token_probs = draft.tokens, draft.q, draft.token_probs
                result.confidences, result.alternatives = draft.confidences, draft.alternatives
                stats.draft_steps = draft.steps
                result.cache_len = len(session.tokens)
            finally:
                self.core.release(params.session_id, params.slot)
        stats.compute_ms = timer.ms
        return result
