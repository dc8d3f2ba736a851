"""make_app: the FastAPI application behind the engine's HTTP contract (``serving/__init__``).

What it owns: assembling the routes (``rl_api``: tokens, pause, weights; ``ops``: models,
health, metrics; ``openai_api``: the text endpoints), the request guard (``guard``: control
routes withheld or served, API key, body limit) and the metrics middleware around them, and
turning every failure into the contract's error body (``errors``) with a status a client can
act on:

- ``ApiError``: its own status; malformed JSON, a body that is not a JSON object, an unknown
  key (named, with the keys allowed there: ``allowed_keys``), a missing or mistyped field: 400
  naming the field (``param``) and the problem, whether FastAPI validated the body or the route
  parsed its bytes itself (``fastjson.BodyInvalid``);
- ``NotReady`` 503, ``Busy`` 429, ``UpdateRefused`` 400 (409 when the host has no weight
  source); Starlette's HTTP errors (404 route, 405 method, 413 body) as their status;
  anything else 500 naming the error, and the server keeps serving.

``app.state`` holds ``host``, ``limits`` and ``metrics`` for routes built elsewhere, and
``routes``: every ``(method, path)`` the app serves (what ``guard.CONTROL`` is checked against).
Built once per served host; ``runner.HttpServer`` serves it. Never binds, never starts threads.
"""

from __future__ import annotations

import typing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from jaxrl_orch.serving.errors import ApiError, error_body
from jaxrl_orch.serving.fastjson import BodyInvalid
from jaxrl_orch.serving.guard import Guard, Limits
from jaxrl_orch.serving.host import Busy, EngineHost, NotReady, NoWeightSource, UpdateRefused
from jaxrl_orch.serving.openai_api import openai_routes
from jaxrl_orch.serving.ops import Counting, Metrics, ops_routes
from jaxrl_orch.serving.rl_api import rl_routes

_MAX_SHOWN = 200  # characters of a refused value quoted back in an error message


_NO_TELEMETRY = {"tracing": False, "metrics": False, "operation_spans": False, "logs": False}


def make_app(
    host: EngineHost,
    *,
    api_key: str | None = None,
    limits: Limits = Limits(),
    withhold_control: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The app serving ``host``. ``withhold_control``: None serves the control routes
    (``guard.CONTROL``) like any other; the name of the setting that would hand them out refuses
    them (403) to every caller. ``tool_parser``: the chat endpoint's tool-call parser
    (``openai_api.openai_routes``; an unknown name raises ``ValueError`` naming the known)."""
    if api_key is not None and (not api_key or api_key != api_key.strip()):
        raise ValueError("api_key must be a non-empty string without surrounding whitespace")
    app = FastAPI(
        title=f"jaxrl-orch engine: {host.model}",
        docs_url=None,
        redoc_url=None,
        # The server's metrics are its own Prometheus registry (GET /metrics); FastAPI's
        # built-in OpenTelemetry spans and metrics cost about 0.5 ms of CPU per request here,
        # with no provider to send them to.
        telemetry=_NO_TELEMETRY,
    )
    app.state.host = host
    app.state.limits = limits
    metrics = Metrics(host)
    app.state.metrics = metrics
    app.state.api_key_required = api_key is not None
    routers = [
        rl_routes(host, limits, metrics),
        ops_routes(host, metrics),
        openai_routes(host, timeout_s=limits.request_timeout_s, tool_parser=tool_parser),
    ]
    for router in routers:
        app.include_router(router)
    routes = [route for router in routers for route in router.routes]
    app.state.routes = {(method, route.path) for route in routes for method in route.methods}
    paths = {route.path for route in routes}
    app.add_middleware(Guard, api_key=api_key, limits=limits, withhold_control=withhold_control)
    app.add_middleware(Counting, metrics=metrics, paths=paths)  # outermost: sees every reply

    def reply(status: int, message: str, param: str | None = None, **headers: str) -> Any:
        return JSONResponse(error_body(status, message, param), status, headers or None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors(), _body_model(request))
        return reply(400, message, param)

    @app.exception_handler(BodyInvalid)
    async def _body_invalid(_: Request, exc: BodyInvalid) -> JSONResponse:
        return reply(400, *validation_message(exc.errors, exc.model))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return reply(exc.status_code, str(exc.detail), None, **(exc.headers or {}))

    @app.exception_handler(NotReady)
    async def _not_ready(_: Request, exc: NotReady) -> JSONResponse:
        return reply(503, str(exc))

    @app.exception_handler(Busy)
    async def _busy(_: Request, exc: Busy) -> JSONResponse:
        return reply(429, str(exc), None, **{"Retry-After": "1"})

    @app.exception_handler(UpdateRefused)
    async def _refused(_: Request, exc: UpdateRefused) -> JSONResponse:
        if isinstance(exc, NoWeightSource):  # the server's setup, not the request, says no
            return reply(409, str(exc))
        return reply(400, str(exc), "version")

    @app.exception_handler(Exception)
    async def _crashed(_: Request, exc: Exception) -> JSONResponse:
        return reply(500, f"internal error: {type(exc).__name__}: {exc}")

    return app


def validation_message(
    errors: list[dict], body_model: type[BaseModel] | None
) -> tuple[str, str | None]:
    """One message for pydantic's errors (each one named, in order) and the first one's field."""
    parts = []
    params = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        where = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
        param = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in where)
        param = param.replace(".[", "[")
        parts.append(_describe(err, where, param, body_model))
        params.append(None if err.get("type") == "json_invalid" else param or None)
    return "; ".join(parts), params[0] if params else None


def _describe(err: dict, where: tuple, param: str, body_model: type[BaseModel] | None) -> str:
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    given = err.get("input")
    if kind == "json_invalid":
        at = f" at character {where[0]}" if where else ""
        return f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}{at}"
    if kind == "extra_forbidden":
        parent = ".".join(str(p) for p in where[:-1] if isinstance(p, str))
        allowed = allowed_keys(body_model, where[:-1]) if body_model is not None else None
        listed = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"unknown key {where[-1]!r} in {parent or 'the request body'}{listed}"
    if kind == "missing":
        return f"{param} is required"
    if kind == "value_error" and "error" in ctx:
        return str(ctx["error"])
    if kind in ("model_attributes_type", "dict_type", "model_type") and not where:
        shown = repr(given)[:_MAX_SHOWN]
        return f"the body must be a JSON object (Content-Type: application/json), got {shown}"
    return f"{param or 'the body'}: {err.get('msg')}, got {repr(given)[:_MAX_SHOWN]}"


def _body_model(request: Request) -> type[BaseModel] | None:
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys the object at ``loc`` (a pydantic error location below ``model``) may hold, or
    None when ``loc`` does not lead to a model."""
    for part in loc:
        if not isinstance(part, str):
            continue  # a list index: the item type is found with the field
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return None
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):  # Optional[M], list[M], M | None ...
        found = _model_in(arg)
        if found is not None:
            return found
    return None
