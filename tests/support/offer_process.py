"""A process that offers weights: ``python -m support.offer_process http|jax|jax-roundtrip``.

``http`` / ``jax``: starts the sender of that transport on a free loopback port
(``HttpWeightOffer`` with the key ``KEY``, or ``JaxWeightOffer``), offers one small array,
prints ``READY <address> <uuid>`` and serves until its stdin closes, then exits 0. The test that
reproduces the JAX transfer server's abort (``tests/distributed/test_jax_transport.py``) sends
bytes to its port and reads how it ended.

``jax-roundtrip``: the opt-in transport end to end in this one process (4 CPU devices): arrays
on devices 0-1 offered by a ``JaxWeightOffer`` and pulled by a replica's ``TransferSource`` with
``transport='jax'`` into an engine's shardings on devices 2-3; prints ``SAME`` when every leaf
came back equal and in its sharding. In a process of its own because a transfer server cannot
be stopped.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

KEY = "offer-process-key"


def serve(kind: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl_orch.distributed.offer_server import HttpWeightOffer
    from jaxrl_orch.distributed.transfer import JaxWeightOffer

    sender = HttpWeightOffer(api_key=KEY) if kind == "http" else JaxWeightOffer()
    uuid = sender.offer({"w": jax.device_put(jnp.arange(16.0))})
    print(f"READY {sender.address} {uuid}", flush=True)
    sys.stdin.read()  # until the test closes it
    if kind == "http":
        # Its server thread stopped before the interpreter tears down (a thread of a live
        # event loop at exit could end the process with SIGABRT under load).
        sender.close()


def roundtrip() -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrl_orch.distributed.source import TransferSource
    from jaxrl_orch.distributed.transfer import JaxWeightOffer

    here, there = (Mesh(np.array(jax.devices()[i : i + 2]), ("tp",)) for i in (0, 2))
    specs = {"w": P(None, "tp"), "b": P()}
    values = {"w": np.arange(32.0, dtype=np.float32).reshape(4, 8), "b": np.ones(8, np.float32)}
    sent = {k: jax.device_put(v, NamedSharding(here, specs[k])) for k, v in values.items()}
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(there, specs[k]))
        for k, v in values.items()
    }
    engine = SimpleNamespace(
        param_dtype=np.float32,
        abstract_params=lambda: abstract,
        param_shardings={k: a.sharding for k, a in abstract.items()},
    )
    offer = JaxWeightOffer()
    source = TransferSource(engine, offer.address, transport="jax")
    got = source(offer.offer(sent), None, 30.0)
    same = all(
        np.array_equal(np.asarray(got[k]), values[k]) and got[k].sharding == abstract[k].sharding
        for k in values
    )
    print("SAME" if same else f"DIFFERENT {got}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "jax-roundtrip":
        roundtrip()
    else:
        serve(sys.argv[1])
