"""The engine behind the field's HTTP contract: vLLM's RL API and OpenAI's (DESIGN.md section 5).

- ``host``: ``EngineHost``, one engine, its driver, its version, its pause state, its weights.
- ``app``: ``make_app(host, api_key=...)``, the FastAPI application: the routes below, the API
  key, the body / queue / time limits, errors as ``{"error": {"message", "type", "param",
  "code"}}`` with a 4xx naming the bad value.
- ``runner``: ``HttpServer``, uvicorn serving an app on a loopback port (any other bind needs
  an API key), in this thread's event loop or a thread of its own.

Routes (bodies as vLLM writes them; ``policy_versions`` is ours):
- ``GET /v1/models`` -> ``{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by", "root", "max_model_len"}]}``.
- ``POST /inference/v1/generate`` ``{"model", "token_ids", "sampling_params": {...}}`` ->
  ``{"request_id", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token":
  "token_id:<id>", "logprob", "bytes", "top_logprobs"}]}, "finish_reason",
  "policy_versions"}], "prompt_logprobs": null}``.
- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's shapes, SSE when
  ``"stream": true``.
- ``POST /pause?mode=keep|wait|abort``, ``POST /resume``, ``GET /is_paused``.
- ``POST /update_weights`` ``{"version", "uuid", "layout", "timeout_s", "part"}``: pull an
  offer from the source the server was started with (``part``: ``weights``, or a LoRA run's
  ``base`` once and ``adapters`` per version).
- ``GET /health`` (the state a pool reads), ``GET /metrics`` (Prometheus text).

This package knows no config, trainer or orchestrator; ``jaxrl_orch.serve`` (the command) and
``distributed`` (the replicas) build hosts and serve them.
"""
