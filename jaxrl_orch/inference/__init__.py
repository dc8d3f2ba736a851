"""Decoding for RL: a JetStream-contract engine, a continuous-batching driver, an async client.

- ``engine_api``: ``ResultTokens`` / ``SlotData`` and the ``Engine`` Protocol the driver drives.
- ``sampling``: per-slot temperature / top-k / top-p sampling with behavior log-probs (jnp).
- ``decode_state``: the decode state's layout and pure slot operations (insert, move, narrow).
- ``limits``: ``EngineLimits``, the slot / length / step limits an engine is built with.
- ``engine``: ``DecodeEngine``, the Transformer behind the Engine methods on a decode mesh.
- ``driver``: ``InferenceDriver``, slots, prefix sharing, param hot-swap, pause, one loop thread;
  its parts: ``requests`` (request records, validation), ``prefixes`` (prefills and their
  cache), ``narrow`` (decode widths, warm-up), ``pause`` (vLLM's pause modes), ``rate``.
- ``client``: ``EngineClient`` / ``ClientPool``, the ``types.InferenceClient`` / ``InferencePool``.

Submodules are imported explicitly (``from jaxrl_orch.inference.driver import ...``) so that the
host-only pieces (driver, client) do not pull in the model. This package knows nothing of
orchestration, training or environments.
"""
