"""What the round loop needs from the workers, independent of transport (no grpc here).

The grpc implementation lives in orchestrator.clients. The draft distributions q are opaque to the
orchestrator: they travel from the draft's reply into the target's request untouched.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdec.contract import Commit, CostCurve, SamplingConfig

# Where a worker client adds each request's size as it sends it: (role, bytes). Set by the round for its
# calls; counted at send, so a call cancelled before its reply (a dropped pre-draft) counts as well.
SENT_BYTES: ContextVar[Callable[[str, int], None] | None] = ContextVar("specdec_sent_bytes", default=None)


@dataclass
class DraftReply:
    tokens: list[int]
    token_probs: list[float]
    cache_len: int
    compute_ms: float
    prefilled_tokens: int
    q_payload: Any = None           # opaque, forwarded to the target
    confidences: list[float] = field(default_factory=list)  # per position considered (see the proto)
    # The draft's runner-up (token, probability) at each drafted position: guesses of the target's
    # correction token, for pre-drafting on a branch (pipelined rounds).
    alternatives: list[tuple[int, float]] = field(default_factory=list)
    slot: int = 0                   # the slot the worker ran the call on (an older worker: always 0)
    catchup_ms: float = 0.0         # part of compute_ms that applied the commit
    draft_steps: int = 0            # drafting forwards after the catch-up
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_ms: float = 0.0

    def window(self, start: int, stop: int | None) -> "DraftReply":
        """The drafts [start:stop], with every per-position field cut alike (a pre-draft's after its
        bonus guess, cut to the next round's k)."""
        q = self.q_payload
        return dataclasses.replace(self, tokens=self.tokens[start:stop], token_probs=self.token_probs[start:stop],
                                   confidences=self.confidences[start:stop],
                                   alternatives=self.alternatives[start:stop],
                                   q_payload=list(q)[start:stop] if q is not None and len(q) else q)


@dataclass
class VerifyReply:
    accepted_len: int
    next_token: int
    cache_len: int
    compute_ms: float
    prefilled_tokens: int
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_ms: float = 0.0
    # The target's batching (WorkerTiming): sessions and rows in this call's forward, calls waiting.
    batch_sessions: float = 1.0
    batch_rows: float = 0.0
    worker_waiting: int = 0
    batch_prompt_rows: float = 0.0  # of batch_rows, prompts' rows (prefills sharing the forward)
    queue_ms: float = 0.0  # the call's wait in the worker before its first forward (WorkerTiming)


@dataclass
class WorkerDescription:
    role: str
    model_ref: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer_fingerprint: str = ""
    forward_costs: CostCurve = CostCurve()  # measured by the worker at startup (may be empty)
    branch_slots: int = 0                   # a draft's branch slots per session (pipelined branches)


class DraftBackend(Protocol):
    async def propose(self, session_id: str, commit: Commit, k: int, sampling: SamplingConfig,
                      min_draft_prob: float, timeout_s: float | None, slot: int = 0,
                      fork_from: int | None = None) -> DraftReply: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def describe(self, timeout_s: float | None = None) -> WorkerDescription: ...


class TargetBackend(Protocol):
    async def verify(self, session_id: str, commit: Commit, draft_tokens: list[int], q_payload: Any,
                     sampling: SamplingConfig, timeout_s: float | None) -> VerifyReply: ...

    async def end_session(self, session_id: str) -> bool: ...

    async def describe(self, timeout_s: float | None = None) -> WorkerDescription: ...
