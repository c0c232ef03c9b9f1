"""Incremental detokenisation with stop strings (pure Python)."""
from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens


class TextAssembler:
    """Turns generated token ids into text deltas, in time linear in the output.

    New tokens are decoded together with the tokens since the last complete character as context
    (their text is the difference), not by decoding the whole output again: that made a turn
    quadratic, 0.8 ms a token at 8,000 tokens with a stop string, on the orchestrator's event loop.
    This is exact for byte-level BPE and SentencePiece decoders, whose text for a token does not depend
    on tokens before the context. Holds back text that may still change: an incomplete UTF-8
    sequence at the end and any suffix that could be the start of a stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._text = ""  # the text of ids[:_read], whole characters only
        self._context = 0  # ids[_context:_read] are decoded again with the next tokens
        self._read = 0
        self._emitted = 0  # characters of _text given out so far
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self._ids

    @property
    def emitted(self) -> str:
        return self._text[:self._emitted]

    def add(self, new_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; returns (text delta, how many of new_ids to keep: fewer if a stop string ended)."""
        if not self._stop:
            self._ids.extend(new_ids)
            self._decode_new()
            return self._release(len(self._text)), len(new_ids)
        for i, token in enumerate(new_ids):
            self._ids.append(token)
            searched_to = len(self._text)
            self._decode_new()
            cut = self._find_stop(max(0, searched_to - self._longest_stop + 1))
            if cut is not None:
                self.stopped = True
                self._text = self._text[:cut]
                return self._release(cut), i + 1
        return self._release(len(self._text) - self._stop_prefix_len()), len(new_ids)

    def flush(self) -> str:
        """At the end: release held-back text (without a stop string)."""
        if self.stopped:
            return ""
        self._decode_new(final=True)
        return self._release(len(self._text))

    def _decode_new(self, final: bool = False) -> None:
        """Append the text of the tokens past _read, unless it ends in an incomplete character."""
        if self._read == len(self._ids):
            return
        context = self._decode(self._ids[self._context:self._read])
        text = self._decode(self._ids[self._context:])
        if len(text) > len(context) and (final or not text.endswith(INCOMPLETE)):
            self._text += text[len(context):]
            self._context, self._read = self._read, len(self._ids)

    def _release(self, end: int) -> str:
        delta = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta

    def _find_stop(self, start: int) -> int | None:
        """The first stop string in _text at or after start (earlier ones were searched before)."""
        hits = [h for h in (self._text.find(s, start) for s in self._stop) if h >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """The longest suffix of _text that could begin a stop string: held back until it cannot."""
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:n]):
                    held = n
                    break
        return held
