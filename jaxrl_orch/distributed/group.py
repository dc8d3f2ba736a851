"""Processes and roles (docs/scale-out.md): the layout, the trainer group, its command channel.

What it owns
    ``Role``: what one process of a run is, from ``Processes.trainer_processes`` (P),
    ``Processes.engine_replicas`` (R) and the process index K: K < P is trainer process K
    (K = 0, the leader, also runs the orchestrator), P <= K < P + R is engine replica K - P.
    One process without replicas is ``single`` (every part in one process, the default).
    ``join_group``: ``jax.distributed.initialize`` for a group of P > 1 (explicit coordinator
    and process id, or auto-detected on a TPU slice when both are left out), its CPU
    collectives listening on this host's address (``collectives``).
    ``Channel``: leader -> peers commands. Every message is three ``broadcast_one_to_all``
    collectives over the group's devices (a header, a JSON body, the arrays), so a peer
    receives exactly what the leader sent, in order: ``TRAIN`` (a packed batch), ``CHECKPOINT``
    (the step and the orchestrator's state), ``STOP`` (the run ended: gather the final params),
    ``ABORT`` (the leader failed: each peer raises ``GroupAborted`` with the leader's reason, so
    the whole group exits with an error instead of waiting in a collective for a leader that
    left: jax.distributed's shutdown barrier would hold the leader for minutes, then abort the
    peers with SIGABRT).
    ``EngineStager``: after every step each process runs one jitted program that casts the
    params to the engine's dtype and lays them out as the replicas' decode sharding, replicated
    over processes; the leader's shards then form an array on its own devices, laid out like a
    replica's, which each replica pulls (``offer_server``; with ``Processes.weight_transport =
    'jax'`` device to device, ``transfer``). No relayout on either side.

Lockstep: every process of the group issues the same collectives in the same order. The leader
issues them from its trainer thread (per step: TRAIN, the step, the stage, maybe CHECKPOINT) or,
once that thread is idle, from the main thread (the final CHECKPOINT, STOP); ``follow`` is the
peers' side. A lost process leaves the others blocked in a collective until jax.distributed's
heartbeat fails them; ``launch_local`` stops the whole run at once instead.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from jaxrl_orch.distributed.collectives import listen_at, route_address

TRAIN, CHECKPOINT, STOP, ABORT = 1, 2, 3, 4
ABORT_TIMEOUT_S = 60.0
_NAMES = {TRAIN: "TRAIN", CHECKPOINT: "CHECKPOINT", STOP: "STOP", ABORT: "ABORT"}


class GroupAborted(RuntimeError):
    """A peer's RL stage ends: trainer process 0 stopped the run on an error."""


@dataclasses.dataclass(frozen=True)
class Role:
    kind: str  # "single", "trainer" or "engine"
    process_index: int
    trainer_processes: int
    engine_replicas: int

    @property
    def leader(self) -> bool:
        """Runs the orchestrator and writes the workdir's outputs."""
        return self.kind != "engine" and self.process_index == 0

    @property
    def follows(self) -> bool:
        """A trainer group's peer: it trains the leader's batches, in lockstep, and has no
        engine side of its own."""
        return self.kind == "trainer" and self.process_index != 0

    @property
    def replica(self) -> int:
        return self.process_index - self.trainer_processes

    def describe(self) -> str:
        if self.kind == "single":
            return "one process: engine, trainer and orchestrator"
        if self.kind == "engine" and self.replica >= self.engine_replicas:
            return "an engine replica joining the run (--join)"
        if self.kind == "engine":
            return f"engine replica {self.replica} of {self.engine_replicas}"
        lead = " (leader: runs the orchestrator)" if self.leader else ""
        return f"trainer process {self.process_index} of {self.trainer_processes}{lead}"


