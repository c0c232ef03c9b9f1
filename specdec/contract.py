"""What the orchestrator and the workers agree on, with no torch: limits, the cache commit, sampling
parameters, per-call stats, token-prefix hashing, and the protobuf <-> dataclass conversion of each.

The orchestrator imports this module and never the model-side ones (sampling, worker_core, models),
so its image needs no torch.
"""
from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from specdec import curves
from specdec.errors import InvalidRequest
from specdec.v1 import common_pb2

# The most tokens one round may draft (and the target verify). One limit for every component.
MAX_K = 32
MAX_SESSION_ID_LEN = 256
# Temperatures below this are greedy (as in vLLM): dividing logits by a smaller one overflows float32
# for no behavioural difference, since the warped distribution is already a point mass.
GREEDY_TEMPERATURE = 1e-5


# A draft session's branch slots (pipelined rounds pre-draft on them): slot 0 is the session's own
# cache, slots 1..MAX_BRANCH_SLOTS copies forked from it for the outcomes a verify may have.
MAX_BRANCH_SLOTS = 8


def slot_key(session_id: str, slot: int) -> str:
    """A worker's key for a session's slot: the id itself for slot 0. The separator is not printable,
    so no client session id (validate_session_id) can name another session's branch."""
    return session_id if slot == 0 else f"{session_id}\x00{slot}"


def session_of(key: str) -> str:
    """The session a worker's key (slot_key) belongs to."""
    return key.split("\x00", 1)[0]


def validate_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_LEN or not session_id.isprintable():
        raise InvalidRequest(f"session_id must be 1-{MAX_SESSION_ID_LEN} printable characters")


# ----------------------------------------------------------------------------- tokens

def prefix_hash(tokens: Sequence[int]) -> int:
    """64-bit hash of a token sequence; 0 for the empty sequence."""
    if not tokens:
        return 0
    data = array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


EMPTY_CONTEXT_KEY = 1


def extend_context_key(key: int, token: int) -> int:
    """The draft's random draws are keyed by their whole prefix (sampling.draft_steps): the key of a
    prefix one token longer. Chained from EMPTY_CONTEXT_KEY over the prefix, so a function of the
    prefix alone, however a call reached it (a pre-draft's draws are the serial round's)."""
    digest = hashlib.blake2b(key.to_bytes(8, "little") + token.to_bytes(8, "little", signed=True), digest_size=8)
    return int.from_bytes(digest.digest(), "little") or 1


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Compared by slices, which run in C, halving the range around the first difference: the
    orchestrator does this several times a round on its event loop, and an element-by-element loop
    took 4 ms a round at 32k tokens of context."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the first difference, if any, is before hi
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while a[lo] == b[lo]:
        lo += 1
    return lo


# ----------------------------------------------------------------------------- messages

@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_pb(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                         seed=self.seed)

    @classmethod
    def from_pb(cls, msg: common_pb2.SamplingParams) -> "SamplingConfig":
        # proto3's 0 is "unset" (no top-p); anything else, NaN and negatives too, is what was asked for.
        return cls(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0,
                   seed=msg.seed)


@dataclass(frozen=True)
class Commit:
    """How the caller wants a worker's cache before the call works: keep cache_len tokens (whose hash
    is prefix_hash), then append append_tokens."""
    cache_len: int
    prefix_hash: int
    append_tokens: tuple[int, ...]

    def to_pb(self) -> common_pb2.CacheCommit:
        return common_pb2.CacheCommit(cache_len=self.cache_len, prefix_hash=self.prefix_hash,
                                      append_tokens=list(self.append_tokens))

    @classmethod
    def from_pb(cls, msg: common_pb2.CacheCommit) -> "Commit":
        return cls(cache_len=msg.cache_len, prefix_hash=msg.prefix_hash, append_tokens=tuple(msg.append_tokens))


