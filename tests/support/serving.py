"""A tiny real engine behind the HTTP contract, for the tests of ``jaxrl_orch.serving``.

``tiny_engine()``: a 2-layer ``DecodeEngine`` (vocab 512, 4 slots, a 64-token context, prompts up
to 16 tokens, one decode width so only one generate program compiles) wrapped in ``HeldEngine``,
which lets a test hold the driver's loop thread at the entry of a ``generate`` call: a test acts
"mid-request" at a known point instead of racing a decode that takes milliseconds.
``Served``: a host served by a real uvicorn on a free loopback port with an ``httpx`` client
(the API key, when the server has one, sent by default).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.guard import Limits
from jaxrl_orch.serving.runner import HttpServer

CFG = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
)
LIMITS = EngineLimits(
    max_concurrent_decodes=4, max_target_length=64, max_prefill_length=16, steps_per_call=4
)
MODEL = "tiny-test"


def tiny_engine() -> HeldEngine:
    return HeldEngine(DecodeEngine(CFG, limits=LIMITS, decode_widths=(4,)))


def until(predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it is truthy (bounded); returns its value."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g} s")
        time.sleep(0.01)
    return value


class HeldEngine:
    """Delegates to an engine; after ``hold(after=k)`` the k-th ``generate`` call from now and
    every later one wait at entry until ``step_until`` or ``release`` lets them through."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cv = threading.Condition()
        self._hold_at: int | None = None
        self._permits = 0
        self.calls = 0  # generate calls entered
        self.blocked: int | None = None  # the index of the call waiting at entry, if any

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, params: Any, decode_state: Any, *, version: int = 0, width: Any = None):
        with self._cv:
            index, self.calls = self.calls, self.calls + 1
            if self._hold_at is not None and index >= self._hold_at:
                while self._hold_at is not None and self._permits == 0:
                    self.blocked = index
                    self._cv.notify_all()
                    self._cv.wait()
                self.blocked = None
                self._permits = max(self._permits - 1, 0)
        return self._engine.generate(params, decode_state, version=version, width=width)

    def hold(self, after: int = 0) -> None:
        with self._cv:
            self._hold_at, self._permits = self.calls + after, 0

    def wait_held(self, timeout_s: float = 60.0) -> int:
        """The index of the call that is now waiting at entry."""
        return until(
            lambda: self.blocked is not None and self.blocked + 1, timeout_s, "a held call"
        )

    def step_until(self, done: Callable[[], bool], timeout_s: float = 60.0) -> int:
        """Let held calls through one at a time, checking ``done()`` between two: returns how
        many went through."""
        deadline, steps = time.monotonic() + timeout_s, 0
        while not done():
            with self._cv:
                if self.blocked is not None and self._permits == 0:
                    self._permits, steps = 1, steps + 1
                    self._cv.notify_all()
                self._cv.wait(0.01)
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {steps} decode calls")
        return steps

    def release(self) -> None:
        with self._cv:
            self._hold_at, self._permits = None, 0
            self._cv.notify_all()


class Served:
    def __init__(self, host: Any, *, api_key: str | None = None, limits: Limits = Limits()):
        self.host = host
        app = make_app(host, api_key=api_key, limits=limits)
        self.server = HttpServer(app, api_key=api_key).start_in_thread()
        self.url = self.server.url
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.url, headers=auth, timeout=120.0)

    def generate(self, token_ids: list[int], **sampling: Any) -> dict:
        """POST a generate request that must succeed; its JSON."""
        body = {"model": self.host.model, "token_ids": token_ids, "sampling_params": sampling}
        r = self.client.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def in_background(self, method: str, path: str, **kwargs: Any) -> Background:
        return Background(lambda: self.client.request(method, path, **kwargs))

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.host.stop()


class Background:
    """A blocking call in a thread: ``done`` and ``result()`` (re-raising its error)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._out.append((call(), None))
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._out.append((None, exc))

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float = 120.0) -> Any:
        self._thread.join(timeout_s)
        assert self._out, f"still running after {timeout_s:g} s"
        value, exc = self._out[0]
        if exc is not None:
            raise exc
        return value
