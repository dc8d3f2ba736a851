"""The addresses a multi-process run is given on the command line, checked before any work.

What it owns: ``add_launch_flags`` (the train command's flags that place a process in a
multi-process run), ``Replicas`` (the three below together, as the run's parts carry them),
``replica_urls`` (``--engine_addresses``: one ``http://HOST:PORT`` per engine replica, in replica
order; a replica binds the host and port of its own URL, the pool sends requests to it),
``host_port`` (``--weight_source``: the ``HOST:PORT`` where the trainer leader's weight server
listens and every replica pulls from), ``bind_of`` (a URL's host and port) and ``read_api_key``
(``--api_key_file``: the key replicas require and the pool sends, from a file only its owner
may read or write).

Every refusal names the flag, the bad value and the form wanted. No sockets, no jax: the train
command calls these before it imports anything heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import stat
from pathlib import Path
from urllib.parse import urlsplit


def add_launch_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that place this process in a multi-process run (docs/scale-out.md)."""
    roles = parser.add_argument_group(
        "processes (docs/scale-out.md; python -m jaxrl_orch.distributed.launch_local sets these)",
        "Processes.trainer_processes (P) and engine_replicas (R) name the layout; process K < P "
        "trains (0 also runs the orchestrator), P <= K < P + R serves as replica K - P. The first "
        "four flags, when left out, come from the platform (JAX_*, GKE JobSet, TPU VM, Slurm).",
    )
    roles.add_argument("--process_index", type=int, default=None, help="this process's K")
    roles.add_argument(
        "--coordinator_address",
        default=None,
        help="HOST:PORT of the trainer group's jax.distributed coordinator (trainer process 0)",
    )
    roles.add_argument(
        "--engine_addresses",
        default="",
        help="http://HOST:PORT,... the URL of every engine replica, in replica order (a replica "
        "binds the host and port of its own)",
    )
    roles.add_argument(
        "--weight_source",
        default=None,
        help="HOST:PORT where trainer process 0 offers new weights; replicas pull only from it",
    )
    roles.add_argument(
        "--host_address",
        default=None,
        help="this host's address on the network the run's hosts share: a trainer's listener "
        "that no other flag names binds it (the group's CPU collectives, which its peers dial). "
        "Default: the host the platform names for this process (a JobSet pod's own name, TPU "
        "worker K, Slurm node K), resolved; else this host's address on the route to the "
        "coordinator",
    )
    roles.add_argument(
        "--join",
        default=None,
        metavar="URL",
        help="serve as an engine replica that joins a running run: bind http://HOST:PORT (URL), "
        "then ask trainer process 0 at --weight_source to admit it, with --api_key_file's key "
        "(the run's); it serves once it holds the run's current weights. Give the run's gin "
        "files and bindings, no --process_index or --engine_addresses (docs/scale-out.md)",
    )
    roles.add_argument(
        "--api_key_file",
        default=None,
        help="a file holding the API key replicas require and the orchestrator sends (needed "
        "for replicas beyond loopback)",
    )


@dataclasses.dataclass(frozen=True)
class Replicas:
    """Where a run's engine replicas are: their URLs in replica order, the weight source they
    pull from, the API key they require (None: loopback only). Empty for one process.
    ``join``: this process is a replica joining a running run, serving at that URL."""

    urls: tuple[str, ...] = ()
    weight_source: str | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)
    join: str | None = None


def host_port(text: str, flag: str = "--weight_source") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 host) as ``(host, port)``, port in 1..65535."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or "/" in text or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{flag}={text!r} is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:8470)"
        )
    return host, int(port)


def replica_urls(text: str, flag: str = "--engine_addresses") -> tuple[str, ...]:
    """The comma-separated ``http://HOST:PORT`` URLs of ``text``, normalised (no trailing
    slash); ``""`` gives none."""
    urls = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        bind_of(item, flag)
        urls.append(item.rstrip("/"))
    return tuple(urls)


def bind_of(url: str, flag: str = "--engine_addresses") -> tuple[str, int]:
    """``(host, port)`` of a replica URL ``http://HOST:PORT``."""
    form = "each replica is http://HOST:PORT, e.g. http://127.0.0.1:8000"
    if "://" not in url:
        raise ValueError(f"{flag}: {url!r} has no scheme; {form} (try 'http://{url}')")
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(
            f"{flag}: {url!r} uses {parts.scheme!r}; {form} (replicas serve plain HTTP: keep "
            "them on a private network and give them an --api_key_file)"
        )
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or not 0 < port < 65536:
        raise ValueError(f"{flag}: {url!r} names no host and port in 1..65535; {form}")
    if parts.path.strip("/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{flag}: {url!r} has more than a host and port; {form}")
    return parts.hostname, port


def read_api_key(path: str | None, flag: str = "--api_key_file") -> str | None:
    """The key in file ``path`` (surrounding whitespace dropped), or None without a path. A file
    keeps the key out of the process list and the shell history; one its group or others may
    read or write (mode & 0o077) is refused: they could read the key, or put theirs in."""
    if path is None:
        return None
    try:
        key = Path(path).read_text().strip()
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError as exc:
        raise ValueError(f"{flag}={path!r} cannot be read: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ValueError(
            f"{flag}={path!r} has mode {mode:04o}: its group or others may read or write the "
            f"key; only its owner may: chmod 600 {shlex.quote(path)}"
        )
    if not key:
        raise ValueError(f"{flag}={path!r} is empty; put the API key in it")
    return key
