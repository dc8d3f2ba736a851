"""StopFlag: a stop asked for by SIGTERM / Ctrl-C, as every stage of the run sees it.

What it owns: one flag, set from the signal handler (any thread), read three ways: ``is_set``
(this process), ``group_requested`` (a trainer group: process 0's flag, told to all at once,
so every process leaves the same SFT step together) and ``wait`` (the RL stage's event loop
polls it and starts the drain). The stages receive it as an argument; nothing registers a
callback on it. ``report`` says, once the stop's checkpoint is committed, how long after the
signal it was, against the bound the run states.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from jaxrl_orch.config.orchestrator import SAVE_AFTER_DRAIN_S
from jaxrl_orch.distributed.group import Role

POLL_S = 0.1  # how soon the event loop notices a stop (a drain then takes seconds)


class StopFlag:
    def __init__(self, role: Role) -> None:
        self._event = threading.Event()
        self._group = role.kind == "trainer" and role.trainer_processes > 1
        self.signal: int | None = None  # the signal that asked, for the summary
        self.asked_at: float | None = None  # time.monotonic() when it asked

    def set(self, signum: int | None = None) -> None:
        self.signal = signum
        self.asked_at = time.monotonic()
        self._event.set()

    def report(self, drain_timeout_s: float) -> dict[str, Any] | None:
        """Once the stop's checkpoint is committed: how long after the signal, against the
        bound the run states (the drain, then ``SAVE_AFTER_DRAIN_S`` for the step in flight and
        the write); said on the console and kept in ``summary.json["stop"]``. None: no stop."""
        if self.asked_at is None:
            return None
        saved = time.monotonic() - self.asked_at
        bound = drain_timeout_s + SAVE_AFTER_DRAIN_S
        within = saved <= bound
        mark = "==" if within else "!!"
        after = SAVE_AFTER_DRAIN_S
        print(
            f"{mark} stop: saved {saved:.1f} s after the signal (bound {bound:g} s: the drain, "
            f"at most {drain_timeout_s:g} s, then {after:g} s for the step in flight and the "
            "checkpoint)",
            flush=True,
        )
        return {"saved_s": saved, "bound_s": bound, "within_bound": within}

    def is_set(self) -> bool:
        return self._event.is_set()

    def group_requested(self) -> bool:
        """Collective in a trainer group: every process must call it at the same point."""
        if self._group:
            return bool(multihost_utils.broadcast_one_to_all(np.array(self._event.is_set())))
        return self._event.is_set()

    async def wait(self) -> None:
        while not self._event.is_set():
            await asyncio.sleep(POLL_S)
