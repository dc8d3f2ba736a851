"""Stop strings: cutting a completion's text before the first one it contains.

What it owns: OpenAI's ``stop`` semantics on decoded text for one choice. Text arrives in
deltas (``feed``); released text never contains a stop string, and never ends with a prefix of
one that the next delta could complete (that much is held back, like vLLM). When a stop string
appears, ``feed`` releases the text before it and reports the hit; everything after is dropped.
``flush`` releases the held-back tail once the completion ended without a hit.

Invariant: the concatenation of released text equals the full text cut before the earliest
occurrence of any stop string, however the text was split into deltas (a stop string that
straddles two deltas is still found).

Pure string work on the server's event loop; the caller cancels the engine request on a hit.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(stops)
        self._held = ""  # text not yet released: it may still begin a stop string
        self.hit: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        """``(text to release, whether a stop string ended the text)``."""
        if self.hit is not None or not delta:
            return "", self.hit is not None
        if not self._stops:
            return delta, False
        text = self._held + delta
        found = [(text.find(s), s) for s in self._stops if s in text]
        if found:
            at, self.hit = min(found)
            self._held = ""
            return text[:at], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held = self._held
        self._held = ""
        return "" if self.hit is not None else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
