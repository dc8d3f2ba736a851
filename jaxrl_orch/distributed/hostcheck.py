"""Whether the hosts a platform names for this process can be used from here, checked before
any work (``distributed.platform.resolve_flags`` calls ``check_hosts``).

What it owns
    ``check_hosts``: the host the platform puts this process on is this host (else another
    process there claims the same index: two processes would register one ``process_id``, and
    jax.distributed aborts the whole group, docs/scale-out.md); the coordinator's host resolves
    (else every trainer waits out jax.distributed's 300 s and fails with DEADLINE_EXCEEDED), and
    is this host for process 0, which binds it; the weight source's host resolves for a replica.
    ``addresses``: a host's addresses (getaddrinfo); ``is_here``: whether one of them is this
    host's (a bind to it succeeds: no packet is sent).
    ``claim_index``: this process holds index K of its run on this host for as long as it
    lives; a second process here claiming the same K is refused naming the first one's pid.

Each refusal is one line naming the variable or flag, its value and what is allowed. A name
that does not resolve yet is retried for ``Platform.dns_wait_s`` (a JobSet's pod names appear
as its pods start; a TPU VM's worker list and a Slurm node list exist before the processes).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from jaxrl_orch.distributed.addresses import host_port

if TYPE_CHECKING:
    from jaxrl_orch.distributed.platform import Platform

Resolve = Callable[[str], set[str]]
_now, _sleep = time.monotonic, time.sleep  # the clock of the wait for a name (tests step it)


def addresses(host: str) -> set[str]:
    """The addresses ``host`` resolves to; socket.gaierror when it does not."""
    return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}


def is_here(found: set[str]) -> bool:
    """Whether one of ``found`` is an address of this host (its network namespace)."""
    return here(found) is not None


def here(found: set[str]) -> str | None:
    """The first of ``found`` (in order) that is an address of this host, or None."""
    for address in sorted(found):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address.split("%")[0], 0))
            except OSError:
                continue
            return address
    return None


def _resolved(host: str, named: str, wait_s: float, resolve: Resolve) -> set[str]:
    deadline = _now() + wait_s
    while True:
        try:
            return resolve(host)
        except OSError as exc:  # socket.gaierror
            if _now() >= deadline:
                raise ValueError(
                    f"{named}: host {host!r} does not resolve ({exc.strerror or exc}, tried for "
                    f"{wait_s:g} s); it must be a name or address every process of the run "
                    "resolves (a pod, worker or node name, or an IP address)"
                ) from None
            _sleep(min(1.0, wait_s))


def check_hosts(
    found: Platform,
    values: Mapping[str, object],
    given: set[str],
    trainer_processes: int,
    resolve: Resolve | None = None,
) -> str | None:
    """Refuse, naming its source, a host of this process's launch that cannot be used here.
    Returns this host's address where the platform names this process's host (else None)."""
    resolve = resolve or addresses
    k, p, wait = values["process_index"], trainer_processes, found.dns_wait_s
    mine = None
    if found.own_host and "process_index" not in given and isinstance(k, int):
        own = _resolved(found.own_host, f"{found.index_from}={k}", wait, resolve)
        mine = here(own)
        if mine is None:
            raise ValueError(
                f"{found.index_from}={k} puts this process on {found.own_host!r} "
                f"({', '.join(sorted(own))}), which is not this host: two processes would claim "
                f"index {k}; allowed: the index whose host is this one (read: {found.describe()})"
            )
    if not isinstance(k, int) or (k < p and p == 1):
        return mine  # a trainer on its own joins no group
    flag = "coordinator_address" if k < p else "weight_source"
    if not values[flag]:
        return mine  # the flags' own checks name it
    named = f"--{flag}" if flag in given else found.leader_from
    host, _ = host_port(str(values[flag]), named)
    leader = _resolved(host, named, wait, resolve)
    if k == 0 and not is_here(leader):
        raise ValueError(
            f"{named}: {values[flag]!r} ({', '.join(sorted(leader))}) is not this host, but "
            "trainer process 0 runs the coordinator there; allowed: an address or name of "
            "this host (or give this process the index of the host named there)"
        )
    return mine


def check_host_address(
    address: str, coordinator: object, resolve: Resolve | None = None, flag: str = "--host_address"
) -> str:
    """``address`` (``--host_address``) as one of this host's addresses. A loopback address is
    refused when the coordinator's is not: the group's hosts meet on the coordinator's network,
    and a peer given a loopback address dials its own host."""
    resolve = resolve or addresses
    found = _resolved(address.strip(), flag, 5.0, resolve)
    mine = here(found)
    if mine is None:
        raise ValueError(
            f"{flag}={address!r} ({', '.join(sorted(found))}) is not an address of this host; "
            "allowed: an address of this host's interface that the run's other hosts reach"
        )
    if coordinator and ipaddress.ip_address(mine.split("%")[0]).is_loopback:
        leader, _ = host_port(str(coordinator), "--coordinator_address")
        far = _resolved(leader, "--coordinator_address", 5.0, resolve)
        if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in far):
            raise ValueError(
                f"{flag}={address!r} is a loopback address, but the coordinator "
                f"{coordinator!r} is not: the group's other hosts would dial their own "
                "loopback; allowed: this host's address on the network they share"
            )
    return mine


_CLAIMS: dict[str, socket.socket] = {}  # held for the life of the process


def claim_index(run: str, k: int, named: str) -> None:
    """Hold index ``k`` of the run whose trainer 0 is at ``run`` on this host; ``named``: where
    ``k`` came from. An abstract Unix socket: one namespace per network namespace (a host, a
    pod), released by the kernel when the process exits, however it exits; Linux only."""
    name = f"jaxrl-orch {run} process {k}"
    if name in _CLAIMS or not sys.platform.startswith("linux"):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError:
        sock.close()
        raise ValueError(
            f"{named}={k}: process {k} of the run at {run} already runs on this host "
            f"({_holder(name)}); allowed: an index no other process of the run holds"
        ) from None
    sock.listen(8)  # never accepted: a second claimant connects only to learn the pid
    _CLAIMS[name] = sock


def _holder(name: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect("\0" + name)
            creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError:
            return "its pid unknown"
    return f"pid {struct.unpack('3i', creds)[0]}"
