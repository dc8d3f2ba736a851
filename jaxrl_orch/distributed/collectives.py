"""Where a trainer process's CPU collectives listen: the one listener of a trainer group that no
launch flag names (the coordinator binds its flag's host, the weight server its own, a replica
its URL's).

What it owns
    ``route_address``: this host's address on the route to the coordinator, the interface the
    group's other hosts reach it on (a UDP socket connected to it: no packet is sent).
    ``listen_at``: the CPU backend's gloo collectives bind ``address`` and hand it to the peers.
    jax's own choice is whatever this host's hostname resolves to: on a host whose /etc/hosts
    puts it on 127.0.1.1 (Debian's convention) every peer then dials its own loopback and the
    group fails with ``timed out connecting ... remote=[127.0.1.1]``; where it does not resolve
    (a network namespace), the CPU backend fails to start.

jax has no public setting for it: ``listen_at`` registers the CPU backend's factory again with
the collectives made as jax makes them, given the address. Call it after
``jax.distributed.initialize`` and before the first JAX computation; without gloo (another
``jax_cpu_collectives_implementation``) or the private hooks it leaves jax's choice.
"""

from __future__ import annotations

import socket

import jax

from jaxrl_orch.distributed.addresses import host_port


def route_address(coordinator: str) -> str:
    """This host's address that packets to ``coordinator`` (HOST:PORT) leave from."""
    host, port = host_port(coordinator, "--coordinator_address")
    family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def listen_at(address: str) -> bool:
    """Make the CPU backend's gloo collectives listen on ``address``; False where jax's own
    choice stays (collectives other than gloo, or a jax without these hooks)."""
    if jax.config.jax_cpu_collectives_implementation != "gloo":
        return False
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax

        make_gloo = _jax.make_gloo_tcp_collectives
        make_cpu, register = xla_bridge.make_cpu_client, xla_bridge.register_backend_factory
    except (ImportError, AttributeError):
        return False
    client = distributed.global_state.client

    def cpu_client():
        return make_cpu(collectives=make_gloo(distributed_client=client, hostname=address))

    register("cpu", cpu_client, priority=0, fail_quietly=False)
    return True
