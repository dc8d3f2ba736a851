"""Decoding for RL: a JetStream-contract engine, a continuous-batching driver, an async client.

- ``engine_api``: ``ResultTokens`` / ``SlotData`` and ``JetStreamEngine``, the Protocol of the
  engine the driver drives.
- ``sampling``: per-slot temperature / top-k / top-p sampling with behavior log-probs (jnp).
- ``decode_state``: the decode state's layout and pure slot operations (insert, move, narrow).
- ``limits``: ``EngineLimits``, the slot / length / step limits an engine is built with.
- ``engine``: ``DecodeEngine``, the Transformer behind the Engine methods on a decode mesh.
- ``driver``: ``InferenceDriver``, one loop thread running its parts: ``intake`` (the queue of
  submitted samples, grouped by prompt), ``prefixes`` (prefills and their cache), ``slots`` (the
  slot table and the decode step), ``swap`` (param hot-swap), ``pause`` (vLLM's pause modes);
  and their helpers: ``requests`` (request records, validation), ``narrow`` (decode widths,
  warm-up), ``rate`` (tokens per second).
- ``client``: ``EngineClient`` / ``ClientPool``, the ``types.InferenceClient`` / ``InferencePool``.

Submodules are imported explicitly (``from jaxrl_orch.inference.driver import ...``) so that the
host-only pieces (driver, client) do not pull in the model. This package knows nothing of
orchestration, training or environments.
"""
