"""An engine replica's whole life, in a process of its own.

What it owns: ``serve_replica``: the built engine behind the HTTP contract
(``distributed.replica``) at the host and port of its own URL, pulling weights only from the
run's ``--weight_source``, until SIGTERM / SIGINT (the launcher's stop, or a drain: it asks
the run to drain it first); a replica started with ``--join`` asks the run to admit it
(``distributed.replica.RunLink``) and exits with the refusal when refused; ``check_bind``:
refuses, before any work, a replica URL or a trainer's weight server beyond loopback without an
API key.
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


def check_bind(replicas: Replicas, role: Role) -> None:
    """What this process will listen on must be loopback unless the run gives an API key: an
    engine replica's URL, trainer process 0's weight server (``--weight_source``)."""
    if role.kind == "engine":
        host, _ = bind_of(own_url(replicas, role))
    elif role.leader and replicas.weight_source is not None:
        host, _ = host_port(replicas.weight_source)
    else:
        return
    # Imported by the roles that serve: a one-process run's start does not pay for uvicorn.
    from jaxrl_orch.serving.runner import HttpServer

    HttpServer.check_bind(host, replicas.api_key)


def own_url(replicas: Replicas, role: Role) -> str:
    """The URL this replica serves at: its ``--join``, else its place in ``--engine_addresses``."""
    return replicas.join or replicas.urls[role.replica]


def serve_replica(
    cfg: TrainConfig, engine: ReplicaEngine, role: Role, replicas: Replicas, adapters: Any = None
) -> dict[str, Any]:
    """Serve ``engine`` at this replica's URL until SIGTERM / SIGINT (the launcher's stop).
    ``adapters``: a LoRA run's adapter tree (``compose.trainers.rl_adapters``), else None."""
    # The HTTP app is imported by the role that serves it: every process imports this module
    # for ``check_bind``, and a trainer's start should not pay for FastAPI.
    from jaxrl_orch.distributed.admission import JoinRefused
    from jaxrl_orch.distributed.replica import RunLink, replica_server, serve_until_signal

    url = own_url(replicas, role)
    host, server = replica_server(
        engine,
        replica=url if replicas.join else role.replica,
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
    link = RunLink(
        replicas.weight_source,
        url,
        replicas.api_key,
        join=replicas.join is not None,
        drain_s=cfg.processes.replica_request_timeout_s + 30.0,  # the pool's bound on a drain
    )
    try:
        asyncio.run(serve_until_signal(host, server, link=link))
    except JoinRefused as refused:
        where = replicas.weight_source
        raise SystemExit(f"error: the run at {where} refused this replica: {refused}") from None
    return {"role": role.describe()}
