"""An engine replica's whole life, in a process of its own.

What it owns: ``serve_replica``: the built engine behind the HTTP contract
(``distributed.replica``) at the host and port of its own URL, pulling weights only from the
run's ``--weight_source``, until SIGTERM / SIGINT (the launcher's stop); ``check_bind``: refuses,
before any work, a replica URL or a trainer's weight server beyond loopback without an API key.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jax

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import Replicas, bind_of, host_port
from jaxrl_orch.distributed.group import Role
from jaxrl_orch.inference.engine_api import ReplicaEngine
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.serving.runner import HttpServer


def check_bind(replicas: Replicas, role: Role) -> None:
    """What this process will listen on must be loopback unless the run gives an API key: an
    engine replica's URL, trainer process 0's weight server (``--weight_source``)."""
    if role.kind == "engine":
        host, _ = bind_of(replicas.urls[role.replica])
    elif role.leader and replicas.weight_source is not None:
        host, _ = host_port(replicas.weight_source)
    else:
        return
    HttpServer.check_bind(host, replicas.api_key)


def serve_replica(
    cfg: TrainConfig, engine: ReplicaEngine, role: Role, replicas: Replicas, adapters: Any = None
) -> dict[str, Any]:
    """Serve ``engine`` at this replica's URL until SIGTERM / SIGINT (the launcher's stop).
    ``adapters``: a LoRA run's adapter tree (``compose.trainers.rl_adapters``), else None."""
    # The HTTP app is imported by the role that serves it: every process imports this module
    # for ``check_bind``, and a trainer's start should not pay for FastAPI.
    from jaxrl_orch.distributed.replica import replica_server, serve_until_signal

    url = replicas.urls[role.replica]
    host, server = replica_server(
        engine,
        replica=role.replica,
        model=cfg.model.name,
        bind=bind_of(url),
        weight_source=replicas.weight_source,
        processes=cfg.processes,
        api_key=replicas.api_key,
        warm_up=cfg.engine.warmup,
        lora=None if adapters is None else (adapters, cfg.lora.alpha / cfg.lora.rank),
    )
    transport = cfg.processes.weight_transport
    where = f"{role.describe()} at {url}, weights from {replicas.weight_source} ({transport})"
    stage("engine replica", f"{where}, {len(jax.local_devices())} devices")
    asyncio.run(serve_until_signal(host, server))
    return {"role": role.describe()}
