from __future__ import annotations

import random

from orchestrator.text import INCOMPLETE, TextAssembler
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


def whole_output_reference(ids: list[int], stop: list[str], decode=tok.decode) -> tuple[str, int]:
    """What the turn must give: the text and tokens through the first token whose full decode holds a
    stop string (the text cut before it), or all of them; decoded from scratch at every token."""
    for i in range(1, len(ids) + 1):
        text = decode(ids[:i])
        hits = [h for h in (text.find(s) for s in stop) if h >= 0]
        if hits:
            return text[:min(hits)], i
    return decode(ids), len(ids)


def stream(asm: TextAssembler, ids: list[int], chunks: list[int]) -> tuple[str, int]:
    out, kept, i = [], 0, 0
    for size in chunks:
        delta, keep = asm.add(ids[i:i + size])
        out.append(delta)
        kept += keep
        i += size
        if asm.stopped:
            break
    out.append(asm.flush())
    return "".join(out), kept


# Tokens of several bytes, as byte-level BPE has them: whole characters, split ones, and whole
# characters followed by the first byte of another (Qwen's id 2226 is "о" and a lone 0xd0).
CHUNKS = [b"a", b"b", b" ", b"\n", "\u00e9".encode(), "\u2713".encode(), "\U0001f600".encode(), b"\xff", b"\x80",
          b"\xe2\x9c", "\u043e".encode() + b"\xd0", b"\x90", b"a\xf0\x9f", b"\x98\x80b", b"\xc3", b"\xa9 "]


def chunk_decode(ids: list[int]) -> str:
    return b"".join(CHUNKS[i] for i in ids).decode("utf-8", errors="replace")


def test_incremental_text_equals_decoding_the_whole_output_every_time() -> None:
    """Random multi-byte tokens (whole and split characters, invalid bytes), random stop strings and
    round sizes: the deltas add up to the reference text, and the kept tokens end at the same one."""
    rng = random.Random(7)
    stops = ["ab", "b\n", "\u00e9 a", "\u2713\u2713", "a", "\n\n", "\U0001f600b", "\u043e", "\u0410"]
    for _ in range(600):
        ids = [rng.randrange(len(CHUNKS)) for _ in range(rng.randint(0, 20))]
        stop = rng.sample(stops, rng.randint(0, 3))
        chunks = [rng.randint(1, 5) for _ in range(len(ids))]
        asm = TextAssembler(chunk_decode, stop)
        text, kept = stream(asm, ids, chunks)
        assert (text, kept) == whole_output_reference(ids, stop, chunk_decode), (ids, stop, chunks)
        assert asm.emitted == text


def test_a_stop_string_before_a_split_character_ends_the_turn_at_its_token() -> None:
    """Token 10 holds "\u043e" and the first byte of "\u0410": the stop string "\u043e" is complete
    with it, so the turn keeps two tokens, not three, and never shows the stop string."""
    for chunk in (1, 2, 10):
        asm = TextAssembler(chunk_decode, ["\u043e"])
        assert stream(asm, [0, 10, 11, 1], [chunk] * 4) == ("a", 2) and asm.stopped


