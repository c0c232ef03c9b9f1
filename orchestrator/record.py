"""What one round did: the immutable record every observer sees (stats, metrics, traces, k policy)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from orchestrator.stopping import FinishReason


@dataclass(frozen=True)
class RoundRecord:
    """Everything one round did, as every observer sees it."""
    session_id: str
    index: int                  # 1-based, within the turn
    position: int               # canonical length when the round started
    policy: str
    k: int                      # what the policy asked for, within the budget and the draft's context
    drafts: tuple[int, ...]     # what the draft proposed (fewer than k: early stop or context)
    draft_probs: tuple[float, ...]
    draft_confidences: tuple[float, ...]  # max probability per position considered (early-stop rule)
    accepted: int               # leading drafts the target accepted
    emitted: tuple[int, ...]    # tokens this round added to the output, after the stop conditions
    text_delta: str
    finish: FinishReason | None
    fallback: bool              # k > 0, but the draft could not serve this round (target-only)
    greedy: bool
    draft_ms: float             # draft compute
    draft_token_ms: float       # per-token drafting cost, apart from catch-up (0: not measured)
    verify_ms: float            # target compute
    verify_wall_ms: float       # verify call as the orchestrator saw it
    round_ms: float
    draft_prefilled: int
    target_prefilled: int
    target_cached: int          # tokens the target reused from its cache in this round's commit
    reprefills: int
    bytes_to_draft: int = 0
    bytes_from_draft: int = 0
    bytes_to_target: int = 0
    bytes_from_target: int = 0
    # Pipelining: None when no pre-draft was pending for this round; True when this round's drafts
    # came from the pre-draft made during the previous verify (its draft time was hidden).
    predraft_hit: bool | None = None
    predraft_saved_ms: float = 0.0  # the serial draft call a hit made unnecessary, less its wait (rounds.hit_saved_ms)
    # Branches: None when no branch was made for the previous round's rejection position (or it
    # failed); True when one was and its runner-up was the target's correction (its drafts are this
    # round's, unless this round runs k = 0); False when its guess was wrong.
    predraft_branch_hit: bool | None = None
    draft_wall_ms: float = 0.0      # the draft call as the orchestrator saw it (RPC + compute)
    # The target's load during the verify: sessions and rows in its forward, calls waiting for a slot.
    target_batch: float = 1.0
    target_rows: float = 0.0
    target_waiting: int = 0
    target_prompt_rows: float = 0.0  # of target_rows, prompts' rows (other sessions' prefills, or its own)
    target_queue_ms: float = 0.0  # the verify's wait in the target's scheduler (the rest of wall - compute: RPC)
    # The prefill overlap ran this round (a turn's first, k = 0 while the draft prefilled beside it).
    overlapped: bool = False
    # The turn's token budget or the draft's context left no room to draft: k = 0 without asking the
    # policy, which is not its choice of target-only.
    budget_capped: bool = False
    # The pair guard's epoch this round ran in: "spec", "off" (k forced to 0), or "" (not guarded).
    guard: str = ""

    @property
    def drafted(self) -> int:
        return len(self.drafts)

    @property
    def hit_from_branch(self) -> bool:
        """This round's drafts came from a branch pre-draft (a hit whose correction was guessed)."""
        return bool(self.predraft_hit and self.predraft_branch_hit)

    @property
    def steady(self) -> bool:
        return is_steady(self.draft_prefilled, self.target_prefilled)


def is_steady(draft_prefilled: int, target_prefilled: int) -> bool:
    """No prompt prefill in either call: the round's time says something about its k. (The draft
    catches up 2 tokens after a fully accepted round: that is steady state too.) One rule for live
    rounds (the guard, the policies) and recorded ones (the tune simulator)."""
    return draft_prefilled <= 2 and target_prefilled <= 1


class RoundObserver(Protocol):
    def observe(self, record: RoundRecord) -> None: ...
