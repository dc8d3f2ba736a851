"""One HTTP client per event loop for in-process agents calling verifiers' interception server.

An in-process harness (``examples.vf_chat.ChatHarness``) makes one chat call per model turn
to the interception server on 127.0.0.1, from every rollout at once and on the loop that runs
the rollouts. Through the OpenAI SDK and httpx that call is most of an episode's own CPU
(request-option transforms, a response model per call, and a connection pool scanned per
request); an aiohttp session keyed by host reuses its keep-alive connections in constant time.

What it owns
- ``shared_session()``: the loop's session, open for as long as the context is held
  (``VerifiersEnv`` holds it while it serves); ``session()`` returns it while it is open.
- ``session()`` outside such a context (a harness run by verifiers' own tools) is ``None``:
  the caller opens a session of its own for the episode, closed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

import aiohttp

_SESSIONS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)


def new_session() -> aiohttp.ClientSession:
    """A loopback client: no proxy from the environment, no per-call deadline (the rollout's
    own timeout bounds an episode), no cap on connections (one per rollout in flight)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
    )


@contextlib.asynccontextmanager
async def shared_session() -> AsyncIterator[aiohttp.ClientSession]:
    loop = asyncio.get_running_loop()
    http = _SESSIONS[loop] = new_session()
    try:
        yield http
    finally:
        if _SESSIONS.get(loop) is http:
            del _SESSIONS[loop]
        await http.close()


def session() -> aiohttp.ClientSession | None:
    http = _SESSIONS.get(asyncio.get_running_loop())
    return None if http is None or http.closed else http
