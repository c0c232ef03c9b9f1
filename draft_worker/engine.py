"""Draft engine: apply the commit, then draft up to k tokens (no grpc)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import InvalidRequest
from specdec.sampling import SamplingConfig, SparseDist, draft_sample
from specdec.worker_core import CallStats, Commit, WorkerCore

MAX_K = 64


@dataclass(frozen=True)
class ProposeParams:
    session_id: str
    commit: Commit
    k: int
    sampling: SamplingConfig
    min_draft_prob: float = 0.0


@dataclass
class ProposeResult:
    tokens: list[int] = field(default_factory=list)
    q: list[SparseDist] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    cache_len: int = 0
    stats: CallStats = field(default_factory=CallStats)


class DraftEngine:
    def __init__(self, core: WorkerCore, max_q_entries: int = 256) -> None:
        self.core = core
        # Upper bound on q entries sent per position: bytes grow with k, not the vocabulary.
        self.max_q_entries = max_q_entries

    def propose(self, params: ProposeParams) -> ProposeResult:
        if not 0 <= params.k <= MAX_K:
            raise InvalidRequest(f"k must be in [0, {MAX_K}], got {params.k}")
        try:
            params.sampling.validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        result = ProposeResult()
        with self.core.timed() as timer:
            session, logits = self.core.begin(params.session_id, params.commit, (), result.stats)
            last = logits[-1]
            position = len(session.tokens)
            # The context may not have room for k more tokens.
            k = min(params.k, self.core.max_context - position)
            for i in range(k):
                token, prob, q = draft_sample(last, params.sampling, position + i, self.max_q_entries)
                if params.min_draft_prob > 0 and prob < params.min_draft_prob:
                    break  # low confidence: the target would likely reject; stop drafting here
                result.tokens.append(token)
                result.token_probs.append(prob)
                if q is not None:
                    result.q.append(q)
                if i < k - 1:
                    last = self.core.feed(session, [token])[-1]
                    result.stats.fed_tokens += 1
            result.cache_len = len(session.tokens)
        result.stats.compute_ms = timer.ms
        return result
