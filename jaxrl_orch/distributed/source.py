"""TransferSource: a replica's one weight source, the trainer leader's weight server.

What it owns: fetching an offered pytree (``offer_server.HttpWeightOffer`` on the sender, or
``transfer.JaxWeightOffer`` when the run opts in) into an engine's decode shardings and weight
dtype. ``TransferSource(engine, address, transport=..., api_key=..., host=...)`` is bound to ONE
sender address when the server starts (``--weight_source``) and pulls with the run's transport
(``Processes.weight_transport``): ``http`` dials the sender with the run's key
(``offer_pull``) and listens nowhere; ``jax`` pulls through a receiver on ``host``, the
server's own bind address. ``source(uuid, layout, timeout_s) -> params`` is what
``serving.host.EngineHost`` calls for a weight update (``serving.contract.UPDATE_WEIGHTS``), so
a request names an offer, never where to pull from.

Layouts: the transfer copies shard for shard between identical layouts. A sender whose hosts
have fewer devices than this replica's decode mesh (a v5e trainer host has 4 chips, a v5e-8
engine VM 8) names the layout it staged in (``layout``: mesh axis sizes and one spec per leaf,
``spec_to_json``); the pull lands in that layout on this process's first devices
(``transfer_targets``), then reshards on its own devices into the decode sharding. A layout
equal to the engine's own (or None) pulls straight into the decode sharding.

Errors: ``TimeoutError`` when the pull does not finish within ``timeout_s`` (a stuck sender;
with ``jax`` also an offer never made, already pulled or expired), naming the sender, the uuid
and the timeout; ``offer_pull.PullRefused`` when the sender has no such offer or refuses the
key; ``ValueError`` naming a layout that does not fit this engine or host, a leaf whose shape,
dtype or shards differ from what this engine takes (checked on every ``http`` pull before a
byte is read), or the arrays of a pull that hold NaN or inf (``nonfinite_leaves``). Nothing is
swapped in by this class, so a failure leaves the engine serving what it had.

Threads: a call blocks (the HTTP server runs it in a worker thread); it only writes fresh
arrays, never the engine's state, so the driver keeps decoding meanwhile.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.config.runtime import WEIGHT_TRANSPORTS
from jaxrl_orch.distributed import offer_pull, transfer
from jaxrl_orch.distributed.addresses import host_port
from jaxrl_orch.inference.engine_api import ReplicaEngine
from sharding.reshard import reshard


class TransferSource:
    def __init__(
        self,
        engine: ReplicaEngine,
        address: str,
        *,
        transport: str = "http",
        api_key: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        sender, port = host_port(address, "weight source")
        if transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"weight transport must be one of {WEIGHT_TRANSPORTS}, got {transport!r}"
            )
        self.engine = engine
        self.host = host
        self.transport = transport
        self.address = f"{sender}:{port}" if ":" not in sender else f"[{sender}]:{port}"
        self._api_key = api_key
        self._targets: Any = None

    def __call__(self, uuid: int, layout: Any, timeout_s: float) -> Any:
        targets = self.pull_targets()
        shardings = self.engine.param_shardings
        return self.fetch(uuid, layout, timeout_s, targets, shardings)

    def fetch(self, uuid: int, layout: Any, timeout_s: float, targets: Any, shardings: Any) -> Any:
        """Offer ``uuid`` into ``targets`` (``ShapeDtypeStruct`` leaves with ``shardings``):
        straight in when ``layout`` is theirs (or None), else pulled in ``layout`` on this
        host's first devices and resharded into ``shardings`` here."""
        self._check_dtype(layout, targets)
        if layout is not None and layout == own_layout(targets):
            layout = None  # staged in this engine's own layout: pull straight in
        into = targets if layout is None else self._layout_targets(targets, layout)
        params = self._pull(int(uuid), into, float(timeout_s))
        if layout is not None:  # on this host's devices: into the decode sharding
            params = jax.block_until_ready(reshard(params, shardings))
        bad = nonfinite_leaves(params)
        if bad:  # a sender's bug (or bytes of another dtype) would decode as garbage
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise ValueError(f"offer uuid={uuid} holds NaN or inf in {shown}; not swapped in")
        return params

    def _pull(self, uuid: int, into: Any, timeout_s: float) -> Any:
        if self.transport == "http":
            return offer_pull.pull(self.address, uuid, into, timeout_s, api_key=self._api_key)
        return transfer.pull(self.address, uuid, into, timeout_s, host=self.host)

    def own_layout(self) -> dict:
        """The engine's decode layout as a sender would name it."""
        return own_layout(self.pull_targets())

    def _check_dtype(self, layout: Any, targets: Any) -> None:
        """The transfer copies raw bytes into the targets' dtype, so weights staged in another
        (a trainer whose ``Engine.param_dtype`` differs) would decode as garbage: refused."""
        sent = layout.get("dtype") if isinstance(layout, dict) else None
        mine = _floating_dtype(targets)
        if sent is not None and sent != mine:
            raise ValueError(
                f"the weights are staged in {sent!r}, this replica takes {mine!r}: "
                "Engine.param_dtype must be the same in every process of the run"
            )

    def _layout_targets(self, targets: Any, layout: Any) -> Any:
        try:
            return transfer_targets(targets, layout)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"bad layout in the weight update: {exc}; a layout is {{'mesh': {{axis: size}}, "
                "'specs': [one partition spec per array]}"
            ) from exc

    def pull_targets(self) -> Any:
        """The engine's params as pull targets: its decode shardings and ``param_dtype``."""
        if self._targets is None:
            dtype = self.engine.param_dtype
            self._targets = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(
                    a.shape,
                    dtype if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a.dtype,
                    sharding=a.sharding,
                ),
                self.engine.abstract_params(),
            )
        return self._targets


