"""The engine behind the field's HTTP contract: vLLM's RL API and OpenAI's (docs/serving.md).

- ``host``: ``EngineHost``, one engine, its driver, its version, its pause state, its weights.
- ``app``: ``make_app(host, api_key=...)``, the FastAPI application: the routes below, the API
  key, the body / queue / time limits, errors as ``{"error": {"message", "type", "param",
  "code"}}`` with a 4xx naming the bad value.
- ``runner``: ``HttpServer``, uvicorn serving an app on a loopback port (any other bind needs
  an API key), in this thread's event loop or a thread of its own.
- ``contract``: the routes a pool calls on a replica (token-in/token-out generation, health,
  weight updates) and their bodies both ways, as pydantic models the client imports too.

Routes (bodies as vLLM writes them):
- the contract's: ``GENERATE``, ``HEALTH``, ``UPDATE_WEIGHTS``.
- ``GET /v1/models`` -> ``{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by", "root", "max_model_len"}]}``.
- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's shapes, SSE when
  ``"stream": true``.
- ``POST /pause?mode=keep|wait|abort``, ``POST /resume``, ``GET /is_paused``.
- ``GET /metrics`` (Prometheus text).

This package knows no config, trainer or orchestrator; ``jaxrl_orch.serve`` (the command) and
``distributed`` (the replicas) build hosts and serve them.
"""
