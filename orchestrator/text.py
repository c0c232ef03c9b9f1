"""Incremental detokenisation with stop strings (pure Python)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens
# A UTF-8 character has at most 4 bytes, and a token that decodes to something at least one: past 4
# such tokens, a U+FFFD that every later decode kept is final (the character itself, or bytes that
# are no character), where the decode splits cleanly.
CHARACTER_TOKENS = 4
# Prefix of each stop string that candidate positions for a held-back suffix are searched for (C-level
# find): the shorter suffixes are checked one by one.
STOP_PROBE_CHARS = 16
# Tokens with no text of their own kept as context beside the last text (see TextAssembler._empty_context).
EMPTY_CONTEXT_TOKENS = 64
# The prompt's last tokens, the first output token's context: a SentencePiece decoder drops the
# leading space of a sequence's first token, so alone "▁Paris" after "The capital is" gave "Paris",
# and prompt text + output text lost the space (vLLM and TGI also start from the prompt's tail).
PROMPT_CONTEXT_TOKENS = 4


class TextAssembler:
    """Turns generated token ids into text deltas, with a bounded decode per token.

    New tokens are decoded together with the tokens since the last complete character as context
    (their text is the difference), not by decoding the whole output again: that made a turn
    quadratic, 0.8 ms a token at 8,000 tokens with a stop string, on the orchestrator's event loop.
    Exact where a token's text does not depend on the tokens before the context (byte-level BPE,
    SentencePiece; HFTokenizer.decode turns off the clean-up of spaces, which breaks that). A token
    that ends in the first bytes of a character keeps the characters before them visible (searched
    for stop strings, released) until the next token completes it. Holds back text that may still
    change: an incomplete character at the end, and any suffix that could begin a stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str], prompt: Sequence[int] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._probes = [s[:min(len(s) - 1, STOP_PROBE_CHARS)] for s in self._stop]
        self._ids: list[int] = []
        self._text = ""  # the text of ids[:_read]
        self._pending = ""  # the whole characters of ids[_read:], whose last token ends mid-character
        # Decoded again with the next tokens: the tokens of the last commit that had text, and those
        # committed since with none (a skipped special token, a lone SentencePiece space). Alone as
        # the context, the latter made a decoder that drops a first token's leading space drop the
        # next token's; kept beside the text, and only the last EMPTY_CONTEXT_TOKENS of them.
        # The output's text is what it adds to the prompt's (its last PROMPT_CONTEXT_TOKENS), unless
        # the prompt ends mid-character: the output's first token would complete a character the
        # prompt's text shows as U+FFFD, and the difference of the two decodes would be misaligned.
        tail = list(prompt[-PROMPT_CONTEXT_TOKENS:])
        self._context: list[int] = tail if tail and not decode(tail).endswith(INCOMPLETE) else []
        self._prompt_context = bool(self._context)  # until the first commit with text replaces it
        self._empty_context: list[int] = []
        self._token_has_text: dict[int, bool] = {}
        self._read = 0
        self._emitted = 0  # characters given out so far
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self._ids

    @property
    def emitted(self) -> str:
        return self._visible(0, self._emitted)

    def add(self, new_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; returns (text delta, how many of new_ids to keep: fewer if a stop string ended)."""
        if not self._stop:
            self._ids.extend(new_ids)
            self._decode_new()
            return self._release(self._visible_len()), len(new_ids)
        for i, token in enumerate(new_ids):
            self._ids.append(token)
            searched_to = self._visible_len()
            self._decode_new()
            cut = self._find_stop(max(0, searched_to - self._longest_stop + 1))
            if cut is not None:
                self.stopped = True
                self._text, self._pending = self._visible(0, cut), ""
                return self._release(cut), i + 1
        return self._release(self._visible_len() - self._stop_prefix_len()), len(new_ids)

    def flush(self) -> str:
        """At the end: release held-back text (without a stop string)."""
        if self.stopped:
            return ""
        self._decode_new(final=True)
        return self._release(len(self._text))

    def _decode_new(self, final: bool = False) -> None:
        """Append the text of the tokens past _read; while it ends mid-character, only show it."""
        if self._read == len(self._ids):
            return
        context = self._decode(self._context + self._empty_context)
        if self._prompt_context and not self._decode(self._context + self._empty_context + self._ids[self._read:]) \
                .startswith(context):
            # The prompt's text changes with the output's bytes after it (a byte-fallback decoder shows
            # a run with an invalid byte as one U+FFFD per byte): the difference would be misaligned.
            self._context, self._prompt_context = [], False
            context = self._decode(self._empty_context)
        new = self._text_of(context, len(self._ids))
        if final or not new.endswith(INCOMPLETE):
            self._commit(new, len(self._ids))
            return
        settled = self._settled()
        if settled is not None:
            # Still U+FFFD after more tokens than a character spans (a run of U+FFFD characters, or of
            # invalid bytes): commit up to `settled`, else nothing would stream and every token would
            # decode the whole run again. Only where every decode so far splits there: a byte-fallback
            # decoder shows a whole run of byte tokens as U+FFFD while one of them is incomplete.
            head = self._text_of(context, settled)
            if head and all(self._text_of(context, end) == head + self._decode(self._ids[settled:end])
                            for end in range(settled + 1, len(self._ids) + 1)):
                self._commit(head, settled)
                new = new[len(head):]
        self._pending = new.rstrip(INCOMPLETE)

    def _text_of(self, context: str, end: int) -> str:
        """The text of ids[_read:end] after the context."""
        return self._decode(self._context + self._empty_context + self._ids[self._read:end])[len(context):]

    def _settled(self) -> int | None:
        """Where the last CHARACTER_TOKENS tokens with text of their own begin, if after _read."""
        at, counted = len(self._ids), 0
        while at > self._read and counted < CHARACTER_TOKENS:
            at -= 1
            counted += self._has_text(self._ids[at])
        return at if counted == CHARACTER_TOKENS and at > self._read else None

    def _has_text(self, token: int) -> bool:
        """Whether the token decodes to something by itself (once per token id: tokens without text
        between a character's bytes are walked over every token until the character completes)."""
        known = self._token_has_text.get(token)
        if known is None:
            known = self._token_has_text[token] = bool(self._decode([token]))
        return known

    def _commit(self, text: str, upto: int) -> None:
        """ids[_read:upto] decode to text for good."""
        self._text += text
        self._pending = ""
        if text:
            self._context, self._empty_context, self._prompt_context = self._ids[self._read:upto], [], False
        else:
            self._empty_context = (self._empty_context + self._ids[self._read:upto])[-EMPTY_CONTEXT_TOKENS:]
        self._read = upto

    def _visible_len(self) -> int:
        return len(self._text) + len(self._pending)

    def _visible(self, start: int, end: int) -> str:
        """text + pending, [start:end], without joining the two whole."""
        n = len(self._text)
        if end <= n:
            return self._text[start:end]
        if start >= n:
            return self._pending[start - n:end - n]
        return self._text[start:] + self._pending[:end - n]

    def _release(self, end: int) -> str:
        delta = self._visible(self._emitted, end) if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self, start: int) -> int | None:
        """The first stop string at or after start in the visible text (earlier ones were searched)."""
        window = self._visible(start, self._visible_len())
        hits = [h for h in (window.find(s) for s in self._stop) if h >= 0]
        return start + min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """The longest suffix of the visible text that could begin a stop string: held back until
        it cannot."""
        end = self._visible_len()
        tail = self._visible(max(0, end - self._longest_stop), end)
        held = 0
        for stop, probe in zip(self._stop, self._probes):
            # Suffixes at least as long as the probe start where it occurs (found by str.find; the
            # earliest is the longest), the shorter ones are tried one by one: slicing every length
            # of a long stop string was quadratic in it, every round.
            at = tail.find(probe, max(0, len(tail) - len(stop) + 1)) if probe else -1
            while 0 <= at < len(tail) - held:
                if stop.startswith(tail[at:]):
                    held = len(tail) - at
                    break
                at = tail.find(probe, at + 1)
            for n in range(min(len(probe) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:n]):
                    held = n
                    break
        return held
