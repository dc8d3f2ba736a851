"""What a request must pass before any route sees it: the control routes, the API key and the
body size limit.

What it owns: ``Limits`` (the server's bounds: ``max_body_bytes``, ``request_timeout_s``,
``max_pull_s``), ``CONTROL`` (the routes that change the engine's state: pause, resume, weight
updates), ``Guard``, a plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which
would hide a client's disconnect from ``waiting.await_completions``), and the key check itself
(``bearer``, ``key_refusal``), which the trainer's weight server (``distributed.offer_server``)
runs on its own requests too.

Invariants:
- A server built to withhold its control routes (``withhold_control``: the name of the setting
  that would hand them out) refuses each of ``CONTROL`` with 403 to every caller, key or not,
  naming the route and that setting: the engine's state is then its owner's (the training run
  serving its own policy), and a caller must not pause it or swap its weights.
- With a key, every request but the contract's health probe carries
  ``Authorization: Bearer <key>``, compared with ``hmac.compare_digest`` (no timing hint about
  the key); a missing header and a wrong key are both 401, and the message says which.
- A body over ``max_body_bytes`` is refused with 413 before anything parses it: at once from its
  ``Content-Length``, or, for a chunked body, as soon as the bytes read pass the limit.
- Refusals use the contract's error body (``errors.error_body``).

Driven by uvicorn through the app ``app.make_app`` builds; holds no state between requests.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException

from jaxrl_orch.serving.contract import HEALTH, UPDATE_WEIGHTS
from jaxrl_orch.serving.errors import error_body

OPEN = {(HEALTH.method, HEALTH.path)}  # what a pool or a load balancer probes without the key
CONTROL = (("POST", "/pause"), ("POST", "/resume"), (UPDATE_WEIGHTS.method, UPDATE_WEIGHTS.path))


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 2**20
    request_timeout_s: float = 600.0  # a generation that runs longer fails 504 and is cancelled
    # The longest pull one weight update may ask for: the load lock is held that long at most.
    # A run's replicas get their Processes section's (``ProcessesSettings.max_pull_s``).
    max_pull_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive int, got {self.max_body_bytes!r}")
        for name in ("request_timeout_s", "max_pull_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")


class Guard:
    def __init__(
        self, app: Any, *, api_key: str | None, limits: Limits, withhold_control: str | None
    ) -> None:
        self.app = app
        self.limits = limits
        self._key = bearer(api_key)
        self._withheld = withhold_control

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await _reply(send, *refusal)
        limit = self.limits.max_body_bytes
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI passes an HTTPException from the body read on
                    raise HTTPException(413, self._too_large(f"more than {limit}")[1])
            return message

        await self.app(scope, counted_receive, send)

    def _refusal(self, scope: dict) -> tuple[int, str, str | None] | None:
        route = (scope["method"], scope["path"])
        if self._withheld is not None and route in CONTROL:
            return 403, control_refused(route, self._withheld), None
        headers = dict(scope["headers"])
        if route not in OPEN:
            refusal = key_refusal(headers.get(b"authorization"), self._key)
            if refusal is not None:
                return 401, refusal, None
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return 400, f"Content-Length must be an int, got {length.decode()!r}", None
            if n > self.limits.max_body_bytes:
                return self._too_large(str(n))
        return None

    def _too_large(self, size: str) -> tuple[int, str, str | None]:
        limit = self.limits.max_body_bytes
        return 413, f"request body of {size} bytes is over the limit of {limit} bytes", None


def control_refused(route: tuple[str, str], setting: str) -> str:
    routes = ", ".join(f"{method} {path}" for method, path in CONTROL)
    return (
        f"{route[0]} {route[1]} is refused to every caller: this server's control routes "
        f"({routes}) belong to the run that serves it; {setting} = True hands them out"
    )


def bearer(api_key: str | None) -> bytes | None:
    """The ``Authorization`` header value a key requires (None: no key, nothing required)."""
    return f"Bearer {api_key}".encode() if api_key else None


def key_refusal(given: bytes | str | None, wanted: bytes | None) -> str | None:
    """Why a request whose ``Authorization`` header is ``given`` is refused when ``wanted``
    (``bearer(key)``) is required; None when it passes. Compared in constant time."""
    if wanted is None:
        return None
    if given is None:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if isinstance(given, str):
        given = given.encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, wanted):
        return "wrong API key in the Authorization header"
    return None


async def _reply(send: Any, status: int, message: str, param: str | None) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
