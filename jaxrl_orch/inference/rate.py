"""TokenRate: tokens per second over a sliding window of wall-clock time.

The driver's loop thread records how many tokens each decode step produced; any thread reads
the rate (a snapshot of the window, so a reader never sees the deque change under it). Used
for the driver's ``inference/tokens_per_s`` gauge and the HTTP server's metrics.
"""

from __future__ import annotations

import collections
import time


class TokenRate:
    def __init__(self, window_s: float = 10.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def record(self, tokens: int) -> None:
        now = time.monotonic()
        self._events.append((now, int(tokens)))
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def per_second(self) -> float:
        """Tokens after the window's first event over the time since it (0 with < 2 events)."""
        now = time.monotonic()
        window = [(t, k) for t, k in list(self._events) if now - t <= self.window_s]
        span = (now - window[0][0]) if len(window) > 1 else 0.0
        return sum(k for _, k in window[1:]) / span if span > 0 else 0.0