def resolve_role(trainer_processes: int, engine_replicas: int, process_index: int | None) -> Role:
    """The role of process ``process_index`` (None: 0 for a single process; on a TPU slice
    ``jax.distributed`` tells the trainer its index, so None there means "ask it")."""
    p = trainer_processes
    r = engine_replicas
    if p == 1 and r == 0:
        if process_index not in (None, 0):
            raise ValueError(
                f"--process_index={process_index}, but the config runs one process "
                "(trainer_processes = 1, engine_replicas = 0); set them for a multi-process run"
            )
        return Role("single", 0, 1, 0)
    if p > 1 and r == 0:
        raise ValueError(
            f"trainer_processes={p} with engine_replicas=0: a trainer group serves through "
            "engine replicas (each its own process); set Processes.engine_replicas >= 1"
        )
    if process_index is None:
        if p == 1:
            raise ValueError(
                f"this run has {p + r} processes (trainer_processes={p}, engine_replicas={r}): "
                f"give each its --process_index (0: the trainer, 1..{r}: the engine replicas)"
            )
        process_index = -1  # filled in by jax.distributed (a trainer on a TPU slice)
    if not -1 <= process_index < p + r:
        raise ValueError(
            f"--process_index={process_index} is outside the layout: 0..{p - 1} train, "
            f"{p}..{p + r - 1} serve (trainer_processes={p}, engine_replicas={r})"
        )
    kind = "trainer" if process_index < p else "engine"
    return Role(kind, process_index, p, r)


def join_group(
    role: Role,
    coordinator_address: str | None,
    host_address: str | None = None,
    timeout_s: int = 300,
) -> Role:
    """Form the trainer group's ``jax.distributed`` cluster (trainers of a group of P > 1 only);
    returns the role with the process index jax.distributed assigned. The group's CPU
    collectives listen on ``host_address`` (None: this host's address on the route to the
    coordinator; ``collectives``)."""
    if role.kind != "trainer" or role.trainer_processes == 1:
        return role
    if role.process_index < 0 and coordinator_address is None:
        jax.distributed.initialize(initialization_timeout=timeout_s)  # a TPU slice: detected
    else:
        if coordinator_address is None:
            raise ValueError(
                "a trainer group needs --coordinator_address=HOST:PORT (trainer process 0's "
                "host) when --process_index is given"
            )
        jax.distributed.initialize(
            coordinator_address,
            num_processes=role.trainer_processes,
            process_id=max(role.process_index, 0),
            initialization_timeout=timeout_s,
            # Process 0's coordinator listens where it was told to (its default is every
            # interface): loopback for a local group, the slice's address on a TPU VM.
            coordinator_bind_address=coordinator_address,
        )
        _collectives_on(role, coordinator_address, host_address)
    if jax.process_count() != role.trainer_processes:
        raise ValueError(
            f"jax.distributed formed {jax.process_count()} processes, the config names "
            f"trainer_processes={role.trainer_processes}"
        )
    return dataclasses.replace(role, process_index=jax.process_index())


def _collectives_on(role: Role, coordinator: str, host_address: str | None) -> None:
    where = "--host_address, or the platform's name for this host"
    if host_address is None:
        host_address, where = route_address(coordinator), f"the route to {coordinator}"
    if listen_at(host_address):
        print(
            f"[process {role.process_index}] the trainer group's collectives listen on "
            f"{host_address} ({where})",
            flush=True,
        )


class Channel:
    """Leader -> peers commands of a trainer group (see the module docstring)."""

    def __init__(self, leader: bool) -> None:
        self.leader = leader

    def send(self, cmd: int, body: dict[str, Any], arrays: dict[str, np.ndarray] | None = None):
        if not self.leader:
            raise RuntimeError("only the group's process 0 sends commands")
        arrays = arrays or {}
        specs = {k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()}
        text = json.dumps({"body": body, "arrays": specs}).encode()
        multihost_utils.broadcast_one_to_all(np.array([cmd, len(text)], np.int64))
        multihost_utils.broadcast_one_to_all(np.frombuffer(text, np.uint8))
        if arrays:
            multihost_utils.broadcast_one_to_all(arrays)

    def abort(self, reason: str, timeout_s: float = ABORT_TIMEOUT_S) -> bool:
        """Send ABORT; False if the peers did not take it within ``timeout_s`` (a peer that
        failed itself: the launcher stops every process once one exits)."""
        body = {"reason": reason[:2000]}
        send = threading.Thread(target=self.send, args=(ABORT, body), daemon=True)
        send.start()
        send.join(timeout_s)
        if send.is_alive():
            print(
                f"!! the trainer group's peers did not take ABORT within {timeout_s:g} s",
                file=sys.stderr,
            )
        return not send.is_alive()

    def receive(self) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
        header = multihost_utils.broadcast_one_to_all(np.zeros(2, np.int64))
        cmd = int(header[0])
        n = int(header[1])
        if cmd not in _NAMES:
            raise RuntimeError(f"trainer group: unknown command {cmd} from process 0")
        raw = multihost_utils.broadcast_one_to_all(np.zeros(n, np.uint8))
        msg = json.loads(np.asarray(raw, np.uint8).tobytes())
        like = {k: np.zeros(shape, dtype) for k, (shape, dtype) in msg["arrays"].items()}
        arrays = multihost_utils.broadcast_one_to_all(like) if like else {}
        return cmd, msg["body"], {k: np.asarray(v) for k, v in arrays.items()}


