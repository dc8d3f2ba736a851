"""A test engine replica: ``python -m support.replica_main --weight-source HOST:PORT
[--host ADDR] [--max-queued N] [--lora-rank R] [--weight-pull-timeout-s S]
[--weight-load-extra-s S]`` (``tests/`` on ``PYTHONPATH``).

Builds a ``DecodeEngine`` of ``tiny-byte`` on a tp=2 decode mesh over this process's 2 local
CPU devices (the caller sets ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu``), serves it as the train command's replicas are served
(``distributed.replica``: HTTP on a free port of ``--host``, 127.0.0.1 by default, weights
pulled only from ``--weight-source`` with the default transport, a weight update's pull bounded
by the ``Processes`` section's ``max_pull_s``, from its defaults or the two flags) and prints
``READY <url> <pid>`` once it answers. Runs until SIGTERM / SIGINT. ``make_engine`` is shared
with the tests' in-process reference engine. With ``--lora-rank`` it is a LoRA run's replica
(``lora_adapters``: rank-R adapters of tiny-byte on every projection, alpha 32): it takes the
base once, then adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import os


def make_engine():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxrl_orch.inference.engine import DecodeEngine
    from jaxrl_orch.inference.limits import EngineLimits
    from jaxrl_orch.models.configs import get_config

    mesh = Mesh(np.array(jax.local_devices()[:2]), ("tp",))
    limits = EngineLimits(
        max_concurrent_decodes=4, max_target_length=64, max_prefill_length=32, steps_per_call=4
    )
    return DecodeEngine(get_config("tiny-byte"), mesh=mesh, limits=limits)


def lora_adapters(rank: int):
    """``(abstract adapters, alpha / rank)`` of tiny-byte with rank-``rank`` adapters."""
    import dataclasses

    from jaxrl_orch.compose.staging import abstract_adapters
    from jaxrl_orch.models.configs import get_config
    from jaxrl_orch.models.lora_config import LoraConfig

    lora = LoraConfig(rank=rank, alpha=32.0)
    model = dataclasses.replace(get_config("tiny-byte"), lora=lora)
    return abstract_adapters(model), lora.scale


def main() -> None:
    from jaxrl_orch.config.runtime import ProcessesSettings as Processes
    from jaxrl_orch.distributed.replica import replica_server, serve_until_signal
    from jaxrl_orch.serving.contract import MAX_QUEUED

    parser = argparse.ArgumentParser()
    parser.add_argument("--weight-source", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address this replica binds")
    parser.add_argument("--max-queued", type=int, default=MAX_QUEUED)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--weight-pull-timeout-s", type=float, default=None)
    parser.add_argument("--weight-load-extra-s", type=float, default=None)
    args = parser.parse_args()
    deadlines = {
        "weight_pull_timeout_s": args.weight_pull_timeout_s,
        "weight_load_extra_s": args.weight_load_extra_s,
    }
    processes = Processes(**{k: v for k, v in deadlines.items() if v is not None})
    host, server = replica_server(
        make_engine(),
        replica=1,
        model="tiny-byte",
        bind=(args.host, 0),
        weight_source=args.weight_source,
        processes=processes,  # a run's, by default
        max_queued=args.max_queued,
        lora=lora_adapters(args.lora_rank) if args.lora_rank else None,
    )
    ready = lambda url: print(f"READY {url} {os.getpid()}", flush=True)  # noqa: E731
    asyncio.run(serve_until_signal(host, server, on_up=ready))


if __name__ == "__main__":
    main()
