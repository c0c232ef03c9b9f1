"""When a turn ends: each stop condition is an object, and one place applies them (pure Python)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from orchestrator.text import TextAssembler

FinishReason = Literal["eos", "length", "context", "stop"]


class TokenCondition(Protocol):
    reason: FinishReason

    def cut(self, generated: int, new_tokens: Sequence[int]) -> int | None:
        """If the turn ends within new_tokens (after `generated` earlier tokens), how many to keep."""
        ...


@dataclass(frozen=True)
class EosToken:
    ids: frozenset[int]
    reason: FinishReason = "eos"

    def cut(self, generated: int, new_tokens: Sequence[int]) -> int | None:
        for i, token in enumerate(new_tokens):
            if token in self.ids:
                return i + 1  # the end-of-sequence token itself is part of the output
        return None


@dataclass(frozen=True)
class MaxNewTokens:
    limit: int
    reason: FinishReason = "length"

    def cut(self, generated: int, new_tokens: Sequence[int]) -> int | None:
        left = self.limit - generated
        return left if len(new_tokens) >= left else None


@dataclass(frozen=True)
class ContextLimit:
    room: int  # tokens the context has left for this turn's output
    reason: FinishReason = "context"

    def cut(self, generated: int, new_tokens: Sequence[int]) -> int | None:
        left = self.room - generated
        return left if len(new_tokens) >= left else None


@dataclass(frozen=True)
class Emitted:
    """What a round adds to the output once the stop conditions have had their say."""
    tokens: tuple[int, ...]
    text_delta: str
    finish: FinishReason | None


class StopConditions:
    """EOS, max tokens and the context limit cut on token ids (the earliest cut wins, in that order of
    precedence on a tie); stop strings cut on the decoded text, which also yields the text deltas."""

    def __init__(self, conditions: Sequence[TokenCondition], stop_strings: Sequence[str],
                 decode: Callable[[list[int]], str], budget: int, prompt: Sequence[int] = ()) -> None:
        self.conditions = list(conditions)
        self.text = TextAssembler(decode, stop_strings, prompt)  # the text the output adds to the prompt's
        self.budget = budget  # the most tokens the turn can produce
        self.generated = 0

    @classmethod
    def for_turn(cls, eos_ids: Sequence[int], max_new_tokens: int, context_room: int,
                 stop_strings: Sequence[str], decode: Callable[[list[int]], str],
                 prompt: Sequence[int] = ()) -> "StopConditions":
        return cls([EosToken(frozenset(eos_ids)), MaxNewTokens(max_new_tokens), ContextLimit(context_room)],
                   stop_strings, decode, min(max_new_tokens, context_room), prompt)

    @property
    def remaining(self) -> int:
        """Tokens the turn may still produce (a round never drafts past this)."""
        return self.budget - self.generated

    @property
    def full_text(self) -> str:
        return self.text.emitted

    def apply(self, new_tokens: Sequence[int]) -> Emitted:
        tokens = list(new_tokens)
        finish: FinishReason | None = None
        for condition in self.conditions:
            keep = condition.cut(self.generated, tokens)
            if keep is not None and (finish is None or keep < len(tokens)):
                tokens, finish = tokens[:keep], condition.reason
        delta, keep = self.text.add(tokens)
        if self.text.stopped:
            tokens, finish = tokens[:keep], "stop"
        elif finish is not None:
            delta += self.text.flush()
        self.generated += len(tokens)
        return Emitted(tuple(tokens), delta, finish)
