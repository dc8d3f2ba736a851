"""InferenceDriver: continuous batching over an engine's decode slots, in one background thread.

Owns: the request queue, the slot table (which request lives in which engine slot), the
decode state, the current ``(params, version)`` and the prefills (``prefixes.Prefixes``, with
its optional cache). Nothing else touches the engine while the driver runs.

How a request flows: ``submit(prompt_ids, sampling, n)`` queues one *group* (n samples of one
prompt, each with its own ``SamplingParams`` if a list is given; a pending submission of an
identical prompt joins the existing group whatever its sampling) and returns one
``concurrent.futures.Future[Completion]`` per sample. The loop thread prefills a group's
prompt once (or takes it from the prefix cache, keyed by ``(tokens, version)``) and inserts
that prefix into each of the group's slots as slots come free (prefix sharing), then calls
``generate`` and routes every valid token to its slot's request. A slot whose request finishes
(stop token, max tokens, cache full) or is cancelled is refilled before the next generate.

Narrow decoding (``narrow.py``): each call runs only the narrowest width holding every running
request, when the engine offers narrow widths.

Invariants:
- ``swap_params`` takes effect at the next ``generate`` call; every token carries the version
  of the params of the call that produced it. KV already in the cache is kept (no re-prefill);
  a queued prefix computed under an older version is recomputed before insertion.
- Every future is resolved exactly once: a ``Completion``, or the exception its engine call
  raised, or ``RuntimeError`` when the driver stops first. An engine error fails only what it
  concerns (a prefill its group, an insert its sample, a generate the running requests) and
  never kills the thread or the process. A cancelled future frees its slot at the next turn.
- ``stop()`` joins the thread: no thread is left behind.

Pause (vLLM's three modes, for weight updates between decode steps): ``pause("keep")`` stops
decoding after the current step with every request holding its slot and KV, so it continues
where it stopped after ``resume()``; ``pause("wait")`` admits nothing new and pauses once the
running requests have finished; ``pause("abort")`` ends every running and queued request now
with what it has (``finish_reason="abort"``). While paused, submissions queue and swaps land, so
the tokens a kept request generates after ``resume()`` carry the new version.

Streaming: ``submit(..., on_token=f)`` calls ``f(token_id, logprob, version)`` from the loop
thread per token recorded (the futures still resolve); it must be quick (its errors are dropped).

Finishing rules are applied here on the host (stop ids, ``max_tokens``, cache length from the
engine's optional ``max_target_length``), so any engine with the JetStream method shape can
be driven; engines accepting ``insert(..., sampling=...)`` / ``generate(..., version=...)`` get
those (per-slot sampling parameters and per-token version stamps from the device).
This module must never import orchestration code or block the caller's event loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl_orch.inference.narrow import decode_widths, repack, warm_up
from jaxrl_orch.inference.pause import PauseState
from jaxrl_orch.inference.prefixes import Prefixes
from jaxrl_orch.inference.rate import TokenRate
from jaxrl_orch.inference.requests import (
    ABORTED,
    NO_LP,
    STOPPED,
    PrefillGroup,
    RequestLimits,
    Seq,
    accepts,
    check_request,
    consumed,
    finish_reason,
    resolve,
    valid_tokens,
)
from jaxrl_orch.types import Completion, SamplingParams


class InferenceDriver:
    def __init__(
        self,
        engine: Any,
        params: Any,
        version: int = 0,
        *,
        prefix_cache_size: int = 16,
        idle_wait_s: float = 0.05,
        rate_window_s: float = 10.0,
        gate: threading.Event | None = None,  # decode only while set (overlap.OverlapSchedule)
    ) -> None:
        self.engine = engine
        self._params, self._version = params, int(version)
        self._pending_swap: tuple[Any, int] | None = None
        self._swap_waiters: list[concurrent.futures.Future] = []
        self._prefixes = Prefixes(engine, prefix_cache_size)
        self._idle_wait_s = idle_wait_s
        self._gate = gate
        self._rate = TokenRate(rate_window_s)
        self._n_slots = int(engine.max_concurrent_decodes)
        self._limits = RequestLimits.of(engine)
        self._cache_len = getattr(engine, "max_target_length", None)
        self._pass_sampling = accepts(engine.insert, "sampling")
        self._pass_version = accepts(engine.generate, "version")
        self._widths = decode_widths(engine, self._n_slots)
        self._width = self._n_slots
        self._cv = threading.Condition()
        self._pending: collections.deque[PrefillGroup] = collections.deque()
        self._slots: list[Seq | None] = [None] * self._n_slots
        self._decode_state: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._listeners: dict[concurrent.futures.Future, Callable[[int, float, int], Any]] = {}
        self._pause = PauseState()
        self._decode_s = 0.0

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._pause.paused

    def submit(
        self,
        prompt_ids: Any,
        sampling: SamplingParams | Sequence[SamplingParams],
        n: int | None = None,
        on_token: Callable[[int, float, int], Any] | None = None,
    ) -> list[concurrent.futures.Future]:
        """Queue samples of one prompt; returns one future per sample (thread-safe).

        ``sampling`` is one ``SamplingParams`` for all ``n`` samples (default 1), or a sequence
        with one per sample (then ``n`` defaults to, and must equal, its length). ``on_token``:
        see Streaming in the module docstring.
        """
        prompt, samplings = check_request(prompt_ids, sampling, n, self._limits)
        futures = [concurrent.futures.Future() for _ in samplings]
        members = list(zip(futures, samplings, strict=True))
        with self._cv:
            if self._stopped or self._stopping:
                raise RuntimeError("InferenceDriver is stopped; submit() needs a running driver")
            if on_token is not None:
                self._listeners.update((f, on_token) for f in futures)
            for group in self._pending:  # identical prompt: share its prefill
                if np.array_equal(group.prompt, prompt):
                    group.members.extend(members)
                    break
            else:
                self._pending.append(PrefillGroup(prompt, members))
            self._cv.notify_all()
        return futures

    def swap_params(self, params: Any, version: int) -> concurrent.futures.Future:
        """Use ``params`` (stamped ``version``) from the next generate step on.

        Returns a future resolved with the version once the driver has switched (before any
        token is generated with it); a swap superseded by a newer one before it landed resolves
        with the newer version.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            latest = self._pending_swap[1] if self._pending_swap else self._version
            if version < latest:
                raise ValueError(f"version must not go backwards: current {latest}, got {version}")
            self._pending_swap = (params, int(version))
            self._swap_waiters.append(done)
            self._cv.notify_all()
        return done

    def pause(self, mode: str = "keep") -> concurrent.futures.Future:
        """Pause decoding (see Pause in the module docstring); the future resolves with True once
        the pause is in effect: no decode step runs until ``resume()``."""
        with self._cv:
            if self._stopped or self._stopping:
                raise RuntimeError(STOPPED)
            done = self._pause.ask(mode)
            self._cv.notify_all()
        return done

    def resume(self) -> None:
        """Decode again: kept requests continue, queued ones are admitted (a no-op when running)."""
        with self._cv:
            self._pause.resume()
            self._cv.notify_all()

    @property
    def num_prefills(self) -> int:
        return self._prefixes.count

    def warm_up(self) -> float:
        """Compile every program the loop can call (``narrow.warm_up``) before ``start``, so
        none compiles mid-run; returns the seconds it took."""
        return warm_up(self.engine, self._params, self._version, self._widths)

    def start(self) -> None:
        with self._cv:
            if self._thread is not None:
                raise RuntimeError("InferenceDriver.start() called twice")
            self._thread = threading.Thread(target=self._run, name="inference-driver", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cv:
            self._stopped = True
            self._fail_everything(RuntimeError(STOPPED))
            for waiter in self._swap_waiters:
                resolve(waiter, error=RuntimeError(STOPPED))
            self._swap_waiters.clear()
            self._pause.fail(RuntimeError(STOPPED))

    def gauges(self) -> dict[str, float]:
        with self._cv:  # submit() may be growing the queue from another thread
            queued = sum(len(g.members) for g in self._pending)
        return {
            "inference/active_slots": float(sum(s is not None for s in self._slots)),
            "inference/queue_depth": float(queued),
            "inference/tokens_per_s": self._rate.per_second(),
            "inference/prefill_s": self._prefixes.seconds,  # cumulative seconds in prefill
            "inference/decode_s": self._decode_s,  # cumulative seconds in generate
            "inference/version": float(self._version),
            "inference/decode_width": float(self._width),  # slots the last generate ran
            "inference/paused": float(self._pause.paused),
        }

    def _has_work(self) -> bool:
        if self._stopping or self._pending_swap or self._pause.mode:
            return True
        return not self._pause.paused and (bool(self._pending) or any(self._slots))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait(self._idle_wait_s)
                if self._stopping:
                    return
                if self._pending_swap is not None:
                    (self._params, self._version), self._pending_swap = self._pending_swap, None
                    for waiter in self._swap_waiters:
                        resolve(waiter, result=self._version)
                    self._swap_waiters.clear()
                if self._pause.mode == "abort":
                    self._abort_all()
                self._pause.settle(running=any(self._slots))
                if self._pause.paused:
                    continue
            while self._gate is not None and not self._gate.is_set() and not self._stopping:
                self._gate.wait(self._idle_wait_s)  # the trainer's step has the cores
            try:
                self._reap_cancelled()
                if self._pause.mode is None:  # "wait": the running ones finish, nothing new
                    self._admit()
                if any(self._slots):
                    self._step()
                else:
                    with self._cv:  # everything queued was cancelled: nap instead of spinning
                        if not self._pending_swap and not self._stopping:
                            self._cv.wait(self._idle_wait_s)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any engine error
                self._fail_active(exc)

    def _abort_all(self) -> None:
        """Under ``_cv``, in the loop thread: end every request now with what it has."""
        for i, seq in enumerate(self._slots):
            if seq is not None:
                self._finish(i, seq, ABORTED)
        while self._pending:
            for f, _ in self._pending.popleft().members:
                self._listeners.pop(f, None)
                resolve(f, result=Completion([], [], [], ABORTED))

    def _reap_cancelled(self) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None and seq.future.cancelled():
                self._slots[i] = None
        with self._cv:
            for f in [f for f in self._listeners if f.cancelled()]:
                del self._listeners[f]
            for group in list(self._pending):
                group.members = [m for m in group.members if not m[0].cancelled()]
                if not group.members:
                    self._pending.remove(group)

    def _admit(self) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        while free:
            with self._cv:
                if not self._pending:
                    return
                group = self._pending[0]
            try:
                self._ensure_prefix(group)
                if self._decode_state is None:
                    self._decode_state = self.engine.init_decode_state()
            except Exception as exc:  # noqa: BLE001 - this group's callers get the error
                with self._cv:
                    self._pending.remove(group)
                for f, _ in group.members:
                    resolve(f, error=exc)
                continue
            while free and group.members:
                with self._cv:
                    future, sampling = group.members.pop(0)
                if not future.cancelled() and self._insert(group, free[0], future, sampling):
                    free.pop(0)
            with self._cv:
                if not group.members and self._pending and self._pending[0] is group:
                    self._pending.popleft()

    def _insert(
        self,
        group: PrefillGroup,
        slot: int,
        future: concurrent.futures.Future,
        sampling: SamplingParams,
    ) -> bool:
        """Put one sample of ``group`` into free ``slot``; False when the engine refused it (that
        sample fails alone, unless the refused call consumed the decode state)."""
        kwargs = {"sampling": sampling} if self._pass_sampling else {}
        state = self._decode_state
        with self._cv:
            listener = self._listeners.pop(future, None)
        try:
            self._decode_state = self.engine.insert(group.prefix, state, slot, **kwargs)
        except Exception as exc:  # noqa: BLE001 - this sample's caller gets the error
            resolve(future, error=exc)
            if consumed(state):  # donated to the failed call: every running request is lost
                raise
            return False
        self._slots[slot] = seq = Seq(future, sampling, int(group.prompt.size), on_token=listener)
        if group.first is not None:
            self._append(slot, seq, *group.first, self._version)
        return True

    def _ensure_prefix(self, group: PrefillGroup) -> None:
        if group.prefix is not None and group.prefix_version == self._version:
            return
        group.prefix, group.first = self._prefixes.get(group.prompt, self._params, self._version)
        group.prefix_version = self._version

    def _step(self) -> None:
        kwargs = {"version": self._version} if self._pass_version else {}
        state = self._decode_state  # the running requests packed below the narrowest width
        self._width, state = repack(self.engine, self._slots, state, self._widths)
        kwargs.update({} if self._width == self._n_slots else {"width": self._width})
        version = self._version
        t0 = time.perf_counter()
        self._decode_state, result = self.engine.generate(self._params, state, **kwargs)
        result = result.convert_to_numpy()  # the one host round trip per call
        self._decode_s += time.perf_counter() - t0
        produced = 0
        running = [slot for slot, seq in enumerate(self._slots[: self._width]) if seq is not None]
        for slot, (tokens, logprobs, versions) in zip(
            running, valid_tokens(result, running), strict=True
        ):
            seq = self._slots[slot]
            for i, token in enumerate(tokens):
                lp = logprobs[i] if logprobs is not None else NO_LP
                produced += 1
                if self._append(slot, seq, token, lp, versions[i] if versions else version):
                    break
        self._rate.record(produced)

    def _append(self, slot: int, seq: Seq, token: int, logprob: float, version: int) -> bool:
        """Record one token; finish and free the slot when a rule says so. True if finished."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        if seq.on_token is not None:
            with contextlib.suppress(Exception):  # a listener must never stop the decode loop
                seq.on_token(token, logprob, version)
        reason = finish_reason(seq, token, self._cache_len)
        if reason is not None:
            self._finish(slot, seq, reason)
        return reason is not None

    def _finish(self, slot: int, seq: Seq, reason: str) -> None:
        self._slots[slot] = None
        resolve(seq.future, result=Completion(seq.token_ids, seq.logprobs, seq.versions, reason))

    def _fail_active(self, exc: BaseException) -> None:
        """An engine call failed mid-batch: its callers get the error; the state starts over."""
        for i, seq in enumerate(self._slots):
            if seq is not None:
                resolve(seq.future, error=exc)
                self._slots[i] = None
        self._decode_state = None

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail_active(exc)
        self._listeners.clear()
        while self._pending:
            for f, _ in self._pending.popleft().members:
                resolve(f, error=exc)
