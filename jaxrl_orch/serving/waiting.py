"""Awaiting the driver for one HTTP request: its futures, its client, its deadline.

``await_completions(request, futures, timeout_s)`` returns the completions in order. While it
waits it listens on the request's ASGI channel: once the body is read, the next message the
server sends there is ``http.disconnect``, so a client that goes away ends the wait at once (no
polling) and cancels every future, which frees the slots at the driver's next loop turn (a
disconnected client must not keep decoding). Past ``timeout_s`` the futures are cancelled too
and the request fails 504. An engine error fails it 500 naming the error. Runs on the server's
event loop and never blocks it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from jaxrl_orch.serving.errors import ApiError


async def await_completions(
    request: Request, futures: Sequence[concurrent.futures.Future], timeout_s: float
) -> list[Any]:
    waiting = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait(
            {waiting, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        gone.cancel()
        for f in futures:
            f.cancel()  # no-op for finished ones; frees the slots of the rest
    if waiting in done:
        try:
            return waiting.result()
        except (RuntimeError, ValueError) as exc:  # the engine's error, this request's only
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None
    waiting.cancel()
    if gone in done:
        raise ApiError(499, "the client went away before the request finished")
    raise ApiError(504, f"the request did not finish within timeout_s={timeout_s:g}")


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the route has read the whole body already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
