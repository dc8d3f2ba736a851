"""StopFlag: a stop asked for by SIGTERM / Ctrl-C, as every stage of the run sees it.

What it owns: one flag, set from the signal handler (any thread), read three ways: ``is_set``
(this process), ``group_requested`` (a trainer group: process 0's flag, told to all at once,
so every process leaves the same SFT step together) and ``wait`` (the RL stage's event loop
polls it and starts the drain). The stages receive it as an argument; nothing registers a
callback on it.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
from jax.experimental import multihost_utils

from jaxrl_orch.distributed.group import Role

POLL_S = 0.1  # how soon the event loop notices a stop (a drain then takes seconds)


class StopFlag:
    def __init__(self, role: Role) -> None:
        self._event = threading.Event()
        self._group = role.kind == "trainer" and role.trainer_processes > 1
        self.signal: int | None = None  # the signal that asked, for the summary

    def set(self, signum: int | None = None) -> None:
        self.signal = signum
        self._event.set()

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
