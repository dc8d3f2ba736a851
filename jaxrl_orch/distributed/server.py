"""ReplicaServer: one engine replica behind the ``jaxrl_orch.Engine`` gRPC service.

Owns: the grpc.aio server of one engine process, the ``InferenceDriver`` that decodes for it
(built at the first weight load), the replica's policy version and its admission bound.
The engine role of the train command builds a ``DecodeEngine`` on this host's devices and
awaits ``ReplicaServer(engine, address=..., replica=i).serve()``.

Layouts: the transfer copies shard for shard between identical layouts. A sender whose hosts
have fewer devices than this replica's decode mesh (a v5e trainer host has 4 chips, a v5e-8
engine VM 8) names the layout it staged in (``layout``: mesh axis sizes and one spec per
leaf); the replica pulls into that layout on its first devices, then reshards on its own
devices into its decode sharding (``transfer_targets``).

Lifecycle: the replica starts with NO weights (``Health.ready`` False, version -1; ``Generate``
fails FAILED_PRECONDITION). ``LoadWeights`` pulls an offered pytree device to device
(``transfer.pull``) straight into ``engine.param_shardings`` with ``engine.param_dtype``;
the first load builds and starts the driver, later ones ``swap_params`` and wait until the
driver has switched (between two decode steps, so per-token versions stay exact). Loads are
serialised; a version older than the current one is refused (INVALID_ARGUMENT).

Thread / loop contracts: every handler runs on the server's asyncio loop and never blocks it:
the pull runs in a worker thread (``asyncio.to_thread``), driver futures are awaited through
``asyncio.wrap_future``. The driver's own thread is the only one touching the engine, except
the pull, which only writes fresh arrays. One unary ``Generate`` per sample: the driver shares
the prefill of identical pending prompts.

Invariants:
- At most ``max_queued`` ``Generate`` calls are in flight; one more is RESOURCE_EXHAUSTED.
- A ``Generate`` whose client cancels (or whose deadline passes) cancels its driver future, so
  its slot frees at the driver's next loop turn.
- A pull that does not finish within its ``timeout_s`` fails ``LoadWeights`` with
  DEADLINE_EXCEEDED naming the replica, the version, the sender and the timeout; the
  replica keeps serving its current weights.
- ``stop()`` stops the grpc server (in-flight calls get ``grace_s``) and then the driver thread.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import grpc
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.distributed import protocol
from jaxrl_orch.distributed import transfer as remote_weights
from jaxrl_orch.inference.driver import InferenceDriver
from sharding.reshard import reshard


class ReplicaServer:
    def __init__(
        self,
        engine: Any,
        *,
        address: str,
        replica: int,
        max_queued: int = 4096,
        prefix_cache_size: int = 16,
        pull_timeout_s: float = 120.0,
        warm_up: bool = False,
    ) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        self.engine = engine
        self.address = address
        self.replica = int(replica)
        self.max_queued = int(max_queued)
        self.prefix_cache_size = prefix_cache_size
        self.pull_timeout_s = float(pull_timeout_s)  # when a LoadWeights gives no timeout_s
        self.warm_up = warm_up  # InferenceDriver.warm_up at the first load, before serving
        self.bound_address: str | None = None  # "host:port" once serve() has bound
        self.driver: InferenceDriver | None = None
        self.version = -1
        self.in_flight = 0
        self._targets: Any = None
        self._load_lock: asyncio.Lock | None = None
        self._server: Any = None
        self._done: asyncio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        """Bind ``address`` and serve until ``stop()``."""
        if self._server is not None:
            raise RuntimeError(f"replica {self.replica}: serve() called twice")
        self._load_lock = asyncio.Lock()
        self._done = asyncio.Event()
        server = grpc.aio.server()
        handlers = {"Health": self._health, "LoadWeights": self._load, "Generate": self._generate}
        server.add_generic_rpc_handlers((protocol.generic_handler(handlers),))
        port = server.add_insecure_port(self.address)
        if not port:
            raise RuntimeError(f"replica {self.replica}: could not bind {self.address}")
        self._server = server
        await server.start()
        self.bound_address = f"{self.address.rsplit(':', 1)[0]}:{port}"
        await self._done.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.driver is not None:
            await asyncio.to_thread(self.driver.stop)
        if self._done is not None:
            self._done.set()

    # ------------------------------------------------------------------ handlers

    async def _health(self, request: dict, context: Any) -> dict:
        g = self.driver.gauges() if self.driver else {}
        queued = g.get("inference/queue_depth", 0)
        engine_s = g.get("inference/prefill_s", 0.0) + g.get("inference/decode_s", 0.0)
        return {
            "engine_s": engine_s,  # prefill + decode seconds so far
            "replica": self.replica,
            "ready": self.driver is not None,
            "version": self.version,
            "in_flight": self.in_flight,
            "queued": int(queued),
            "slots": int(self.engine.max_concurrent_decodes),
            "pid": os.getpid(),
        }

    async def _load(self, request: dict, context: Any) -> dict:
        try:
            version = int(request["version"])
            address, uuid = str(request["address"]), int(request["uuid"])
            timeout_s = float(request.get("timeout_s") or self.pull_timeout_s)
        except (KeyError, TypeError, ValueError) as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica {self.replica}: bad LoadWeights request {request!r}: {exc}",
            )
        assert self._load_lock is not None
        async with self._load_lock:
            if version < self.version:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"replica {self.replica}: version must not go backwards: holds "
                    f"{self.version}, asked to load {version}",
                )
            where = f"replica {self.replica}: weight pull of version {version} from {address}"
            t0 = time.perf_counter()
            layout = request.get("layout")
            if layout is not None and layout == self._own_layout():
                layout = None  # the sender staged in this replica's own layout: pull straight in
            targets = self._pull_targets() if layout is None else self._layout_targets(layout)
            try:
                params = await asyncio.to_thread(
                    remote_weights.pull, address, uuid, targets, timeout_s
                )
                if layout is not None:  # on this host's devices: into the decode sharding
                    params = jax.block_until_ready(reshard(params, self.engine.param_shardings))
            except TimeoutError:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"{where} timed out after {timeout_s} s"
                )
            except Exception as exc:  # noqa: BLE001 - reported to the caller, replica lives on
                await context.abort(
                    grpc.StatusCode.INTERNAL, f"{where} failed: {type(exc).__name__}: {exc}"
                )
            pull_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            if self.driver is None:
                driver = InferenceDriver(
                    self.engine, params, version, prefix_cache_size=self.prefix_cache_size
                )
                if self.warm_up:  # every program compiled before the first request is served
                    warm_s = await asyncio.to_thread(driver.warm_up)
                    print(f"replica {self.replica}: engine warm-up {warm_s:.1f} s", flush=True)
                driver.start()
                self.driver = driver
            else:
                await asyncio.wrap_future(self.driver.swap_params(params, version))
            self.version = version
            swap_s = time.perf_counter() - t1
            print(
                f"replica {self.replica}: serving version {version} (pull {pull_s:.3f} s, "
                f"swap {swap_s:.3f} s)",
                flush=True,
            )
            return {"version": version, "pull_s": pull_s, "swap_s": swap_s}

    def _own_layout(self) -> dict:
        shardings = jax.tree.leaves(self.engine.param_shardings)
        return {
            "mesh": dict(self.engine.mesh.shape),
            "specs": [spec_to_json(x.spec) for x in shardings],
        }

    def _layout_targets(self, layout: dict) -> Any:
        """Pull targets in the sender's layout (``transfer_targets``), on this host's devices."""
        try:
            return transfer_targets(self._pull_targets(), layout)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"replica {self.replica}: bad layout in LoadWeights: {exc}") from exc

    def _pull_targets(self) -> Any:
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

    async def _generate(self, request: dict, context: Any) -> dict:
        if self.driver is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"replica {self.replica} holds no weights yet (LoadWeights first)",
            )
        if self.in_flight >= self.max_queued:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"replica {self.replica}: {self.in_flight} requests in flight, the bound is "
                f"max_queued={self.max_queued}",
            )
        try:
            sampling = protocol.sampling_from_json(request.get("sampling", {}))
            (future,) = self.driver.submit(request["prompt_ids"], sampling, n=1)
        except (KeyError, TypeError, ValueError) as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica {self.replica}: bad Generate request: {type(exc).__name__}: {exc}",
            )
        self.in_flight += 1
        try:
            completion = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # the client went away: free the slot
            raise
        except Exception as exc:  # noqa: BLE001 - an engine error fails this call only
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"replica {self.replica}: generate failed: {type(exc).__name__}: {exc}",
            )
        finally:
            self.in_flight -= 1
        return protocol.completion_to_json(completion)


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


def spec_to_json(spec: PartitionSpec) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in spec]
