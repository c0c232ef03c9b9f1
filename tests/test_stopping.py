"""Stop conditions as objects, applied in one place (pure Python)."""
from __future__ import annotations

from orchestrator.stopping import ContextLimit, EosToken, MaxNewTokens, StopConditions
from specdec.tokenizers import ByteTokenizer

EOS = ByteTokenizer.EOS


def conditions(max_new: int = 10, room: int = 100, stop: tuple[str, ...] = ()) -> StopConditions:
    return StopConditions.for_turn([EOS], max_new, room, stop, ByteTokenizer().decode)


def test_each_condition_cuts_where_it_ends_the_turn() -> None:
    assert EosToken(frozenset({EOS})).cut(0, [65, EOS, 66]) == 2  # the EOS token is kept
    assert EosToken(frozenset({EOS})).cut(0, [65, 66]) is None
    assert MaxNewTokens(5).cut(3, [1, 2, 3]) == 2 and MaxNewTokens(5).cut(0, [1]) is None
    assert ContextLimit(4).cut(2, [1, 2, 3]) == 2


def test_budget_then_eos_then_stop_string() -> None:
    stop = conditions(max_new=4)
    out = stop.apply([65, 66])
    assert (out.tokens, out.finish, out.text_delta) == ((65, 66), None, "AB")
    assert stop.remaining == 2
    out = stop.apply([67, 68, 69])  # past the budget
    assert (out.tokens, out.finish, out.text_delta) == ((67, 68), "length", "CD")


def test_eos_within_the_budget_wins_a_tie_with_length() -> None:
    out = conditions(max_new=2).apply([65, EOS, 66])
    assert (out.tokens, out.finish) == ((65, EOS), "eos")


def test_eos_beyond_the_budget_is_cut_off() -> None:
    out = conditions(max_new=2).apply([65, 66, EOS])
    assert (out.tokens, out.finish) == ((65, 66), "length")


def test_stop_string_cuts_tokens_and_text_even_across_rounds() -> None:
    stop = conditions(stop=("XY",))
    first = stop.apply([65, ord("X")])
    assert first.finish is None and first.text_delta == "A"  # "X" is held back: it may start "XY"
    second = stop.apply([ord("Y"), 66])
    assert (second.tokens, second.finish, second.text_delta) == ((ord("Y"),), "stop", "")
    assert stop.full_text == "A"


def test_context_limit() -> None:
    out = conditions(max_new=10, room=3).apply([65, 66, 67, 68])
    assert (out.tokens, out.finish) == ((65, 66, 67), "context")
