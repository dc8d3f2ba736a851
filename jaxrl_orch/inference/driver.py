"""InferenceDriver: continuous batching over an engine's decode slots, in one background thread.

Owns: the request queue, the slot table (which request lives in which engine slot), the
decode state, the current ``(params, version)`` and the optional prefix cache. Nothing else
touches the engine while the driver runs.

How a request flows: ``submit(prompt_ids, sampling, n)`` queues one *group* (n samples of one
prompt, each with its own ``SamplingParams`` if a list is given; a pending submission of an
identical prompt joins the existing group whatever its sampling) and returns one
``concurrent.futures.Future[Completion]`` per sample. The loop thread prefills a group's
prompt once (or takes it from the prefix cache, keyed by ``(tokens, version)``) and inserts
that prefix into each of the group's slots as slots come free (prefix sharing), then calls
``generate`` and routes every valid token to its slot's request. A slot whose request finishes
(stop token, max tokens, cache full) or is cancelled is refilled before the next generate.

Narrow decoding: when the engine offers ``decode_widths`` with ``generate(..., width=w)`` and
``move_slot``, each call runs only the narrowest width holding every running request, after
packing requests at or above it into free lower slots (refills always take the lowest free
slot, so packing is rare: a drain moves at most ``slots - 1`` requests). A near-empty batch then
costs a fraction of a full step instead of a full one (the tail of every finite batch).

Invariants:
- ``swap_params`` takes effect at the next ``generate`` call; every token carries the version
  of the params of the call that produced it. KV already in the cache is kept (no re-prefill);
  a queued prefix computed under an older version is recomputed before insertion.
- Every future is resolved exactly once: a ``Completion``, or the exception its engine call
  raised (an engine error never kills the thread or the process), or ``RuntimeError`` when
  the driver stops first. A cancelled future frees its slot at the next loop turn.
- ``stop()`` joins the thread: no thread is left behind.

Finishing rules are applied here on the host (stop ids, ``max_tokens``, cache length from the
engine's optional ``max_target_length``), so any engine with the JetStream method shape can
be driven; engines accepting ``insert(..., sampling=...)`` / ``generate(..., version=...)`` get
those (per-slot sampling parameters and per-token version stamps from the device).
This module must never import orchestration code or block the caller's event loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_orch.inference.requests import (
    NO_LP,
    STOPPED,
    Group,
    Seq,
    accepts,
    check_request,
    decode_widths,
    first_token,
    resolve,
    slot_columns,
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
        if prefix_cache_size < 0:
            raise ValueError(f"prefix_cache_size must be >= 0, got {prefix_cache_size!r}")
        self.engine = engine
        self._params, self._version = params, int(version)
        self._pending_swap: tuple[Any, int] | None = None
        self._swap_waiters: list[concurrent.futures.Future] = []
        self._prefix_cache_size = prefix_cache_size
        self._prefix_cache: collections.OrderedDict = collections.OrderedDict()
        self._idle_wait_s = idle_wait_s
        self._gate = gate
        self._rate_window_s = rate_window_s
        self._n_slots = int(engine.max_concurrent_decodes)
        self._max_prefill = int(engine.max_prefill_length)
        self._cache_len = getattr(engine, "max_target_length", None)
        self._pass_sampling = accepts(engine.insert, "sampling")
        self._max_stop = getattr(engine, "max_stop_tokens", None)
        self._pass_version = accepts(engine.generate, "version")
        self._widths = decode_widths(engine, self._n_slots)
        self._width = self._n_slots
        self._cv = threading.Condition()
        self._pending: collections.deque[Group] = collections.deque()
        self._slots: list[Seq | None] = [None] * self._n_slots
        self._decode_state: Any = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._token_times: collections.deque[tuple[float, int]] = collections.deque()
        self._prefill_s = 0.0
        self._decode_s = 0.0
        self.num_prefills = 0

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    def submit(
        self,
        prompt_ids: Any,
        sampling: SamplingParams | Sequence[SamplingParams],
        n: int | None = None,
    ) -> list[concurrent.futures.Future]:
        """Queue samples of one prompt; returns one future per sample (thread-safe).

        ``sampling`` is one ``SamplingParams`` for all ``n`` samples (default 1), or a sequence
        with one per sample (then ``n`` defaults to, and must equal, its length).
        """
        prompt, samplings = check_request(
            prompt_ids, sampling, n, max_prefill=self._max_prefill, max_stop=self._max_stop
        )
        futures = [concurrent.futures.Future() for _ in samplings]
        members = list(zip(futures, samplings, strict=True))
        with self._cv:
            if self._stopped or self._stopping:
                raise RuntimeError("InferenceDriver is stopped; submit() needs a running driver")
            for group in self._pending:  # identical prompt: share its prefill
                if np.array_equal(group.prompt, prompt):
                    group.members.extend(members)
                    break
            else:
                self._pending.append(Group(prompt, members))
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

    def warm_up(self) -> float:
        """Run every program the loop can call once, on a scratch decode state: each prompt
        bucket's prefill and insert, each decode width, a slot move (JetStream's model warm-up),
        so none compiles mid-run. Call before ``start``; returns the seconds it took."""
        t0 = time.perf_counter()
        state = self.engine.init_decode_state()
        kwargs = {"sampling": SamplingParams()} if self._pass_sampling else {}
        for b in sorted({self._bucket(n) for n in range(1, self._max_prefill + 1)}):
            pad = np.zeros(b, np.int32)
            prefix, _ = self.engine.prefill(params=self._params, padded_tokens=pad, true_length=1)
            state = self.engine.insert(prefix, state, 0, **kwargs)
        if len(self._widths) > 1:
            state = self.engine.move_slot(state, 0, 1)
        for w in self._widths:
            step = {"version": self._version} if self._pass_version else {}
            step.update({"width": w} if w != self._n_slots else {})
            state, result = self.engine.generate(self._params, state, **step)
            result.convert_to_numpy()  # waits for the device
        return time.perf_counter() - t0

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

    def gauges(self) -> dict[str, float]:
        with self._cv:  # submit() may be growing the queue from another thread
            queued = sum(len(g.members) for g in self._pending)
        now = time.monotonic()
        window = [(t, k) for t, k in list(self._token_times) if now - t <= self._rate_window_s]
        span = (now - window[0][0]) if len(window) > 1 else 0.0
        rate = sum(k for _, k in window[1:]) / span if span > 0 else 0.0
        return {
            "inference/active_slots": float(sum(s is not None for s in self._slots)),
            "inference/queue_depth": float(queued),
            "inference/tokens_per_s": float(rate),
            "inference/prefill_s": self._prefill_s,  # cumulative seconds in prefill
            "inference/decode_s": self._decode_s,  # cumulative seconds in generate
            "inference/version": float(self._version),
            "inference/decode_width": float(self._width),  # slots the last generate ran
        }

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._pending or self._pending_swap) and not any(
                    self._slots
                ):
                    self._cv.wait(self._idle_wait_s)
                if self._stopping:
                    return
                if self._pending_swap is not None:
                    (self._params, self._version), self._pending_swap = self._pending_swap, None
                    for waiter in self._swap_waiters:
                        resolve(waiter, result=self._version)
                    self._swap_waiters.clear()
            while self._gate is not None and not self._gate.is_set() and not self._stopping:
                self._gate.wait(self._idle_wait_s)  # the trainer's step has the cores
            try:
                self._reap_cancelled()
                self._admit()
                if any(self._slots):
                    self._step()
                else:
                    with self._cv:  # everything queued was cancelled: nap instead of spinning
                        if not self._pending_swap and not self._stopping:
                            self._cv.wait(self._idle_wait_s)
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any engine error
                self._fail_active(exc)

    def _reap_cancelled(self) -> None:
        for i, seq in enumerate(self._slots):
            if seq is not None and seq.future.cancelled():
                self._slots[i] = None
        with self._cv:
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
                if future.cancelled():
                    continue
                slot = free.pop(0)
                seq = Seq(future, sampling, int(group.prompt.size))
                self._slots[slot] = seq
                kwargs = {"sampling": sampling} if self._pass_sampling else {}
                state = self._decode_state
                self._decode_state = self.engine.insert(group.prefix, state, slot, **kwargs)
                if group.first is not None:
                    self._append(slot, seq, *group.first, self._version)
            with self._cv:
                if not group.members and self._pending and self._pending[0] is group:
                    self._pending.popleft()

    def _ensure_prefix(self, group: Group) -> None:
        if group.prefix is not None and group.prefix_version == self._version:
            return
        key = (group.prompt.tobytes(), self._version)
        cached = self._prefix_cache.get(key)
        if cached is not None:
            self._prefix_cache.move_to_end(key)
            group.prefix, group.first = cached
        else:
            padded = np.zeros(self._bucket(group.prompt.size), dtype=np.int32)
            padded[: group.prompt.size] = group.prompt
            t0 = time.perf_counter()
            prefix, result = self.engine.prefill(
                params=self._params,
                existing_prefix=None,
                padded_tokens=padded,
                true_length=int(group.prompt.size),
            )
            group.prefix, group.first = prefix, first_token(result)
            self._prefill_s += time.perf_counter() - t0
            self.num_prefills += 1
            if self._prefix_cache_size:
                self._prefix_cache[key] = (group.prefix, group.first)
                while len(self._prefix_cache) > self._prefix_cache_size:
                    self._prefix_cache.popitem(last=False)
        group.prefix_version = self._version

    def _bucket(self, length: int) -> int:
        """Pad prompts to power-of-two lengths so prefill compiles once per bucket."""
        bucket = 8
        while bucket < length:
            bucket *= 2
        return min(bucket, self._max_prefill)

    def _narrow(self) -> dict[str, int]:
        """Pick the narrowest decode width holding every running request, packing requests
        that sit at or above it into free slots below it. ``generate`` kwargs to use."""
        running = [i for i, s in enumerate(self._slots) if s is not None]
        width = next(w for w in self._widths if w >= len(running))
        if width == self._n_slots:
            self._width = width
            return {}
        free = (i for i in range(width) if self._slots[i] is None)
        for src in running:
            if src >= width:
                dst = next(free)
                self._decode_state = self.engine.move_slot(self._decode_state, src, dst)
                self._slots[dst], self._slots[src] = self._slots[src], None
        self._width = width
        return {"width": width}

    def _step(self) -> None:
        kwargs = {"version": self._version} if self._pass_version else {}
        kwargs.update(self._narrow())
        version = self._version
        t0 = time.perf_counter()
        state = self._decode_state
        self._decode_state, result = self.engine.generate(self._params, state, **kwargs)
        result = result.convert_to_numpy()  # the one host round trip per call
        self._decode_s += time.perf_counter() - t0
        produced = 0
        for slot, seq in enumerate(self._slots[: self._width]):
            if seq is None:
                continue
            tokens, valid, logprobs, versions = slot_columns(result.get_result_at_slot(slot))
            for j in np.flatnonzero(valid):
                lp = float(logprobs[j]) if logprobs is not None else NO_LP
                ver = int(versions[j]) if versions is not None else version
                produced += 1
                if self._append(slot, seq, int(tokens[j]), lp, ver):
                    break
        self._token_times.append((time.monotonic(), produced))
        horizon = time.monotonic() - self._rate_window_s
        while self._token_times and self._token_times[0][0] < horizon:
            self._token_times.popleft()

    def _append(self, slot: int, seq: Seq, token: int, logprob: float, version: int) -> bool:
        """Record one token; finish and free the slot when a rule says so. True if finished."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        n = len(seq.token_ids)
        cache_full = self._cache_len is not None and seq.prompt_len + n > self._cache_len
        reason = None
        if token in seq.sampling.stop_token_ids:
            reason = "stop"
        elif n >= seq.sampling.max_tokens or cache_full:
            reason = "length"
        if reason is None:
            return False
        self._slots[slot] = None
        resolve(seq.future, result=Completion(seq.token_ids, seq.logprobs, seq.versions, reason))
        return True

    def _fail_active(self, exc: BaseException) -> None:
        """An engine call failed mid-batch: its callers get the error; the state starts over."""
        for i, seq in enumerate(self._slots):
            if seq is not None:
                resolve(seq.future, error=exc)
                self._slots[i] = None
        self._decode_state = None

    def _fail_everything(self, exc: BaseException) -> None:
        self._fail_active(exc)
        while self._pending:
            for f, _ in self._pending.popleft().members:
                resolve(f, error=exc)
