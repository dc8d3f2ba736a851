"""RequestQueue: submitted samples waiting for a slot, grouped by prompt to share one prefill.

Owns: the pending ``PrefillGroup``s in arrival order, and the token listeners of samples not yet
handed to a slot. ``add`` queues the samples of one submission (validated by the caller with
``requests.check_request``) and makes their futures; while a group with an identical prompt is
still queued it takes them, whatever their sampling, so the prompt is prefilled once however
many submissions asked for it (prefix sharing). The driver's loop admits from the head
(``head``, then ``take`` one sample at a time as slots come free, then ``retire`` the group once
empty), drops a group whose prefill failed (``remove``), and drops cancelled samples
(``reap_cancelled``).

Invariants: a sample leaves the queue exactly once -- taken (its ``Seq`` carries its listener
from then on), reaped when cancelled, or handed back by ``drain`` / ``remove`` for the caller
to settle; a listener never outlives its sample's stay here. A group empties only from the
loop thread, so an admitted head cannot vanish under the loop while it prefills.

Not thread-safe by itself: submissions come from any thread and admission from the loop
thread, so every method is called under the driver's condition variable. It never calls the
engine: prefills run outside that lock (``prefixes.py``), a submitter never waits on one.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Sequence

import numpy as np

from jaxrl_orch.inference.requests import PrefillGroup, Seq, TokenListener
from jaxrl_orch.types import SamplingParams


class RequestQueue:
    def __init__(self) -> None:
        self._groups: collections.deque[PrefillGroup] = collections.deque()
        self._listeners: dict[concurrent.futures.Future, TokenListener] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def depth(self) -> int:
        """Samples queued, over every group."""
        return sum(len(g.members) for g in self._groups)

    def add(
        self,
        prompt: np.ndarray,
        samplings: Sequence[SamplingParams],
        on_token: TokenListener | None,
    ) -> list[concurrent.futures.Future]:
        futures = [concurrent.futures.Future() for _ in samplings]
        members = list(zip(futures, samplings, strict=True))
        if on_token is not None:
            self._listeners.update((f, on_token) for f in futures)
        for group in self._groups:
            if np.array_equal(group.prompt, prompt):
                group.members.extend(members)
                return futures
        self._groups.append(PrefillGroup(prompt, members))
        return futures

    def head(self) -> PrefillGroup | None:
        return self._groups[0] if self._groups else None

    def take(self, group: PrefillGroup) -> Seq:
        """The next sample of ``group`` (a non-empty head), as the record a slot holds."""
        future, sampling = group.members.pop(0)
        listener = self._listeners.pop(future, None)
        return Seq(future, sampling, int(group.prompt.size), on_token=listener)

    def retire(self, group: PrefillGroup) -> None:
        """Drop ``group`` from the head once every sample of it was taken."""
        if not group.members and self._groups and self._groups[0] is group:
            self._groups.popleft()

    def remove(self, group: PrefillGroup) -> list[concurrent.futures.Future]:
        """Drop ``group`` whole; its samples' futures, for the caller to settle."""
        self._groups.remove(group)
        return self._forget(group)

    def reap_cancelled(self) -> None:
        for f in [f for f in self._listeners if f.cancelled()]:
            del self._listeners[f]
        for group in list(self._groups):
            group.members = [m for m in group.members if not m[0].cancelled()]
            if not group.members:
                self._groups.remove(group)

    def drain(self) -> list[concurrent.futures.Future]:
        """Empty the queue; every queued sample's future, for the caller to settle."""
        futures = []
        while self._groups:
            futures.extend(self._forget(self._groups.popleft()))
        self._listeners.clear()
        return futures

    def _forget(self, group: PrefillGroup) -> list[concurrent.futures.Future]:
        futures = [f for f, _ in group.members]
        for f in futures:
            self._listeners.pop(f, None)
        return futures
