"""EngineHost: one engine and its driver as the HTTP contract sees them (docs/design.md section 5).

What it owns
    The served model's name and limits (``max_model_len``: prompt plus completion, the engine's
    cache length; ``max_prompt_len``: what one prefill takes), its tokenizer (for the OpenAI
    text endpoints; the token endpoint needs none), the driver and the version it decodes with,
    the pause state, and where weight updates come from. The HTTP layer (``app``) validates
    requests and shapes responses; this class is what they act on.

Two ways to hold a driver
    ``EngineHost(engine, driver=d)``: a driver someone else runs (the train command's in-process
    engine, whose weights the trainer swaps in); ``update_weights`` is then refused.
    ``EngineHost(engine, source=s)``: this host builds the driver at the first weight update
    (``ready`` False and version -1 until then, unless ``params`` are given) and swaps later
    ones in between two decode steps. ``source(uuid, layout, timeout_s) -> params`` fetches an
    offered pytree into the engine's decode shardings: it is bound to one sender when the
    server starts (``distributed.source``), so a request only ever names an offer, never an
    address. A LoRA run's source also has ``load_base`` (keeps the frozen base, returns
    nothing) and ``load_adapters`` (returns the base with the adapters merged in).

Threads: ``submit`` / ``score`` / ``pause`` / ``resume`` are thread-safe (the driver's;
``controlled``, the hook a subclass reports a caller's pause and resume in, runs on the caller's
thread);
``update_weights`` is a coroutine for the server's event loop and runs the pull in a worker
thread; loads are serialised and a version older than the one held is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.models.tokenizer import Tokenizer
from jaxrl_orch.serving.contract import MAX_QUEUED, UPDATE_WEIGHTS, WeightsLoaded
from jaxrl_orch.types import SamplingParams

WeightSource = Callable[[int, Any, float], Any]  # (uuid, layout or None, timeout_s) -> params


class NotReady(RuntimeError):
    """The host holds no weights yet (a replica before its first update)."""


class UpdateRefused(ValueError):
    """A weight update this host cannot take (no source, or a version going backwards)."""


class NoWeightSource(UpdateRefused):
    """This host was started without a weight source (or borrows a driver someone else feeds)."""


class Busy(RuntimeError):
    """``max_queued`` samples are already waiting or decoding: come back later (HTTP 429)."""


class EngineHost:
    def __init__(
        self,
        engine: JetStreamEngine,
        *,
        model: str,
        tokenizer: Tokenizer | None = None,
        driver: InferenceDriver | None = None,
        params: Any = None,
        version: int = 0,
        source: WeightSource | None = None,
        warm_up: bool = False,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        if driver is not None and (params is not None or source is not None):
            raise ValueError("EngineHost: give a running driver, or params / a source, not both")
        self.engine = engine
        self.model = model
        self.tokenizer = tokenizer
        self.max_prompt_len = int(engine.max_prefill_length)
        self.max_model_len = int(getattr(engine, "max_target_length", self.max_prompt_len))
        # Ids a prompt may hold (None: unknown, e.g. a plug-in engine without a model config).
        self.vocab_size = int(getattr(getattr(engine, "config", None), "vocab_size", 0)) or None
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self.max_queued = int(max_queued)
        self.in_flight = 0  # samples submitted over HTTP and not yet finished
        self._count_lock = threading.Lock()
        self._source = source
        self._warm_up = warm_up
        self._owns_driver = driver is None
        self._load_lock = asyncio.Lock()
        self.driver = driver
        if driver is None and params is not None:
            self.driver = self._start_driver(params, version)

    @property
    def ready(self) -> bool:
        return self.driver is not None

    @property
    def version(self) -> int:
        return self.driver.version if self.driver is not None else -1

    @property
    def paused(self) -> bool:
        return self.driver is not None and self.driver.paused

    def submit(
        self,
        prompt_ids: Sequence[int],
        samplings: Sequence[SamplingParams],
        on_token: Callable[..., Any] | None = None,
    ) -> list[concurrent.futures.Future]:
        """One future per sampling, all of ``prompt_ids`` (sharing one prefill). Refused with
        ``Busy`` when they would take more than ``max_queued`` samples in flight."""
        driver = self._admitting(len(samplings))
        return self._count(driver.submit(prompt_ids, list(samplings), on_token=on_token))

    def score(self, prompt_ids: Sequence[int], top_logprobs: int) -> concurrent.futures.Future:
        """A future of ``prompt_ids``' ``inference.scoring.PromptScores`` (``top_logprobs``
        alternatives per position); it counts as one request in flight."""
        driver = self._admitting(1)
        [future] = self._count([driver.score(prompt_ids, top_logprobs)])
        return future

    def _admitting(self, n: int) -> InferenceDriver:
        """The driver, once ``n`` more requests fit under ``max_queued`` (else ``Busy``)."""
        if self.driver is None:
            raise NotReady(
                f"{self.model} holds no weights yet: {UPDATE_WEIGHTS.method} "
                f"{UPDATE_WEIGHTS.path} first"
            )
        if self.in_flight + n > self.max_queued:
            raise Busy(
                f"{self.in_flight} samples in flight and {n} more asked for; the "
                f"bound is max_queued={self.max_queued}"
            )
        return self.driver

    def _count(self, futures: list[concurrent.futures.Future]) -> list[concurrent.futures.Future]:
        with self._count_lock:
            self.in_flight += len(futures)
        for f in futures:
            f.add_done_callback(self._done)
        return futures

    def _done(self, _future: concurrent.futures.Future) -> None:
        with self._count_lock:  # called from the driver's thread, or the canceller's
            self.in_flight -= 1

    async def pause(self, mode: str, caller: str | None = None) -> None:
        """Pause the driver (``mode``: keep, wait, abort) on behalf of ``caller`` (the client's
        address over HTTP); returns once the pause is in effect."""
        if self.driver is None:
            raise NotReady(f"{self.model} holds no weights yet: nothing to pause")
        self.controlled("pause", mode, caller)
        await asyncio.wrap_future(self.driver.pause(mode))

    def resume(self, caller: str | None = None) -> None:
        if self.driver is not None:
            self.driver.resume()
            self.controlled("resume", None, caller)

    def controlled(self, action: str, mode: str | None, caller: str | None) -> None:
        """A caller's ``pause`` (with its ``mode``, as asked: it holds the engine from then on)
        or ``resume`` (once done); the train command's live host reports them (a replica and
        the serve command say nothing)."""

    async def update_weights(
        self,
        version: int,
        uuid: int,
        layout: Any = None,
        *,
        timeout_s: float,
        part: str = "weights",
    ) -> WeightsLoaded:
        """Fetch offer ``uuid`` from this host's source within ``timeout_s`` and decode with it
        as ``version`` from the next decode step on. ``part`` ``base`` only hands the source a
        LoRA base to keep (nothing is swapped in); ``adapters`` swaps in what the source merged
        from them."""
        fetch = self._fetcher(part)
        async with self._load_lock:
            if version < self.version:
                raise UpdateRefused(
                    f"version must not go backwards: holds {self.version}, asked for {version}"
                )
            t0 = time.perf_counter()
            params = await asyncio.to_thread(fetch, uuid, layout, timeout_s)
            pull_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if part == "base":  # kept by the source: nothing is swapped in
                out = WeightsLoaded(version=self.version, pull_s=pull_s, swap_s=0.0)
            else:
                if self.driver is None:
                    self.driver = await asyncio.to_thread(self._start_driver, params, version)
                else:
                    await asyncio.wrap_future(self.driver.swap_params(params, version))
                swap_s = time.perf_counter() - t1
                out = WeightsLoaded(version=version, pull_s=pull_s, swap_s=swap_s)
            self.loaded(part, out)
            return out

    def loaded(self, part: str, out: WeightsLoaded) -> None:
        """After each weight update this host took: ``part`` and what ``update_weights``
        returns (a replica logs it; this host says nothing)."""

    def _fetcher(self, part: str) -> WeightSource:
        """The source's call for ``part``: itself for ``weights``, its ``load_<part>`` else."""
        if self._source is None:
            raise NoWeightSource(
                f"{self.model} takes no weight updates: it was started without a weight source"
            )
        fetch = self._source if part == "weights" else getattr(self._source, f"load_{part}", None)
        if fetch is None:
            raise UpdateRefused(
                f"part {part!r}: {self.model} serves whole weights (part 'weights'); 'base' and "
                "'adapters' need a replica of a LoRA run"
            )
        return fetch

    def _start_driver(self, params: Any, version: int) -> InferenceDriver:
        driver = InferenceDriver(self.engine, params, version)
        if self._warm_up:  # every program compiled before the first request is served
            print(f"{self.model}: engine warm-up {driver.warm_up():.1f} s", flush=True)
        driver.start()
        return driver

    def gauges(self) -> dict[str, float]:
        return self.driver.gauges() if self.driver is not None else {}

    def stop(self) -> None:
        """Stop the driver this host started (a borrowed one is its owner's to stop)."""
        if self.driver is not None and self._owns_driver:
            self.driver.stop()