def sentencepiece_decode(vocab: list[str]):
    """Like SentencePiece: '▁' is a space, and a decode drops the space its first token starts with."""
    def decode(ids: list[int]) -> str:
        text = "".join(vocab[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text
    return decode


def test_a_leading_space_dropped_by_the_decoder_is_kept_between_tokens() -> None:
    vocab = ["▁Hello", "▁world", ",", "▁how", "▁are", "▁you", "?"]
    decode = sentencepiece_decode(vocab)
    ids = [0, 1, 2, 3, 4, 5, 6]
    for stop in ([], ["are you"]):
        text, kept = stream(TextAssembler(decode, stop), ids, [1] * len(ids))
        assert (text, kept) == whole_output_reference(ids, stop, decode)
    assert stream(TextAssembler(decode, []), ids, [1] * len(ids))[0] == "Hello world, how are you?"


def test_each_token_is_decoded_with_a_short_context_not_the_whole_output() -> None:
    longest = []
    asm = TextAssembler(lambda ids: longest.append(len(ids)) or tok.decode(ids), ["STOP"])
    stream(asm, tok.encode("x" * 2000 + "é" * 100), [3] * 800)
    assert max(longest) <= 4  # the tokens of one character and its context


def test_the_hf_tokenizer_decodes_without_cleaning_up_spaces() -> None:
    """Llama 3's tokenizer cleans up " ." to "." by default: across the join of two decodes that
    lost the "." of "word ." in a stream ("word  next" against "word. next" decoded whole)."""
    from specdec.tokenizers import HFTokenizer

    class Recording:
        def decode(self, ids, **kwargs):
            self.kwargs = kwargs
            return ""
    tok = Recording()
    HFTokenizer(tok, [0]).decode([1, 2])
    assert tok.kwargs == {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}


def test_the_chat_and_document_ends_a_tokenizer_has_end_a_generation() -> None:
    """The default model's GGUF names one eos (<|im_end|>); its published generation config also
    stops at <|endoftext|>, which the conversion lost, so a completion ran on past the end of its
    document. Special tokens of END_OF_GENERATION_TOKENS end it too; plain text spelling one does not."""
    from specdec.tokenizers import end_of_generation_ids

    class Tok:
        all_special_tokens = ["<|endoftext|>", "<|im_end|>", "<unk>"]
        unk_token_id = 0
        ids = {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|eot_id|>": 0}

        def convert_tokens_to_ids(self, text):
            return self.ids.get(text, self.unk_token_id)
    assert end_of_generation_ids(Tok()) == {151643, 151645}
    Tok.all_special_tokens = ["<|endoftext|>", "<|end|>"]  # <|end|>: gpt-oss ends its analysis with it
    Tok.ids = {**Tok.ids, "<|end|>": 200007}
    assert end_of_generation_ids(Tok()) == {151643}
    Tok.all_special_tokens = []  # added tokens that are not special are text
    assert end_of_generation_ids(Tok()) == set()


def test_a_skipped_special_token_keeps_the_next_tokens_space() -> None:
    """A special token decodes to nothing: as the next token's only context, a SentencePiece-style
    decoder dropped that token's leading space ("Helloworld"), and the stop string " world" was missed."""
    vocab = ["▁Hello", "", "▁world", ".", "▁how"]  # id 1: a skipped special token
    decode = sentencepiece_decode(vocab)
    ids = [0, 1, 2, 3, 4]
    for stop in ([], [" world"], [". how"]):
        for size in (1, 2, 5):
            assert stream(TextAssembler(decode, stop), ids, [size] * 5) == whole_output_reference(ids, stop, decode)
    assert stream(TextAssembler(decode, []), ids, [1] * 5)[0] == "Hello world. how"
    # A lone space token decodes to nothing by itself too, yet it is the next token's context.
    decode = sentencepiece_decode(["▁", "▁Hello"])
    assert stream(TextAssembler(decode, ["x"]), [0, 1], [1, 1]) == (" Hello", 2) == whole_output_reference([0, 1], ["x"], decode)
    # However many skipped tokens come between (the context keeps the last 64 beside the text).
    ids = [0, *[1] * 100, 2, 3, 4]
    decode = sentencepiece_decode(vocab)
    assert stream(TextAssembler(decode, [" world"]), ids, [1] * len(ids)) == whole_output_reference(ids, [" world"], decode)


def test_a_run_of_replacement_characters_streams_and_decodes_a_bounded_context() -> None:
    """U+FFFD as a character (or invalid bytes) is final once more tokens follow than a character
    spans: it was held as if incomplete, so nothing streamed and each token decoded the whole run."""
    longest: list[int] = []
    ids = tok.encode("\ufffd" * 300) + [0xFF] * 300 + tok.encode("ok")
    asm = TextAssembler(lambda part: longest.append(len(part)) or tok.decode(part), ["STOP"])
    deltas = [asm.add([token])[0] for token in ids]
    assert len("".join(deltas)) >= 590  # all but the last few characters before the end
    assert "".join(deltas) + asm.flush() == tok.decode(ids)
    assert max(longest) <= 16


def test_the_held_back_stop_prefix_is_the_longest_suffix_that_begins_a_stop_string() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 10)))
        expected = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        asm = TextAssembler(tok.decode, stop)
        asm._text = text  # the held-back rule alone, on text no stop string is in
        assert asm._stop_prefix_len() == expected, (stop, text)


SPECIAL = -1  # a skipped special token: decodes to nothing, and the bytes around it join


def byte_fallback_decode(ids: list[int]) -> str:
    """Like SentencePiece's byte fallback: ids < 256 are byte tokens, 256 + i is the character chr(i).
    A run of byte tokens that is not valid UTF-8 as a whole decodes to one U+FFFD per byte, so the
    characters already complete in it turn to U+FFFD while a later one is incomplete."""
    out, run = [], bytearray()
    for i in [*(i for i in ids if i != SPECIAL), None]:
        if i is not None and i < 256:
            run.append(i)
            continue
        try:
            out.append(run.decode("utf-8"))
        except UnicodeDecodeError:
            out.append("\ufffd" * len(run))
        run.clear()
        if i is not None:
            out.append(chr(i - 256))
    return "".join(out)


def test_text_held_for_an_incomplete_character_is_not_committed_from_a_byte_run_shown_as_invalid() -> None:
    """Also with U+FFFD as a character (as bytes it looks like the placeholder) and with skipped special
    tokens anywhere, inside a character's bytes too (a character then spans more than 4 tokens)."""
    rng = random.Random(5)
    for _ in range(600):
        ids: list[int] = []
        for _ in range(rng.randint(1, 12)):
            char = rng.choice("ab\u0442\u0440\ufb01\U0001f600\ufffd")
            ids += list(char.encode()) if rng.random() < 0.7 else [256 + ord(char)]
            for _ in range(rng.choice([0, 0, 0, 1, 5])):
                ids.insert(rng.randint(0, len(ids)), SPECIAL)
        stop = rng.sample(["b\ufb01", "\u0442\u0440", "\U0001f600a"], rng.randint(0, 2))
        chunks = [rng.randint(1, 5) for _ in ids]
        text, kept = stream(TextAssembler(byte_fallback_decode, stop), ids, chunks)
        assert (text, kept) == whole_output_reference(ids, stop, byte_fallback_decode), (ids, stop, chunks)


