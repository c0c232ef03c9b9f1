"""Incremental detokenisation with stop strings (pure Python)."""
from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    """Turns generated token ids into text deltas.

    Holds back text that may still change: a trailing replacement char (an incomplete UTF-8
    sequence) and any suffix that could be the start of a stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    @property
    def ids(self) -> list[int]:
        return self._ids

    def _text(self) -> str:
        return self._decode(self._ids)

    def add(self, new_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; returns (text delta, how many of new_ids to keep: fewer if a stop string ended)."""
        keep = len(new_ids)
        for i, token in enumerate(new_ids):
            self._ids.append(token)
            if self._stop and self._find_stop(self._text()) is not None:
                keep = i + 1
                self.stopped = True
                break
        text = self._text()
        if self.stopped:
            cut = self._find_stop(text)
            final = text[:cut]
            delta = final[len(self.emitted):] if final.startswith(self.emitted) else ""
            self.emitted = final
            return delta, keep
        safe = self._safe_prefix(text)
        delta = safe[len(self.emitted):] if safe.startswith(self.emitted) else ""
        if delta:
            self.emitted = safe
        return delta, keep

    def flush(self) -> str:
        """At the end: release held-back text (without a stop string)."""
        if self.stopped:
            return ""
        text = self._text()
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [text.find(s) for s in self._stop]
        hits = [h for h in hits if h >= 0]
        return min(hits) if hits else None

    def _safe_prefix(self, text: str) -> str:
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in self._stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[:end].endswith(stop[:n]):
                    end = min(end, len(text[:end]) - n)
                    break
        return text[:end]
