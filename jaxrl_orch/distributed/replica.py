"""An engine replica of a multi-process run: one engine behind the HTTP contract.

What it owns: assembling a replica from the serving parts, the same ones ``python -m
jaxrl_orch.serve`` uses: ``ReplicaHost`` (an ``EngineHost`` that starts without weights and
whose only weight source is a ``source.TransferSource`` bound to the trainer leader's weight
server, pulling with the run's transport and key), ``make_app`` (the routes, the API key, the
longest pull a weight update may ask for) and ``HttpServer`` (the bind: loopback, or any
address with an API key). ``replica_server`` builds the pair; ``serve_until_signal`` serves it
until SIGTERM / SIGINT and then stops the driver.

Lifecycle: the replica answers its health probe at once (``ready`` False, version -1) and
refuses generation (503) until the pool's first weight update lands (``serving.contract``),
which also builds and warms up the driver; each later update swaps between two decode steps.
Every update is logged as ``replica R: serving version V (pull ..., swap ...)``, the line
operators and tests read (a LoRA run's replica first says ``replica R: holds the LoRA base``: it
serves nothing until the first adapters arrive).

Joining and leaving (``RunLink``, docs/scale-out.md): a replica started mid-run (``--join``)
asks the run's leader, at its weight source, to admit it once its server answers, and stops
with the refusal when the run refuses it; on SIGTERM every replica of a run first asks the
leader to drain it (no new groups; the requests it holds finish) and stops when the leader
answers, at once when the leader does not (the run has ended). A second signal stops at once.

Never: pulls from an address a request names (the update body has no address field), binds
beyond loopback without an API key, or listens anywhere but its own URL: with the default
transport it only dials the trainer (``offer_pull``); with ``jax`` its weight receiver binds the
host of its URL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any, Protocol

import aiohttp

from jaxrl_orch.distributed.admission import DRAIN, JOIN, JoinRefused, ask
from jaxrl_orch.distributed.lora_source import LoraSource
from jaxrl_orch.distributed.source import TransferSource
from jaxrl_orch.inference.engine_api import ReplicaEngine
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.contract import MAX_QUEUED, WeightsLoaded
from jaxrl_orch.serving.guard import Limits
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer


class ReplicaHost(EngineHost):
    """An ``EngineHost`` that logs every weight update it takes (see the module docstring)."""

    def __init__(self, engine: ReplicaEngine, *, replica: int | str, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.replica = replica  # its index, or a joining replica's URL (the pool numbers it)

    def loaded(self, part: str, out: WeightsLoaded) -> None:
        what = "holds the LoRA base" if part == "base" else f"serving version {out.version}"
        print(
            f"replica {self.replica}: {what} (pull {out.pull_s:.3f} s, swap {out.swap_s:.3f} s)",
            flush=True,
        )


class ReplicaSettings(Protocol):
    """What a replica reads of the run's ``Processes`` section (``config.runtime``)."""

    replica_request_timeout_s: float
    weight_transport: str

    @property
    def max_pull_s(self) -> float: ...


def replica_server(
    engine: ReplicaEngine,
    *,
    replica: int | str,
    model: str,
    bind: tuple[str, int],
    weight_source: str,
    processes: ReplicaSettings,
    api_key: str | None = None,
    warm_up: bool = False,
    max_queued: int = MAX_QUEUED,
    lora: tuple[Any, float] | None = None,
) -> tuple[ReplicaHost, HttpServer]:
    """Replica ``replica`` of ``engine``: its host (no weights yet) and its server on ``bind``
    (``(host, port)``, port 0: a free one), pulling only from ``weight_source`` (HOST:PORT)
    with the run's transport and key. From ``processes``: a generation past
    ``replica_request_timeout_s`` fails and frees its slot; a weight update asking for a pull
    longer than ``max_pull_s`` is refused (400), so none holds the load lock past it.
    ``lora``: ``(abstract adapters, alpha / rank)`` of a LoRA run, whose replicas hold the
    frozen base and merge each version's adapters into it (``lora_source``)."""
    # With 'jax' its receiver binds the replica's own host: nothing listens on every interface.
    how = {"transport": processes.weight_transport, "api_key": api_key, "host": bind[0]}
    if lora is None:
        source = TransferSource(engine, weight_source, **how)
    else:
        source = LoraSource(engine, weight_source, *lora, **how)
    host = ReplicaHost(
        engine,
        replica=replica,
        model=model,
        source=source,
        warm_up=warm_up,
        max_queued=max_queued,
    )
    limits = Limits(
        request_timeout_s=processes.replica_request_timeout_s, max_pull_s=processes.max_pull_s
    )
    app = make_app(host, api_key=api_key, limits=limits)
    return host, HttpServer(app, host=bind[0], port=bind[1], api_key=api_key)


@dataclasses.dataclass(frozen=True)
class RunLink:
    """What a replica of a run asks the run's leader (see the module docstring): at
    ``weight_source``, about the replica serving at ``url``, with the run's ``api_key``;
    ``join``: ask to be admitted once up; ``drain_s``: how long a drain may take to answer."""

    weight_source: str
    url: str
    api_key: str | None = dataclasses.field(repr=False)
    join: bool
    drain_s: float

    async def join_run(self) -> None:
        """Admitted, or ``JoinRefused`` naming why; one line either way."""
        decision = await ask(JOIN, self.weight_source, self.url, self.api_key, 60.0)
        print(f"replica {self.url}: the run says: {decision.message}", flush=True)

    async def leave_run(self) -> None:
        """Ask to be drained; returns once the leader answers, or at once when it does not."""
        print(f"replica {self.url}: asking the run to drain it", flush=True)
        try:
            decision = await ask(DRAIN, self.weight_source, self.url, self.api_key, self.drain_s)
            said = decision.message
        except (JoinRefused, aiohttp.ClientError, TimeoutError) as exc:
            said = f"no drain ({type(exc).__name__}: {exc}); stopping"
        print(f"replica {self.url}: {said}", flush=True)


async def serve_until_signal(
    host: ReplicaHost, server: HttpServer, on_up: Any = None, link: RunLink | None = None
) -> None:
    """Serve until SIGTERM / SIGINT, calling ``on_up(url)`` once the server answers (and, with
    ``link``, joining the run when asked to, and leaving it on the signal: see the module
    docstring); then stop the server (in-flight requests get its grace period) and the
    driver. Raises ``JoinRefused`` when the run refused to admit this replica."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_signal() -> None:
        if link is None or signalled.is_set():
            server.stop()
        signalled.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    serving = asyncio.ensure_future(server.serve())
    leaving = asyncio.ensure_future(_leave_on_signal(signalled, link, server))
    try:
        while server.port is None and not serving.done():
            await asyncio.sleep(0.02)
        if link is not None:
            # uvicorn took SIGTERM / SIGINT for itself as it started (it would stop at once,
            # cutting off the requests a drain lets finish): a run's replica takes them back.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, on_signal)
        if on_up is not None and server.port is not None:
            on_up(server.url)
        if link is not None and link.join and server.port is not None:
            try:
                await link.join_run()
            except BaseException:
                server.stop()
                raise
        await serving
    finally:
        leaving.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await asyncio.to_thread(host.stop)


async def _leave_on_signal(signalled: asyncio.Event, link: RunLink | None, server: Any) -> None:
    await signalled.wait()
    if link is not None:
        await link.leave_run()
    server.stop()
