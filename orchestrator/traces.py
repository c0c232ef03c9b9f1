"""Per-round traces (opt-in JSONL) for offline policy tuning: one JSON object per round."""
from __future__ import annotations

import gzip
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.record import is_steady

log = logging.getLogger(__name__)


@dataclass
class RoundTrace:
    session: str
    round: int
    position: int            # canonical length when the round started
    policy: str
    k: int                   # k the policy asked for
    drafted: int             # tokens the draft actually proposed (early stop, fallback)
    accepted: int            # leading drafted tokens the target accepted
    draft_probs: list[float]  # draft confidence per drafted position
    draft_ms: float
    verify_ms: float
    round_ms: float          # wall time of the whole round (both RPCs + orchestrator)
    draft_prefilled: int
    target_prefilled: int
    greedy: bool
    fallback: bool
    ts: float = field(default_factory=time.time)
    # Per-token drafting cost of this round, timed apart from the commit's catch-up forward
    # (0 in traces recorded before it existed, or when the round drafted fewer than 2 tokens).
    draft_token_ms: float = 0.0
    # The draft's max probability per position considered, the quantity min_draft_prob compares
    # (empty in older traces: draft_probs stands in, which is the same for greedy).
    draft_confidences: list[float] = field(default_factory=list)
    # The target's batching during the verify (1 / 0 / 0 in traces recorded before batching).
    target_batch: float = 1.0
    target_rows: float = 0.0
    target_waiting: int = 0
    target_prompt_rows: float = 0.0  # of target_rows, prompts' rows (0 in traces recorded before it)
    guard: str = ""  # the pair guard's epoch: "spec", "off" (k forced to 0), "" (not guarded)
    emitted: int = -1  # tokens the round added to the output (-1 in older traces: accepted + 1 stands in)
    # Pipelining (absent in older traces): the pre-draft outcome ("hit", "miss", "" when none was
    # tested), the draft time a hit saved, and the calls' wall times (RPC and queueing included).
    predraft: str = ""
    predraft_saved_ms: float = 0.0
    draft_wall_ms: float = 0.0
    verify_wall_ms: float = 0.0
    # The verify's wait in the target's scheduler before its first forward (0 in older traces): of
    # verify_wall_ms - verify_ms, what the worker queued; the rest is the RPC's.
    target_queue_ms: float = 0.0
    overlapped: bool = False  # the prefill overlap ran this round (False in older traces)
    budget_capped: bool = False  # no room left to draft: k = 0 not by the policy (False in older traces)

    @property
    def steady(self) -> bool:
        return is_steady(self.draft_prefilled, self.target_prefilled)

    @property
    def tokens(self) -> int:
        """Tokens the round produced (a stop or the token budget can cut a round's accepted + 1)."""
        return self.emitted if self.emitted >= 0 else self.accepted + 1

    @property
    def pattern(self) -> list[int]:
        """Acceptance per drafted position as observed: 1s, then a 0 at the first rejection."""
        return [1] * self.accepted + ([0] if self.accepted < self.drafted else [])


class TraceWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered plain JSONL whatever the name: a killed orchestrator loses at most a line
        # (a gzip stream without its trailer would lose the file). `compress` packs it afterwards.
        self._file = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()
        self._failed = False
        log.info("recording round traces to %s", self.path)

    def observe(self, record: Any) -> None:
        """One orchestrator.rounds.RoundRecord, as a trace line."""
        self.write(RoundTrace(
            session=record.session_id, round=record.index, position=record.position, policy=record.policy,
            k=record.k, drafted=record.drafted, accepted=record.accepted,
            draft_probs=[round(p, 5) for p in record.draft_probs], draft_ms=round(record.draft_ms, 3),
            verify_ms=round(record.verify_ms, 3), round_ms=round(record.round_ms, 3),
            draft_prefilled=record.draft_prefilled, target_prefilled=record.target_prefilled,
            greedy=record.greedy, fallback=record.fallback, draft_token_ms=round(record.draft_token_ms, 3),
            draft_confidences=[round(p, 5) for p in record.draft_confidences],
            target_batch=round(record.target_batch, 2), target_rows=round(record.target_rows, 1),
            target_waiting=record.target_waiting, target_prompt_rows=round(record.target_prompt_rows, 1),
            guard=record.guard, emitted=len(record.emitted),
            predraft={True: "hit", False: "miss"}.get(record.predraft_hit, ""),
            predraft_saved_ms=round(record.predraft_saved_ms, 3), draft_wall_ms=round(record.draft_wall_ms, 3),
            verify_wall_ms=round(record.verify_wall_ms, 3), target_queue_ms=round(record.target_queue_ms, 3),
            overlapped=record.overlapped, budget_capped=record.budget_capped))

    def write(self, trace: RoundTrace) -> None:
        """A diagnostic: a failing write (a full disk) is logged once and tracing stops, rather than
        failing the request whose round it records."""
        if self._failed:
            return
        line = json.dumps(asdict(trace), separators=(",", ":"))
        with self._lock:
            try:
                self._file.write(line + "\n")
            except (OSError, ValueError) as exc:  # ValueError: written after close
                self._failed = True
                log.error("round trace file write failed, tracing stops: %s", exc)

    def close(self) -> None:
        self._file.close()


def load_traces(path: str | Path) -> list[RoundTrace]:
    """The rounds of a trace file (JSONL, or JSONL.gz as kept in docs/bench)."""
    traces = []
    with (gzip.open(path, "rt") if _is_gzip(path) else open(path)) as f:  # by content, not by name
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    traces.append(RoundTrace(**json.loads(line)))
                except (TypeError, ValueError) as exc:
                    if not line.endswith("\n"):  # the last line, cut by a kill mid-write
                        log.warning("%s:%d: skipping a partly written last line", path, n)
                        break
                    raise ValueError(f"{path}:{n}: not a round trace: {exc}") from exc
        except EOFError:  # a gzip stream cut short: keep its complete lines
            log.warning("%s ends early: read %d rounds", path, len(traces))
    return traces


def _is_gzip(path: str | Path) -> bool:
    with open(path, "rb") as raw:
        return raw.read(2) == b"\x1f\x8b"


def compress(path: str | Path) -> None:
    """Gzip a finished trace file in place if its name says .gz and its content is not yet."""
    path = Path(path)
    if path.suffix == ".gz" and path.exists() and not _is_gzip(path):
        packed = path.with_name(path.name + ".tmp")
        packed.write_bytes(gzip.compress(path.read_bytes()))
        packed.replace(path)
