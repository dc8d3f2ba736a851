"""InferenceDriver: continuous batching over an engine's decode slots, in one background thread.

Owns: the loop thread and the one lock (a condition variable) every other thread meets it
under, the driver's lifecycle (``start`` / ``stop``), pause, and the parts it runs -- the
``RequestQueue`` of submitted samples (``intake.py``), the ``SlotTable`` of running ones and
its decode step (``slots.py``), the ``ParamSwap`` of the params it decodes with (``swap.py``),
the prefills (``prefixes.Prefixes``, with its optional cache) and ``PauseState``
(``pause.py``). Nothing else touches the engine while the driver runs.

How a request flows: ``submit(prompt_ids, sampling, n)`` queues one *group* (n samples of one
prompt, each with its own ``SamplingParams`` if a list is given; a pending submission of an
identical prompt joins the existing group whatever its sampling) and returns one
``concurrent.futures.Future[Completion]`` per sample. Each loop turn, between two decode
steps and under the lock, lands a pending swap and applies a pause; then, outside it, the loop
prefills the head group's prompt once (or takes it from the prefix cache, keyed by ``(tokens,
version)``), inserts that prefix into each of the group's slots as slots come free (prefix
sharing), and runs one ``generate`` that routes every valid token to its slot's request. A slot
whose request finishes (stop token, max tokens, cache full) or is cancelled is refilled before
the next generate.

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

Scoring: ``score(prompt_ids, top_logprobs)`` queues a prompt for ``scoring.PromptScores`` (its
tokens' log-probs given their prefixes, with alternatives). Each loop turn scores queued prompts
before admitting new samples, one prefill-shaped forward each (``Prefixes.score``) and up to one
prefill's worth of tokens per turn, so scoring never runs inside a decode step and a burst of
it delays the running requests by about one prefill per turn. It holds no slot and runs under
the version about to decode (stamped on the scores). Pauses hold it like admission, and an
abort leaves it queued: it resumes with the engine.

Streaming: ``submit(..., on_token=f)`` calls ``f(token_id, logprob, version)`` from the loop
thread per token recorded (the futures still resolve); it must be quick (its errors are dropped).
Finishing rules and narrow decoding: ``slots.py``. The ``gate`` (``overlap.OverlapSchedule``)
holds the loop between turns while it is clear: the trainer's step has the cores.
This module must never import orchestration code or block the caller's event loop.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.inference.intake import RequestQueue
from jaxrl_orch.inference.limits import top_logprobs_refusal
from jaxrl_orch.inference.narrow import warm_up
from jaxrl_orch.inference.pause import PauseState
from jaxrl_orch.inference.prefixes import Prefixes
from jaxrl_orch.inference.requests import (
    ABORTED,
    STOPPED,
    PrefillGroup,
    RequestLimits,
    TokenListener,
    check_request,
    resolve,
)
from jaxrl_orch.inference.scoring import PromptScores, ScoreQueue
from jaxrl_orch.inference.slots import SlotTable
from jaxrl_orch.inference.swap import ParamSwap
from jaxrl_orch.types import Completion, SamplingParams


class InferenceDriver:
    def __init__(
        self,
        engine: JetStreamEngine,
        params: Any,
        version: int = 0,
        *,
        prefix_cache_size: int = 16,
        idle_wait_s: float = 0.05,
        rate_window_s: float = 10.0,
        gate: threading.Event | None = None,  # decode only while set (overlap.OverlapSchedule)
    ) -> None:
        self.engine = engine
        self._swap = ParamSwap(params, version)
        self._prefixes = Prefixes(engine, prefix_cache_size)
        self._queue = RequestQueue()
        self._scores = ScoreQueue()
        self._slots = SlotTable(engine, rate_window_s)
        self._pause = PauseState()
        self._limits = RequestLimits.of(engine)
        self._idle_wait_s = idle_wait_s
        self._gate = gate
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False

    @property
    def version(self) -> int:
        return self._swap.version

    @property
    def paused(self) -> bool:
        return self._pause.paused

    @property
    def num_prefills(self) -> int:
        return self._prefixes.count

    def submit(
        self,
        prompt_ids: Any,
        sampling: SamplingParams | Sequence[SamplingParams],
        n: int | None = None,
        on_token: TokenListener | None = None,
    ) -> list[concurrent.futures.Future]:
        """Queue samples of one prompt; returns one future per sample (thread-safe).

        ``sampling`` is one ``SamplingParams`` for all ``n`` samples (default 1), or a sequence
        with one per sample (then ``n`` defaults to, and must equal, its length). ``on_token``:
        see Streaming in the module docstring.
        """
        prompt, samplings = check_request(prompt_ids, sampling, n, self._limits)
        with self._cv:
            if self._stopped or self._stopping:
                raise RuntimeError("InferenceDriver is stopped; submit() needs a running driver")
            futures = self._queue.add(prompt, samplings, on_token)
            self._cv.notify_all()
        return futures

    def score(self, prompt_ids: Any, top_logprobs: int = 0) -> concurrent.futures.Future:
        """Queue ``prompt_ids`` for scoring (see Scoring in the module docstring); returns a
        future of its ``scoring.PromptScores`` with ``top_logprobs`` alternatives per position
        (thread-safe)."""
        if not hasattr(self.engine, "score"):
            raise ValueError(
                f"{type(self.engine).__name__} has no score program: prompt log-probs need an "
                "engine with score() (the built-in DecodeEngine has one)"
            )
        refusal = top_logprobs_refusal("top_logprobs", top_logprobs)
        if refusal is not None:
            raise ValueError(refusal)
        prompt, _ = check_request(prompt_ids, SamplingParams(), None, self._limits)
        with self._cv:
            if self._stopped or self._stopping:
                raise RuntimeError("InferenceDriver is stopped; score() needs a running driver")
            future = self._scores.add(prompt, top_logprobs)
            self._cv.notify_all()
        return future

    def swap_params(self, params: Any, version: int) -> concurrent.futures.Future:
        """Use ``params`` (stamped ``version``) from the next generate step on.

        Returns a future resolved with the version once the driver has switched (before any
        token is generated with it); a swap superseded by a newer one before it landed resolves
        with the newer version.
        """
        with self._cv:
            done = self._swap.ask(params, version)
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

    def warm_up(self) -> float:
        """Compile every program the loop can call (``narrow.warm_up``) before ``start``, so
        none compiles mid-run; returns the seconds it took."""
        return warm_up(self.engine, self._swap.params, self._swap.version, self._slots.widths)

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
            error = RuntimeError(STOPPED)
            self._slots.fail(error)
            for future in [*self._queue.drain(), *self._scores.drain()]:
                resolve(future, error=error)
            self._swap.fail(RuntimeError(STOPPED))
            self._pause.fail(RuntimeError(STOPPED))

    def gauges(self) -> dict[str, float]:
        with self._cv:  # submit() may be growing the queue from another thread
            queued = self._queue.depth()
        return {
            "inference/active_slots": float(self._slots.active),
            "inference/queue_depth": float(queued),
            "inference/tokens_per_s": self._slots.tokens_per_s(),
            "inference/prefill_s": self._prefixes.seconds,  # cumulative seconds in prefill
            "inference/decode_s": self._slots.decode_s,  # cumulative seconds in generate
            "inference/version": float(self._swap.version),
            "inference/decode_width": float(self._slots.width),  # slots the last generate ran
            "inference/paused": float(self._pause.paused),
            "inference/scored_prompts": float(self._prefixes.scored),  # cumulative
            "inference/score_s": self._prefixes.score_seconds,  # cumulative seconds scoring
        }

    def _run(self) -> None:
        while self._between_steps():
            while self._gate is not None and not self._gate.is_set() and not self._stopping:
                self._gate.wait(self._idle_wait_s)  # the trainer's step has the cores
            try:
                self._turn()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any engine error
                self._slots.fail(exc)

    def _has_work(self) -> bool:
        if self._stopping or self._swap.pending or self._pause.mode:
            return True
        queued = bool(self._queue) or bool(self._scores)
        return not self._pause.paused and (queued or self._slots.running)

    def _between_steps(self) -> bool:
        """Wait for work, land a swap, apply a pause; False once the driver is stopping."""
        with self._cv:
            while True:
                while not self._has_work():
                    self._cv.wait(self._idle_wait_s)
                if self._stopping:
                    return False
                self._swap.land()
                if self._pause.mode == "abort":
                    self._abort_all()
                self._pause.settle(running=self._slots.running)
                if not self._pause.paused:
                    return True

    def _turn(self) -> None:
        self._slots.reap_cancelled()
        with self._cv:
            self._queue.reap_cancelled()
        if self._pause.mode is None:  # "wait": the running ones finish, nothing new
            self._score()
            self._admit()
        if self._slots.running:
            self._slots.step(self._swap.params, self._swap.version)
            return
        with self._cv:  # everything queued was cancelled: nap instead of spinning
            if not self._swap.pending and not self._stopping and not self._scores:
                self._cv.wait(self._idle_wait_s)

    def _score(self) -> None:
        """Score queued prompts, up to one prefill's worth of tokens per turn (at least one
        prompt), so a stream of scoring requests delays a decode step by about one prefill."""
        budget = self._prefixes.max_prefill
        while budget > 0:
            with self._cv:
                request = self._scores.pop()
            if request is None:
                return
            budget -= request.prompt.size
            params, version = self._swap.params, self._swap.version
            try:
                arrays = self._prefixes.score(request.prompt, params, version)
                scores = PromptScores.of(request.prompt, arrays, request.top_logprobs, version)
            except Exception as exc:  # noqa: BLE001 - this request's caller gets the error
                resolve(request.future, error=exc)
                continue
            resolve(request.future, result=scores)

    def _abort_all(self) -> None:
        """Under ``_cv``, in the loop thread: end every request now with what it has."""
        self._slots.abort()
        for future in self._queue.drain():
            resolve(future, result=Completion([], [], [], ABORTED))

    def _admit(self) -> None:
        """Fill the free slots from the head of the queue, one group's prefill at a time."""
        free = self._slots.free()
        while free:
            with self._cv:
                group = self._queue.head()
            if group is None:
                return
            if self._prefill(group):
                self._fill(group, free)

    def _prefill(self, group: PrefillGroup) -> bool:
        """Give ``group`` its prefix under the current version; False when that failed (then
        its samples failed with the error, and it left the queue)."""
        try:
            self._prefixes.prepare(group, self._swap.params, self._swap.version)
            self._slots.ensure_state()
        except Exception as exc:  # noqa: BLE001 - this group's callers get the error
            with self._cv:
                futures = self._queue.remove(group)
            for future in futures:
                resolve(future, error=exc)
            return False
        return True

    def _fill(self, group: PrefillGroup, free: list[int]) -> None:
        """Insert ``group``'s samples into ``free`` slots (lowest first) while both last."""
        while free and group.members:
            with self._cv:
                seq = self._queue.take(group)
            if not seq.future.cancelled() and self._slots.insert(
                group, free[0], seq, self._swap.version
            ):
                free.pop(0)
        with self._cv:
            self._queue.retire(group)
