"""The engine's request and response types: what the servicer converts protobuf to and from, and the
per-turn stats (an observer of every RoundRecord). No grpc, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config import SpeculationOverride
from orchestrator.guard import TARGET_ONLY
from orchestrator.record import RoundRecord


@dataclass(frozen=True)
class GenerateParams:
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    session_id: str | None = None
    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    speculation: SpeculationOverride = SpeculationOverride()
    resume_session: bool = False  # NOT_FOUND unless the orchestrator holds session_id's history


@dataclass
class GenerationStats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    new_tokens: int = 0
    reprefills: int = 0
    bytes_to_draft: int = 0
    bytes_to_target: int = 0
    bytes_from_draft: int = 0
    bytes_from_target: int = 0
    seed: int = 0
    fallback_rounds: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    predraft_hits: int = 0
    predraft_misses: int = 0
    predraft_saved_ms: float = 0.0
    predraft_branch_hits: int = 0   # hits whose drafts came from a branch (a correction guessed right)
    guard_off_rounds: int = 0
    # Of draft_ms, what the rounds waited for: a pipelined hit's drafts ran during the previous
    # verify (its compute counts in draft_ms, not in the time the request spent drafting).
    draft_waited_ms: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def overhead_ms(self) -> float:
        return max(0.0, self.total_ms - self.draft_waited_ms - self.verify_ms)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / (self.total_ms / 1000.0) if self.total_ms > 0 else 0.0

    def observe(self, record: RoundRecord) -> None:
        self.rounds += 1
        self.k_per_round.append(record.drafted)
        self.accepted_per_round.append(record.accepted)
        self.draft_tokens += record.drafted
        self.accepted_tokens += record.accepted
        if len(self.accepted_per_position) < record.drafted:
            self.accepted_per_position.extend([0] * (record.drafted - len(self.accepted_per_position)))
        for i in range(record.accepted):
            self.accepted_per_position[i] += 1
        self.draft_ms += record.draft_ms
        self.draft_waited_ms += 0.0 if record.predraft_hit else record.draft_ms
        self.verify_ms += record.verify_ms
        self.reprefills += record.reprefills
        self.fallback_rounds += int(record.fallback)
        self.guard_off_rounds += int(record.guard == TARGET_ONLY)
        self.bytes_to_draft += record.bytes_to_draft
        self.bytes_from_draft += record.bytes_from_draft
        self.bytes_to_target += record.bytes_to_target
        self.bytes_from_target += record.bytes_from_target
        self.new_tokens += len(record.emitted)
        if record.predraft_hit is not None:
            self.predraft_hits += int(record.predraft_hit)
            self.predraft_misses += int(not record.predraft_hit)
            self.predraft_saved_ms += record.predraft_saved_ms
        self.predraft_branch_hits += int(record.hit_from_branch)
        if record.index == 1:
            # What the target really reused of this turn's prompt (0 after a re-prefill).
            self.cached_prompt_tokens = record.target_cached


@dataclass
class GenerationEvent:
    """A chunk of output. The last event has finish_reason and stats set."""
    text_delta: str
    token_ids: list[int]
    finish_reason: str | None = None   # "length" | "stop" | "eos" | "context"
    stats: GenerationStats | None = None
    session_id: str = ""


@dataclass(frozen=True)
class EngineLimits:
    max_new_tokens: int = 4096
    max_prompt_chars: int = 1_000_000
    max_messages: int = 1024  # per request: the chat template renders them all, empty ones too
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # each stop string's length: every round searches the tail that long
    max_sessions: int = 10_000
    max_session_tokens: int = 16_000_000  # over all sessions' histories: about 0.8 GB here
    session_ttl_s: float = 600.0
    # How long a round keeps retrying an unreachable target (a restart) before UNAVAILABLE.
    target_retry_s: float = 10.0
    # A draft call slower than this is abandoned and the round runs target-only.
    draft_timeout_s: float = 10.0
    # A Verify slower than this fails the request UNAVAILABLE: a target that hangs while its process
    # still answers keepalive pings held a request (and its admission slot) for ever without a deadline.
    target_timeout_s: float = 600.0