class EngineStager:
    """Params on the trainer mesh -> an array on this process's devices in a replica's layout.

    ``layout``: the engine's param shardings on a mesh of this process's local devices (what a
    replica's decode mesh looks like), ``dtype`` the engine's weight dtype. Needs the decode
    mesh's size to divide each process's local device count (a replica's mesh fits on a host).
    """

    def __init__(self, trainer_mesh: Mesh, layout: Any, dtype: Any) -> None:
        leaves = jax.tree.leaves(layout)
        local_mesh = leaves[0].mesh
        self.dtype = dtype
        devices = sorted(trainer_mesh.devices.flat, key=lambda d: (d.process_index, d.id))
        per = len(jax.local_devices())
        if per % local_mesh.size or len(devices) % per:
            raise ValueError(
                f"a replica's decode mesh has {local_mesh.size} devices; it must divide each "
                f"trainer process's {per} local devices to be staged there"
            )
        shape = (len(devices) // local_mesh.size, *local_mesh.devices.shape)
        self.mesh = Mesh(np.array(devices).reshape(shape), ("copies", *local_mesh.axis_names))
        mine = [d for d in devices if d.process_index == jax.process_index()]
        self.local_mesh = Mesh(
            np.array(mine[: local_mesh.size]).reshape(local_mesh.devices.shape),
            local_mesh.axis_names,
        )
        out = jax.tree.map(lambda s: NamedSharding(self.mesh, s.spec), layout)
        self._local = jax.tree.map(lambda s: NamedSharding(self.local_mesh, s.spec), layout)
        floating = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
        cast = lambda p: jax.tree.map(floating, p)
        self._stage = jax.jit(cast, out_shardings=out)

    def transfer_layout(self) -> dict[str, Any]:
        """How ``local`` lays the arrays out, for a replica whose decode mesh differs (JSON:
        mesh axis sizes, one spec per leaf, the floating dtype; ``source.transfer_targets``
        reads it, and a replica refuses another dtype than its own)."""
        specs = [
            [list(p) if isinstance(p, tuple) else p for p in s.spec]
            for s in jax.tree.leaves(self._local)
        ]
        dtype = jnp.dtype(self.dtype).name
        return {"mesh": dict(self.local_mesh.shape), "specs": specs, "dtype": dtype}

    def stage(self, params: Any) -> Any:
        """The collective part: every process of the group calls it after every step."""
        return jax.block_until_ready(self._stage(params))

    def local(self, staged: Any) -> Any:
        """This process's copy of ``staged`` as an array on its own devices (no copy)."""

        def view(x: jax.Array, sharding: NamedSharding) -> jax.Array:
            mine = {s.device: s.data for s in x.addressable_shards}
            parts = [mine[d] for d in sharding.addressable_devices_indices_map(x.shape)]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, parts)

        # The shardings tree stops where the params tree wraps each array (nnx.Param).
        leaves, treedef = jax.tree.flatten(staged)
        targets = jax.tree.leaves(self._local)
        return jax.tree.unflatten(
            treedef, [view(x, s) for x, s in zip(leaves, targets, strict=True)]
        )