def test_a_character_split_by_a_long_run_of_tokens_without_text_is_still_one_character() -> None:
    """ByteTokenizer's ids 256+ decode to nothing and the bytes around them join: a cut after 66 of
    them (to bound the decode per token) committed the first byte as U+FFFD and lost the character."""
    ids = [0xE2] + [258] * 200 + [0x82, 0xAC] + tok.encode("xSTOP")
    for stop in ([], ["\u20acx"]):
        assert stream(TextAssembler(tok.decode, stop), ids, [1] * len(ids)) == whole_output_reference(ids, stop, tok.decode)


def test_the_output_text_is_what_it_adds_to_the_prompts_text() -> None:
    """A SentencePiece decoder drops a sequence's first leading space: decoded alone, the output
    "▁Paris" after the prompt "The capital is" was "Paris", and prompt + output text read "isParis".
    With the prompt's tail as the first token's context, prompt text + output text is the whole
    decode; text in the prompt never matches a stop string; byte-level decoders are unchanged."""
    vocab = ["▁The", "▁capital", "▁is", "▁Paris", ".", "▁It"]
    decode = sentencepiece_decode(vocab)
    prompt, output = [0, 1, 2], [3, 4, 5]
    for size in (1, 2, 3):
        asm = TextAssembler(decode, [], prompt)
        assert stream(asm, output, [size] * 3) == (" Paris. It", 3)
        assert decode(prompt) + " Paris. It" == decode(prompt + output)
    # A stop string that the prompt's text would complete is not found there.
    assert stream(TextAssembler(decode, ["is Paris"], prompt), output, [1] * 3) == (" Paris. It", 3)
    assert stream(TextAssembler(decode, [" It"], prompt), output, [1] * 3) == (" Paris.", 3)
    # Without a prompt (or with one whose tail decodes to nothing), as before.
    assert stream(TextAssembler(decode, []), output, [1] * 3)[0] == "Paris. It"
    # Byte-level tokens: the same text with or without the prompt.
    ids = tok.encode("héllo wörld")
    assert stream(TextAssembler(tok.decode, [], tok.encode("a prompt ")), ids, [1] * len(ids))[0] == "héllo wörld"


def test_a_prompt_that_ends_mid_character_is_no_context() -> None:
    """The prompt's last bytes begin a character the output's first token completes: the prompt's
    text ends in U+FFFD, so the difference of two decodes would be misaligned; no context then."""
    data = "a€b".encode()
    prompt, output = list(tok.encode("x")) + list(data[:2]), list(data[2:])  # € split 2 + 1 bytes
    text, kept = stream(TextAssembler(tok.decode, [], prompt), output, [1] * len(output))
    assert kept == len(output) and text == stream(TextAssembler(tok.decode, []), output, [1] * len(output))[0]


def sentencepiece_byte_runs(vocab: dict[int, str]):
    """Like HF's ByteFallback: ids < 256 are byte tokens, and a run of them that is not valid UTF-8
    decodes to one U+FFFD per byte; '▁' is a space, dropped at the start (SentencePiece)."""
    def decode(ids: list[int]) -> str:
        out: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                try:
                    out.append(bytes(run).decode("utf-8"))
                except UnicodeDecodeError:
                    out.append(INCOMPLETE * len(run))
                run.clear()
        for i in ids:
            if i < 256:
                run.append(i)
            else:
                flush()
                out.append(vocab[i].replace("▁", " "))
        flush()
        text = "".join(out)
        return text[1:] if text.startswith(" ") else text
    return decode


def test_a_prompt_whose_text_the_output_changes_is_no_context() -> None:
    """The prompt ends in a whole byte-fallback character and the output starts with a lone byte: the
    run of bytes decodes as U+FFFD per byte, the prompt's own included, so the two decodes' difference
    would show extra characters. The output is then decoded alone; a prompt tail with no text of its
    own changes nothing either."""
    vocab = {300: "▁x", 301: "▁a", 302: "▁is", 303: ""}
    decode = sentencepiece_byte_runs(vocab)
    prompt, output = [302, *"中".encode()], [0xE2, 301]
    alone = stream(TextAssembler(decode, []), output, [1, 1])
    assert alone == (INCOMPLETE + " a", 2)
    for size in (1, 2):
        assert stream(TextAssembler(decode, [], prompt), output, [size] * 2) == alone
    assert stream(TextAssembler(decode, [], [303, 303]), [300, 301], [1, 1]) == ("x a", 2)  # as without a prompt
