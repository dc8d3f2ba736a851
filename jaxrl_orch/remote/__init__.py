"""Engine replicas as separate processes: a gRPC request protocol and device-to-device weights.

- ``protocol``: the ``jaxrl_orch.Engine`` service (Health, LoadWeights, Generate) over grpcio
  generic handlers with JSON messages; SamplingParams / Completion (de)serialisation.
- ``server``: ``ReplicaServer``, one engine process's grpc.aio server around an
  ``InferenceDriver``; it starts without weights and pulls them on ``LoadWeights``.
- ``client``: ``RemoteEngineClient`` (the ``EngineClient`` duck type for ``ClientPool``),
  ``ReplicaLost``, ``WeightPullError``.
- ``weights``: ``WeightOffer`` / ``local_layout`` / ``pull`` over ``jax.experimental.transfer``.

Submodules are imported explicitly (``from jaxrl_orch.remote.client import ...``) so that the
client side does not pull in jax. This package knows nothing of orchestration or training.
"""
