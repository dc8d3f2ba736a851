"""One OpenAI text request in flight: its n choices, fed token by token from the driver thread.

What it owns: submitting the request's samples to the ``EngineHost`` (one submission per
choice, so each has its own token listener; the driver still prefills an identical pending
prompt once) and, for an echo, the prompt's scoring (``EngineHost.score``, queued first so the
samples reuse its prefix; ``prompt_scores`` once run), carrying each token from the driver
thread to the server's event loop, and per choice the text so far (``detokenize``), the stop
strings (``stops``), the ids, log-probs, alternatives and policy versions, and the finish
reason.

Threads: the driver calls the listeners from its loop thread; they only hand the token to the
event loop (``call_soon_threadsafe`` into an ``asyncio.Queue``), in the order the driver
recorded them, the future's completion after its last token. Everything else runs on the event
loop, so a choice is never touched by two threads.

Invariants:
- A choice's text never contains its stop token (the token itself stays in ``token_ids``,
  with its log-prob and version: it was sampled) nor anything from a stop string on.
- A stop string ends its choice at once: the engine request is cancelled (its slot is free at
  the driver's next loop turn), ``finish_reason`` is "stop", and later tokens are dropped.
- ``cancel()`` cancels every engine request still running: the route calls it when the client
  goes away, on a timeout and when it is done, so no request outlives its HTTP request.
- An engine error surfaces from ``updates()`` as the exception the driver resolved with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from jaxrl_orch.serving.detokenize import IncrementalDetokenizer
from jaxrl_orch.serving.stops import StopStrings
from jaxrl_orch.types import Completion, SamplingParams

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.inference.scoring import PromptScores
    from jaxrl_orch.models.tokenizer import Tokenizer
    from jaxrl_orch.serving.host import EngineHost


class Choice:
    def __init__(
        self,
        index: int,
        future: Any,
        tokenizer: Tokenizer,
        sampling: SamplingParams,
        *,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.index = index
        self.future = future
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stops = StopStrings(stops)
        self._stop_ids = frozenset(sampling.stop_token_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.tops: list[list[tuple[int, float]]] = []  # alternatives, when the sampling asked
        self.text_offsets: list[int] = []  # released text length when each token arrived
        self._parts: list[str] = []
        self._length = 0
        self.finish_reason: str | None = None
        self.reported = 0  # tokens already carried by a stream chunk

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def add(self, token: int, logprob: float, version: int, top: Any = ()) -> str:
        """Record one sampled token (with its alternatives, when asked); the text it releases."""
        self.token_ids.append(int(token))
        self.logprobs.append(float(logprob))
        self.versions.append(int(version))
        self.tops.append(list(top))
        self.text_offsets.append(self._length)
        if token in self._stop_ids:
            return ""
        return self._release(self._detok.push(token))

    def close(self) -> str:
        """The engine request is done: the text still held back, and the finish reason."""
        if self.future.cancelled():
            self.finish_reason = "cancelled"
            return ""
        completion = self.future.result()  # an engine error raises here
        seen = len(self.token_ids)
        tops = completion.top_logprobs or [()] * len(completion.token_ids)
        tail = zip(
            completion.token_ids[seen:],
            completion.logprobs[seen:],
            completion.versions[seen:],
            tops[seen:],
            strict=True,
        )
        out = []
        for token in tail:  # none with this driver; the text must match the ids regardless
            if self.finish_reason is None:
                out.append(self.add(*token))
        if self.finish_reason is None:
            out.append(self._release(self._detok.flush()))
        if self.finish_reason is None:
            out.append(self._release(self._stops.flush(), flushed=True))
            self.finish_reason = completion.finish_reason
        return "".join(out)

    def _release(self, text: str, flushed: bool = False) -> str:
        out, hit = (text, False) if flushed else self._stops.feed(text)
        self._parts.append(out)
        self._length += len(out)
        if hit:
            self.finish_reason = "stop"
            self.future.cancel()
        return out

    def unreported(self) -> slice:
        """The tokens no chunk carried yet; marks them carried."""
        span = slice(self.reported, len(self.token_ids))
        self.reported = len(self.token_ids)
        return span


class Generation:
    def __init__(
        self,
        host: EngineHost,
        prompt_ids: Sequence[int],
        samplings: Sequence[SamplingParams],
        *,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        score: int | None = None,
        decode: bool = True,
    ) -> None:
        """``score``: also score the prompt with that many alternatives per position;
        ``decode=False``: generate nothing (each choice ends at once with no tokens, ``length``:
        an echo of ``max_tokens`` 0)."""
        self.prompt_ids = list(prompt_ids)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self._scoring: concurrent.futures.Future | None = None
        self.prompt_scores: PromptScores | None = None
        text_rules = {"stops": tuple(stops), "skip_special_tokens": skip_special_tokens}
        try:
            if score is not None:
                self._scoring = host.score(self.prompt_ids, score)
            for i, sampling in enumerate(samplings):
                listener = functools.partial(self._post, i)
                if decode:
                    [future] = host.submit(self.prompt_ids, [sampling], on_token=listener)
                else:
                    future = concurrent.futures.Future()
                    future.set_result(Completion([], [], [], "length"))
                self.choices.append(Choice(i, future, host.tokenizer, sampling, **text_rules))
        except BaseException:
            self.cancel()  # the samples already queued must not decode for nobody
            raise
        for choice in self.choices:
            choice.future.add_done_callback(functools.partial(self._post_done, choice.index))

    def _post(self, index: int, *token: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read it
            self._loop.call_soon_threadsafe(self._events.put_nowait, (index, token))

    def _post_done(self, index: int, _future: Any) -> None:
        self._post(index)

    async def updates(self) -> AsyncIterator[tuple[Choice, str]]:
        """``(choice, text delta)`` whenever a choice releases text or finishes, until every
        choice has finished."""
        running = len(self.choices)
        while running:
            index, token = await self._events.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue  # ended by a stop string: what the engine sent after is dropped
            delta = choice.add(*token) if token else choice.close()
            if delta or choice.finish_reason is not None:
                yield choice, delta
            running -= choice.finish_reason is not None

    async def run(self) -> list[Choice]:
        async for _ in self.updates():
            pass
        if self._scoring is not None:
            self.prompt_scores = await asyncio.wrap_future(self._scoring)
        return self.choices

    def cancel(self) -> None:
        if self._scoring is not None:
            self._scoring.cancel()
        for choice in self.choices:
            choice.future.cancel()

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