def _floating_dtype(targets: Any) -> str | None:
    """The dtype name of ``targets``' floating leaves (one per tree: a weight dtype)."""
    names = {jnp.dtype(t.dtype).name for t in jax.tree.leaves(targets)}
    floating = sorted(n for n in names if jnp.issubdtype(n, jnp.floating))
    return floating[0] if floating else None


def own_layout(targets: Any) -> dict:
    """How a sender names the layout of ``targets`` (pull targets on one mesh)."""
    shardings = [t.sharding for t in jax.tree.leaves(targets)]
    return {
        "mesh": dict(shardings[0].mesh.shape),
        "specs": [spec_to_json(x.spec) for x in shardings],
        "dtype": _floating_dtype(targets),
    }


def transfer_targets(targets: Any, layout: dict) -> Any:
    """``targets`` (pull targets in the decode sharding) re-laid as ``layout`` says:
    ``{"mesh": {axis: size, ...}, "specs": [spec per leaf]}`` over this process's first
    devices, each spec a list of None / axis name / list of axis names (``spec_to_json``)."""
    axes, sizes = zip(*layout["mesh"].items(), strict=True)
    n = int(np.prod(sizes))
    local = jax.local_devices()
    if n > len(local):
        raise ValueError(
            f"layout mesh {layout['mesh']} needs {n} devices, this host has {len(local)}"
        )
    mesh = Mesh(np.array(local[:n]).reshape(sizes), axes)
    leaves, treedef = jax.tree.flatten(targets)
    specs = layout["specs"]
    if len(specs) != len(leaves):
        raise ValueError(f"layout has {len(specs)} specs for {len(leaves)} arrays")
    out = []
    for x, spec in zip(leaves, specs, strict=True):
        parts = [tuple(p) if isinstance(p, list) else p for p in spec]
        out.append(
            jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*parts))
            )
        )
    return jax.tree.unflatten(treedef, out)


@jax.jit
def _all_finite(tree: Any) -> Any:
    return [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]


def nonfinite_leaves(params: Any) -> list[str]:
    """The paths of ``params``' floating leaves holding a NaN or an inf (one program, one read
    of every weight: about 20 ms for 16 GB at TPU memory bandwidth)."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0], strict=True)
    floating = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.floating)]
    finite = jax.device_get(_all_finite([leaves[i] for i in floating]))
    bad = [i for i, ok in zip(floating, finite, strict=True) if not ok]
    return [jax.tree_util.keystr(paths[i]) for i in bad]


def spec_to_json(spec: PartitionSpec) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]
