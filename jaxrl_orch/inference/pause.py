"""PauseState: the driver's pause bookkeeping (vLLM's ``keep`` / ``wait`` / ``abort`` modes).

A pause is asked for from any thread (``ask``, returning a future) and put into effect by the
driver's loop thread between two decode steps (``settle``), since only that thread may touch
the slots: ``keep`` at once (requests keep their slots and KV), ``wait`` once no request is
running, ``abort`` once the driver has ended every request. A stronger mode asked for while a
weaker one is pending replaces it (abort > wait > keep), never the reverse. ``resume`` ends
a pause, or cancels one not yet in effect (its waiters get False).

Not thread-safe by itself: every method is called under the driver's condition variable.
"""

from __future__ import annotations

import concurrent.futures

from jaxrl_orch.inference.requests import PAUSE_MODES, resolve


class PauseState:
    def __init__(self) -> None:
        self.mode: str | None = None  # asked for, not in effect yet
        self.paused = False
        self._waiters: list[concurrent.futures.Future] = []

    def ask(self, mode: str) -> concurrent.futures.Future:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self.paused:
            done.set_result(True)
            return done
        if self.mode is None or PAUSE_MODES.index(mode) > PAUSE_MODES.index(self.mode):
            self.mode = mode
        self._waiters.append(done)
        return done

    def settle(self, running: bool) -> None:
        """In effect now, unless a ``wait`` still has ``running`` requests to finish. The
        caller has already ended every request for an ``abort``."""
        if self.mode is None or (self.mode == "wait" and running):
            return
        self.paused = True
        self.mode = None
        self._release(True)

    def resume(self) -> None:
        self.paused = False
        self.mode = None
        self._release(False)  # a pause overtaken by resume never took effect

    def fail(self, exc: BaseException) -> None:
        for waiter in self._waiters:
            resolve(waiter, error=exc)
        self._waiters.clear()

    def _release(self, result: bool) -> None:
        for waiter in self._waiters:
            resolve(waiter, result=result)
        self._waiters.clear()