@dataclass
class CallStats:
    """What one worker call cost (WorkerTiming on the wire)."""
    compute_ms: float = 0.0
    fed_tokens: int = 0
    prefilled_tokens: int = 0
    # Draft only: time to apply the commit (catch-up/prefill forward), and the drafting forwards
    # after it, so the per-token drafting cost is measured apart from catch-up.
    catchup_ms: float = 0.0
    draft_steps: int = 0
    # Cross-session batching (see WorkerTiming in common.proto).
    queue_ms: float = 0.0
    batch_sessions: float = 0.0
    batch_rows: float = 0.0
    worker_utilisation: float = 0.0
    worker_waiting: int = 0
    batch_prompt_rows: float = 0.0

    def to_pb(self) -> common_pb2.WorkerTiming:
        return common_pb2.WorkerTiming(compute_ms=self.compute_ms, fed_tokens=self.fed_tokens,
                                       prefilled_tokens=self.prefilled_tokens, catchup_ms=self.catchup_ms,
                                       draft_steps=self.draft_steps, queue_ms=self.queue_ms,
                                       batch_sessions=self.batch_sessions, batch_rows=self.batch_rows,
                                       worker_utilisation=self.worker_utilisation,
                                       worker_waiting=self.worker_waiting, batch_prompt_rows=self.batch_prompt_rows)

    @classmethod
    def from_pb(cls, msg: common_pb2.WorkerTiming) -> "CallStats":
        return cls(compute_ms=msg.compute_ms, fed_tokens=msg.fed_tokens, prefilled_tokens=msg.prefilled_tokens,
                   catchup_ms=msg.catchup_ms, draft_steps=msg.draft_steps, queue_ms=msg.queue_ms,
                   batch_sessions=msg.batch_sessions, batch_rows=msg.batch_rows,
                   worker_utilisation=msg.worker_utilisation, worker_waiting=msg.worker_waiting,
                   batch_prompt_rows=msg.batch_prompt_rows)


@dataclass(frozen=True)
class CostCurve:
    """A worker's measured forward cost: ms for `tokens` new tokens on top of `context` cached ones.

    Measured by the worker at startup (specdec.calibration), sent in GetInfo, used by the orchestrator
    to seed the k policy before the first request."""
    points: tuple[tuple[int, int, float], ...] = ()  # (tokens, context, ms)

    def ms(self, tokens: int) -> float | None:
        """Cost of a forward over `tokens` at the shortest measured context: measured, or linearly
        interpolated between the nearest measured token counts; None beyond the measured range."""
        curve = self.rows_curve()
        if curve and curve[0][0] == tokens:
            return curve[0][1]
        return curves.interpolate(curve, tokens)

    def rows_curve(self) -> tuple[tuple[int, float], ...]:
        """(tokens, ms) at the shortest measured context, by tokens, each ms lowered to the least at
        any larger token count. Timing noise only adds: one startup once measured 3 tokens at 849 ms
        between 304 ms at 1 and 236 ms at 5 (the workers calibrate one after the other; the cause
        was not found), and kept high by a running maximum that one point priced every k >= 2 and
        every batch up to 32 rows at 849 ms. Where a smaller forward really costs more (F.linear at
        2 rows on some CPUs), this prices it as the larger one."""
        if not self.points:
            return ()
        context = min(c for _, c, _ in self.points)
        curve, least = [], math.inf
        for tokens, ms in sorted(((t, ms) for t, c, ms in self.points if c == context), reverse=True):
            least = min(least, ms)
            if curve and curve[-1][0] == tokens:  # one point per token count (a GetInfo may repeat one)
                curve[-1] = (tokens, least)
            else:
                curve.append((tokens, least))
        return tuple(reversed(curve))

    def to_pb(self) -> list[common_pb2.ForwardCost]:
        return [common_pb2.ForwardCost(tokens=t, context=c, ms=ms) for t, c, ms in self.points]

    @classmethod
    def from_pb(cls, msgs: Sequence[common_pb2.ForwardCost]) -> "CostCurve":
        return cls(tuple((m.tokens, m.context, m.ms) for m in msgs))


class CallTimer:
    """Times a worker call (compute_ms); elapsed_ms() reads it mid-call."""

    def __enter__(self) -> "CallTimer":
        self.start = time.perf_counter()
        self.ms = 0.0
        return self

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000.0

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter() - self.start) * 1000.0
