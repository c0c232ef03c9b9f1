"""Target engine: one forward pass over the drafts, lossless rejection rule, crop to the accepted prefix."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.contract import MAX_K, CallStats, Commit, SamplingConfig
from specdec.errors import InvalidRequest
from specdec.sampling import SparseDist, verify_greedy, verify_sampled
from specdec.worker_core import CallSteps, WorkerCore


@dataclass(frozen=True)
class VerifyParams:
    session_id: str
    commit: Commit
    draft_tokens: tuple[int, ...]
    q: tuple[SparseDist, ...]
    sampling: SamplingConfig


@dataclass
class VerifyResult:
    accepted_len: int
    next_token: int
    cache_len: int
    stats: CallStats = field(default_factory=CallStats)


class TargetEngine:
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def _validate(self, params: VerifyParams) -> None:
        if len(params.draft_tokens) > MAX_K:
            raise InvalidRequest(f"at most {MAX_K} draft tokens per call, got {len(params.draft_tokens)}")
        try:
            params.sampling.validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if params.sampling.greedy:
            return
        if len(params.q) != len(params.draft_tokens):
            raise InvalidRequest(f"sampling needs one q per draft token: got {len(params.q)} q for "
                                 f"{len(params.draft_tokens)} tokens")
        for i, (token, q) in enumerate(zip(params.draft_tokens, params.q)):
            if q.token_ids.numel() != q.probs.numel() or q.token_ids.numel() == 0:
                raise InvalidRequest(f"q[{i}] must have equally many (non-zero) token_ids and probs")
            ids = q.token_ids.tolist()
            self.core.check_tokens(ids, f"q[{i}].token_ids")
            if len(set(ids)) != len(ids):
                raise InvalidRequest(f"q[{i}] has duplicate token ids")
            probs = q.probs.tolist()
            if any(not math.isfinite(p) or p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-3:
                raise InvalidRequest(f"q[{i}] must be finite, non-negative and sum to 1")
            if q.prob_of(token) <= 0:
                raise InvalidRequest(f"draft token {token} at position {i} has zero probability under its q")

    def verify(self, params: VerifyParams) -> VerifyResult:
        """One call alone (no scheduler)."""
        return self.core.run_alone(self.verify_steps(params))

    def verify_steps(self, params: VerifyParams) -> CallSteps:
        """The call as one forward step over the commit and the drafts."""
        self._validate(params)
        stats = CallStats()
        drafts = list(params.draft_tokens)
        with self.core.timed() as timer:
            session, logits = yield from self.core.begin_steps(params.session_id, params.commit, drafts, stats)
            try:
                rows = logits[-(len(drafts) + 1):]
                first_position = len(session.tokens) - len(drafts)  # absolute position of drafts[0]
                if params.sampling.greedy:
                    outcome = verify_greedy(rows, drafts)
                else:
                    # Draws keyed by their whole prefix, from the key of the tokens before the drafts.
                    outcome = verify_sampled(rows, drafts, list(params.q), params.sampling, first_position,
                                             context=session.context_key(first_position))
                # Drop the rejected drafts' KV; the correction/bonus token is fed next round.
                self.core.truncate(session, first_position + outcome.accepted_len)
            finally:
                self.core.release(params.session_id)
        stats.compute_ms = timer.ms
        return VerifyResult(outcome.accepted_len, outcome.next_token, len(session.tokens), stats)
