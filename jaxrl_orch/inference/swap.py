"""ParamSwap: the params the driver decodes with, and a newer set waiting to take over.

Owns: the current ``params`` and their ``version``, at most one pending swap, and the futures of
the callers waiting for a swap to land. ``ask`` comes from any thread; ``land`` from the
driver's loop thread between two ``generate`` calls, never during one, so a call decodes with a
single version and each token carries the version of the call that produced it.

Invariants: versions never go backwards (``ask`` raises ``ValueError`` for one below the
current or the pending version). A newer ``ask`` before the pending one landed replaces it: only
the newest params are ever used, and every waiter resolves with the version that landed (its
own, or the newer one). Each waiter is settled exactly once: by ``land``, or by ``fail`` when
the driver stops first. A swap touches no KV: what the cache holds is kept (no re-prefill);
prefixes are keyed by version (``prefixes.py``), so a queued prompt is prefilled anew.

Not thread-safe by itself: ``ask``, ``land`` and ``fail`` are called under the driver's
condition variable. ``params`` and ``version`` are read by the loop thread (the only one that
changes them) without it, and ``version`` by any thread as a plain attribute.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from jaxrl_orch.inference.requests import resolve


class ParamSwap:
    def __init__(self, params: Any, version: int) -> None:
        self.params = params
        self.version = int(version)
        self._pending: tuple[Any, int] | None = None
        self._waiters: list[concurrent.futures.Future] = []

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def ask(self, params: Any, version: int) -> concurrent.futures.Future:
        """A future resolved with the version in use once ``params`` (or newer ones) landed."""
        latest = self._pending[1] if self._pending else self.version
        if version < latest:
            raise ValueError(f"version must not go backwards: current {latest}, got {version}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._pending = (params, int(version))
        self._waiters.append(done)
        return done

    def land(self) -> None:
        """Switch to the pending params, if any; their waiters learn the version now in use."""
        if self._pending is None:
            return
        self.params, self.version = self._pending
        self._pending = None
        for waiter in self._waiters:
            resolve(waiter, result=self.version)
        self._waiters.clear()

    def fail(self, exc: BaseException) -> None:
        for waiter in self._waiters:
            resolve(waiter, error=exc)
        self._waiters.clear()
