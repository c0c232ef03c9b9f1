from __future__ import annotations

from orchestrator.text import TextAssembler
from specdec.models import ByteTokenizer

tok = ByteTokenizer()


def feed(stop: list[str], text: str, chunk: int = 1) -> tuple[str, TextAssembler, list[int]]:
    asm = TextAssembler(tok.decode, stop)
    out, kept = [], []
    ids = tok.encode(text)
    for i in range(0, len(ids), chunk):
        delta, keep = asm.add(ids[i:i + chunk])
        out.append(delta)
        kept.extend(ids[i:i + chunk][:keep])
        if asm.stopped:
            break
    out.append(asm.flush())
    return "".join(out), asm, kept


def test_stream_reassembles_multibyte_text() -> None:
    text = "héllo wörld ✓"
    assert feed([], text)[0] == text  # never emits half a UTF-8 character


def test_stop_string_cuts_text_and_tokens() -> None:
    text, asm, kept = feed(["END"], "abcENDxyz", chunk=2)
    assert text == "abc" and asm.stopped
    assert tok.decode(kept) == "abcEND"  # tokens through the one completing the stop string


def test_partial_stop_prefix_is_held_back_then_released() -> None:
    asm = TextAssembler(tok.decode, ["STOP"])
    delta, _ = asm.add(tok.encode("abST"))
    assert delta == "ab"  # "ST" might start "STOP"
    delta, _ = asm.add(tok.encode("x"))
    assert delta == "STx"
