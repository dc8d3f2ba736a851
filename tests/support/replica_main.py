"""A test engine replica: ``python -m support.replica_main [--max-queued N]`` (``tests/`` on
``PYTHONPATH``).

Builds a ``DecodeEngine`` of ``tiny-byte`` on a tp=2 decode mesh over this process's 2 local
CPU devices (the caller sets ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu``), serves it with ``ReplicaServer`` on a free port of 127.0.0.1 and prints
``READY <host:port> <pid>`` once bound. Runs until killed (SIGTERM stops it cleanly).
``make_engine`` is shared with the tests' in-process reference engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal


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


async def _main(max_queued: int) -> None:
    from jaxrl_orch.distributed.server import ReplicaServer

    server = ReplicaServer(make_engine(), address="127.0.0.1:0", replica=1, max_queued=max_queued)
    task = asyncio.create_task(server.serve())
    while server.bound_address is None and not task.done():
        await asyncio.sleep(0.01)
    print(f"READY {server.bound_address} {os.getpid()}", flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(server.stop(0.5)))
    await task


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-queued", type=int, default=4096)
    asyncio.run(_main(parser.parse_args().max_queued))
