"""The replica wire protocol: the gRPC service ``jaxrl_orch.Engine`` with JSON messages.

Owns the service name, its three unary-unary methods and the JSON (de)serialisation of every
message. No protoc and no generated stubs: the server side is a grpcio generic handler built by
``generic_handler`` (``grpc.method_handlers_generic_handler`` over
``grpc.unary_unary_rpc_method_handler``), the client side calls ``method_path(name)`` with
``request_serializer=dumps`` / ``response_deserializer=loads``.

Methods (request -> response, both JSON objects):
- ``Health {}`` -> ``{"replica", "ready", "version", "in_flight", "queued", "slots", "pid"}``;
  ``version`` is -1 and ``ready`` False before the first weights land.
- ``LoadWeights {"version", "address", "uuid", "timeout_s"}`` -> ``{"version", "pull_s",
  "swap_s"}``: pull the weights offered under ``uuid`` by the transfer server at ``address``.
- ``Generate {"prompt_ids": [...], "sampling": {...}}`` -> a completion (``completion_to_json``).

Invariants:
- ``sampling_to_json`` / ``sampling_from_json`` carry every ``SamplingParams`` field found by
  ``dataclasses.fields``, so a field added later travels without touching this module; an
  unknown field is refused by name (a newer client against an older server says so).
- Non-finite log-probs (upstream engines report NaN where they have none) travel as ``null``
  and come back as NaN; JSON on the wire is strict (``allow_nan=False``).
This module holds no state, opens no socket and never imports jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc

from jaxrl_orch.types import Completion, SamplingParams

SERVICE = "jaxrl_orch.Engine"
METHODS = ("Health", "LoadWeights", "Generate")


def method_path(name: str) -> str:
    """The full gRPC method name a client calls, e.g. ``/jaxrl_orch.Engine/Generate``."""
    if name not in METHODS:
        raise ValueError(f"unknown {SERVICE} method {name!r}; known: {', '.join(METHODS)}")
    return f"/{SERVICE}/{name}"


def dumps(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode()


def loads(data: bytes) -> dict[str, Any]:
    message = json.loads(data.decode()) if data else {}
    if not isinstance(message, dict):
        raise ValueError(f"{SERVICE} messages are JSON objects, got {type(message).__name__}")
    return message


Handler = Callable[[dict[str, Any], Any], Awaitable[dict[str, Any]]]


def generic_handler(handlers: Mapping[str, Handler]) -> grpc.GenericRpcHandler:
    """The service as a grpcio generic handler; ``handlers`` maps every method name to an
    ``async (request_dict, context) -> response_dict``."""
    missing = sorted(set(METHODS) - set(handlers))
    extra = sorted(set(handlers) - set(METHODS))
    if missing or extra:
        raise ValueError(f"{SERVICE} handlers: missing {missing}, unknown {extra}")
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            name: grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=loads, response_serializer=dumps
            )
            for name, fn in handlers.items()
        },
    )


def sampling_to_json(sampling: SamplingParams) -> dict[str, Any]:
    out = {}
    for field in dataclasses.fields(sampling):
        value = getattr(sampling, field.name)
        out[field.name] = list(value) if isinstance(value, tuple) else value
    return out


def sampling_from_json(data: Mapping[str, Any]) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"unknown SamplingParams fields {unknown}; this replica knows {sorted(names)}"
        )
    # Lists come back as tuples: SamplingParams is frozen and hashable.
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return SamplingParams(**kwargs)


def completion_to_json(completion: Completion) -> dict[str, Any]:
    return {
        "token_ids": [int(t) for t in completion.token_ids],
        "logprobs": [float(x) if math.isfinite(x) else None for x in completion.logprobs],
        "versions": [int(v) for v in completion.versions],
        "finish_reason": completion.finish_reason,
    }


def completion_from_json(data: Mapping[str, Any]) -> Completion:
    return Completion(
        token_ids=[int(t) for t in data["token_ids"]],
        logprobs=[math.nan if x is None else float(x) for x in data["logprobs"]],
        versions=[int(v) for v in data["versions"]],
        finish_reason=str(data["finish_reason"]),
    )
