"""The server's read-only surface for operators and pools: models, health, Prometheus metrics.

What it owns: ``Metrics`` (a ``prometheus_client`` registry of this app only, never the global
one, so two apps in one process never share or clash on a series), ``Counting`` (a plain ASGI
middleware counting every response by path and status, the guard's refusals included) and
``ops_routes(host, metrics)``: ``GET /v1/models``, the contract's ``HEALTH`` (``contract``),
``GET /metrics``.

The model card is vLLM's (``max_model_len``) plus two extras an eval harness sizes and labels
its run with: ``max_prompt_len`` (the longest prompt one prefill takes, what lm-eval's
``max_length`` must not pass) and ``policy_version`` (the params version decoding now, -1
before the first weights; on a training run's live server it moves with every weight swap).

Invariants: the gauges are read from the host and its driver at scrape time (the driver keeps
them; nothing here runs in the background); the health route answers 200 whether or not the
host holds weights (``ready`` False and ``version`` -1 before the first update); a route label
is one of the app's paths or ``other``, so unknown paths cannot grow the series without bound.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from jaxrl_orch.serving.contract import HEALTH, Health

if TYPE_CHECKING:  # annotations only: this module imports no JAX
    from jaxrl_orch.serving.host import EngineHost

_GAUGES = {  # metric name -> (help, driver gauge key)
    "jaxrl_engine_queue_depth": ("samples queued for a slot", "inference/queue_depth"),
    "jaxrl_engine_active_slots": ("slots decoding a sample", "inference/active_slots"),
    "jaxrl_engine_tokens_per_s": ("tokens generated per second, recent", "inference/tokens_per_s"),
    "jaxrl_engine_prefill_seconds": ("seconds spent in prefill so far", "inference/prefill_s"),
    "jaxrl_engine_decode_seconds": ("seconds spent in decode so far", "inference/decode_s"),
}


class Metrics:
    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.registry = CollectorRegistry(auto_describe=True)
        gauge = lambda name, doc: Gauge(name, doc, registry=self.registry)
        self._from_driver = {name: (gauge(name, doc), key) for name, (doc, key) in _GAUGES.items()}
        self.in_flight = gauge("jaxrl_engine_in_flight", "samples submitted over HTTP, unfinished")
        self.version = gauge("jaxrl_engine_policy_version", "params version decoding now")
        self.paused = gauge("jaxrl_engine_paused", "1 while decoding is paused")
        self.ready = gauge("jaxrl_engine_ready", "1 once the host holds weights")
        self.requests = Counter(
            "jaxrl_http_requests", "HTTP responses", ["route", "status"], registry=self.registry
        )
        self.generated = Counter(
            "jaxrl_generated_tokens", "tokens generated for HTTP requests", registry=self.registry
        )

    def count_generated(self, n: int) -> None:
        self.generated.inc(n)

    def render(self) -> bytes:
        gauges = self.host.gauges()
        for metric, key in self._from_driver.values():
            metric.set(gauges.get(key, 0.0))
        self.in_flight.set(self.host.in_flight)
        self.version.set(self.host.version)
        self.paused.set(float(self.host.paused))
        self.ready.set(float(self.host.ready))
        return generate_latest(self.registry)


class Counting:
    """Counts each response in ``metrics.requests`` once it has started."""

    def __init__(self, app: Any, *, metrics: Metrics, paths: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        label = scope["path"] if scope["path"] in self.paths else "other"

        started = False

        async def counted_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception:
            if not started:  # the outermost handler answers 500 without passing through here
                self.metrics.requests.labels(label, "500").inc()
            raise


def ops_routes(host: EngineHost, metrics: Metrics) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": host.model,
            "object": "model",
            "created": created,
            "owned_by": "jaxrl-orch",
            "root": host.model,
            "parent": None,
            "max_model_len": host.max_model_len,
            "max_prompt_len": host.max_prompt_len,
            "policy_version": host.version,
        }
        return {"object": "list", "data": [card]}

    @router.api_route(HEALTH.path, methods=[HEALTH.method])
    async def health() -> Health:
        g = host.gauges()
        return Health(
            status="ok",
            model=host.model,
            ready=host.ready,
            version=host.version,
            paused=host.paused,
            in_flight=host.in_flight,
            queued=int(g.get("inference/queue_depth", 0)),
            slots=int(host.engine.max_concurrent_decodes),
            active_slots=int(g.get("inference/active_slots", 0)),
            engine_s=g.get("inference/prefill_s", 0.0) + g.get("inference/decode_s", 0.0),
            pid=os.getpid(),
        )

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router
