"""SlotTable: which request lives in which engine slot, and the decode step that feeds them.

Owns: the slot table (a ``Seq`` or None per engine slot), the engine's decode state, the decode
widths and the width the last ``generate`` ran at (``narrow.py``), and the decode accounting
(seconds spent in ``generate``, the ``TokenRate`` of the tokens it produced).

A step (``step(params, version)``): the running requests are packed below the narrowest width
holding them all, one ``generate`` runs, its result comes to the host in one round trip, and
each slot's valid tokens are recorded on its request in order until a finishing rule ends it.
The rules are applied here on the host (stop ids, ``max_tokens``, the cache length from the
engine's optional ``max_target_length``), so any engine with the JetStream method shape can be
driven; engines accepting ``insert(..., sampling=...)`` / ``generate(..., version=...)`` get
those (per-slot sampling parameters and per-token version stamps from the device).

Alternatives: a step runs the engine's top-k variant (``generate(..., top_logprobs=True)``)
only while some running request's sampling asks for ``top_logprobs``; each such request keeps
its first k of every token's alternatives.

Streaming: a ``Seq``'s ``on_token(token_id, logprob, version)`` (plus the token's
alternatives when it asks for them) is called from the loop thread per token recorded, before
its future resolves; its errors are dropped, so a listener never stops the decode loop (it
must be quick: the batch waits for it).

Invariants: a slot is freed when its request's future is settled (a ``Completion``, an abort,
the engine's error) or found cancelled, and a freed slot is refilled before the next step. A
token's version is the device's stamp when the engine reports one, else the version of the
call that produced it. An insert the engine refused fails that sample alone, unless the failed
call consumed the decode state: then it raises, for the driver to ``fail`` every running
request, which drops the state so the next admission starts a fresh one.

Driven by the driver's loop thread only: nothing here locks or waits. ``active``,
``tokens_per_s`` and the plain attributes are read by the gauges from any thread.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.inference.narrow import decode_widths, repack
from jaxrl_orch.inference.rate import TokenRate
from jaxrl_orch.inference.requests import (
    ABORTED,
    NO_LP,
    PrefillGroup,
    Seq,
    accepts,
    consumed,
    finish_reason,
    resolve,
    valid_tokens,
    valid_tops,
)
from jaxrl_orch.types import Completion


class SlotTable:
    def __init__(self, engine: JetStreamEngine, rate_window_s: float) -> None:
        self.engine = engine
        self.n_slots = int(engine.max_concurrent_decodes)
        self.widths = decode_widths(engine, self.n_slots)
        self.width = self.n_slots
        self.decode_s = 0.0
        self._slots: list[Seq | None] = [None] * self.n_slots
        self._state: Any = None
        self._rate = TokenRate(rate_window_s)
        self._cache_len = getattr(engine, "max_target_length", None)
        self._pass_sampling = accepts(engine.insert, "sampling")
        self._pass_version = accepts(engine.generate, "version")
        self._pass_top = accepts(engine.generate, "top_logprobs")

    @property
    def running(self) -> bool:
        return any(self._slots)

    @property
    def active(self) -> int:
        return sum(s is not None for s in self._slots)

    def tokens_per_s(self) -> float:
        return self._rate.per_second()

    def free(self) -> list[int]:
        """The free slots, lowest first (a refill takes the lowest, so narrowing rarely moves)."""
        return [i for i, s in enumerate(self._slots) if s is None]

    def ensure_state(self) -> None:
        if self._state is None:
            self._state = self.engine.init_decode_state()

    def insert(self, group: PrefillGroup, slot: int, seq: Seq, version: int) -> bool:
        """Put ``seq``, a sample of ``group``, into free ``slot``; False when the engine refused
        it (the sample failed alone)."""
        kwargs = {"sampling": seq.sampling} if self._pass_sampling else {}
        state = self._state
        try:
            self._state = self.engine.insert(group.prefix, state, slot, **kwargs)
        except Exception as exc:  # noqa: BLE001 - this sample's caller gets the error
            resolve(seq.future, error=exc)
            if consumed(state):  # donated to the failed call: every running request is lost
                raise
            return False
        self._slots[slot] = seq
        if group.first is not None:
            self._append(slot, seq, *group.first, version)
        return True

    def step(self, params: Any, version: int) -> None:
        """One ``generate`` over the running requests; records what it produced."""
        kwargs = {"version": version} if self._pass_version else {}
        self.width, state = repack(self.engine, self._slots, self._state, self.widths)
        kwargs.update({} if self.width == self.n_slots else {"width": self.width})
        running = [slot for slot, seq in enumerate(self._slots[: self.width]) if seq is not None]
        # The top-k variant only while a running request asks: the default program has none.
        if self._pass_top and any(self._slots[slot].top is not None for slot in running):
            kwargs["top_logprobs"] = True
        t0 = time.perf_counter()
        self._state, result = self.engine.generate(params, state, **kwargs)
        result = result.convert_to_numpy()  # the one host round trip per call
        self.decode_s += time.perf_counter() - t0
        produced = 0
        tops = valid_tops(result, running) if "top_logprobs" in kwargs else None
        for j, (slot, (tokens, logprobs, versions)) in enumerate(
            zip(running, valid_tokens(result, running), strict=True)
        ):
            seq = self._slots[slot]
            for i, token in enumerate(tokens):
                lp = logprobs[i] if logprobs is not None else NO_LP
                produced += 1
                top = tops[j][i] if tops is not None else None
                if self._append(slot, seq, token, lp, versions[i] if versions else version, top):
                    break
        self._rate.record(produced)

    def reap_cancelled(self) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None and seq.future.cancelled():
                self._slots[i] = None

    def abort(self) -> None:
        """End every running request now with what it has (``finish_reason="abort"``)."""
        for i, seq in enumerate(self._slots):
            if seq is not None:
                self._finish(i, seq, ABORTED)

    def fail(self, exc: BaseException) -> None:
        """An engine call failed mid-batch: its callers get the error; the state starts over."""
        for i, seq in enumerate(self._slots):
            if seq is not None:
                resolve(seq.future, error=exc)
                self._slots[i] = None
        self._state = None

    def _append(
        self, slot: int, seq: Seq, token: int, logprob: float, version: int, top: Any = None
    ) -> bool:
        """Record one token; finish and free the slot when a rule says so. True if finished."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        extra = ()
        if seq.top is not None:
            extra = (top[: seq.sampling.top_logprobs] if top is not None else [],)
            seq.top.append(extra[0])
        if seq.on_token is not None:
            with contextlib.suppress(Exception):  # a listener must never stop the decode loop
                seq.on_token(token, logprob, version, *extra)
        reason = finish_reason(seq, token, self._cache_len)
        if reason is not None:
            self._finish(slot, seq, reason)
        return reason is not None

    def _finish(self, slot: int, seq: Seq, reason: str) -> None:
        self._slots[slot] = None
        completion = Completion(seq.token_ids, seq.logprobs, seq.versions, reason, seq.top)
        resolve(seq.future, result=completion)
