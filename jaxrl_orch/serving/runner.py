"""HttpServer: uvicorn serving one app on one port, in the caller's event loop or a thread.

What it owns: the listening socket (bound before uvicorn starts, so ``port=0`` picks a free
port and a taken port fails in the caller, not in a thread), the uvicorn server and, for
``start_in_thread``, its thread and event loop. ``check_bind`` (loopback unless there is a key)
and ``bind_socket`` are also the trainer's weight server's (``distributed.offer_server``).

Invariants:
- Loopback only unless there is an API key: ``HttpServer(app, host="0.0.0.0")`` without
  ``api_key`` raises ``ValueError`` naming the address before anything binds, and so does an
  app built without a key (``make_app(..., api_key=...)``) even when one is given here.
- ``port`` / ``url`` are None until the server answers; ``stop()`` is safe from any thread
  (it only asks uvicorn to exit) and, for a threaded server, joins the thread. Requests still
  running after ``grace_s`` are cut off.
- uvicorn logs warnings only and no access log (request bodies and keys stay out of logs).

Driven by ``jaxrl_orch.serve`` (``serve()`` in its loop until a signal calls ``stop()``) and by
``compose.live`` / tests (``start_in_thread()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import threading
import time
from typing import Any

import uvicorn


class HttpServer:
    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        *,
        grace_s: float = 5.0,
    ) -> None:
        self.check_bind(host, api_key)
        checks_key = getattr(getattr(app, "state", None), "api_key_required", False)
        if not is_loopback(host) and not checks_key:
            raise ValueError(
                f"refusing to bind {host!r}: the app checks no API key; build it with "
                "make_app(host, api_key=...) to serve beyond loopback"
            )
        self.app = app
        self.host = host
        self.grace_s = grace_s
        self._want_port = int(port)
        self._port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop_asked = False

    @staticmethod
    def check_bind(host: str, api_key: str | None) -> None:
        """Raise ``ValueError`` unless ``host`` is loopback or an API key is given."""
        if not is_loopback(host) and not api_key:
            raise ValueError(
                f"refusing to bind {host!r} without an API key: only loopback addresses "
                "(127.0.0.1, ::1, localhost) may serve without one; give an API key "
                "(jaxrl_orch.serve: --api_key_file)"
            )

    @property
    def port(self) -> int | None:
        return self._port if self._server is not None and self._server.started else None

    @property
    def url(self) -> str | None:
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def serve(self) -> None:
        """Serve in this event loop until ``stop()``."""
        await self._serve(self._bind())

    def start_in_thread(self, timeout_s: float = 60.0) -> HttpServer:
        """Serve from a thread of its own; returns once the server answers."""
        if self._thread is not None:
            raise RuntimeError("HttpServer.start_in_thread() called twice")
        sock = self._bind()
        self._thread = threading.Thread(
            target=self._thread_main, args=(sock,), name=f"http-{self._port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while self.port is None:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.host} did not start") from self._error
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"HTTP server on {self.host} not up within {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stop_asked = True
        if self._server is not None:
            self._server.should_exit = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.grace_s + 10.0)

    def _bind(self) -> socket.socket:
        sock = bind_socket(self.host, self._want_port)
        self._port = sock.getsockname()[1]
        return sock

    def _thread_main(self, sock: socket.socket) -> None:
        # The thread's own loop is the one uvicorn would pick (uvloop when installed), as
        # ``uvicorn.run`` does for a server that owns its process.
        factory = self._config().get_loop_factory()
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(self._serve(sock))
        except BaseException as exc:  # noqa: BLE001 - start_in_thread reports it
            self._error = exc

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            log_config=None,
            lifespan="off",
            timeout_graceful_shutdown=self.grace_s,
        )

    async def _serve(self, sock: socket.socket) -> None:
        self._server = uvicorn.Server(self._config())
        self._server.should_exit = self._stop_asked
        with contextlib.closing(sock):
            await self._server.serve(sockets=[sock])


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), not yet listening; a taken
    port raises ``OSError`` here, in the caller."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything
