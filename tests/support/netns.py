"""Hosts of their own on this machine: one Linux network namespace per host, for the tests that
run a multi-host layout (``tests/distributed/test_netns_e2e.py``).

``Hosts`` makes, for each host, a namespace with its own interface (``eth0``, one end of a veth
pair) and address in 198.18.0.0/15 (the benchmarking range, RFC 2544: never a real network),
and a switch namespace holding the bridge every host's other end is attached to. Nothing is
added to this machine's own namespace, so no traffic leaves the namespaces the test made, and
two tests at once each get a switch of their own. Each host's names resolve in every namespace
through ``/etc/netns/NS/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``), as a pod's
names resolve in a JobSet's headless service (``hostname_at`` puts a host's own hostname
elsewhere, as Debian's 127.0.1.1). ``popen`` starts a command on a host, its
hostname (a UTS namespace of its own) its first name's first label, as a pod's is.
``close`` stops what is still running there and removes the namespaces and their files, however
the test ended. Needs root and iproute2's ``ip``; ``unavailable`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NETWORK = ipaddress.ip_network("198.18.0.0/15")
NETNS_ETC = Path("/etc/netns")


# The kernel's TCP states (include/net/tcp_states.h), as /proc/net/tcp writes them.
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "0A": "LISTEN"}


def _endpoint(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp: the address as the kernel's 32-bit words, each in
    host byte order) as ``("127.0.0.1", 8080)``."""
    address, port = text.split(":")
    raw = b"".join(
        int(address[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(address), 8)
    )
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


Table = set[tuple[str, str, int, str, int]]  # (state, local address, port, remote, port)


def misplaced(seen: Mapping[str, Table], address: Mapping[str, str]) -> dict[str, list]:
    """Per host, the sockets of its table (``seen``) not on its own address (``address``): a
    listener elsewhere (every interface, a loopback address), a connection with an end that is
    no host's address (a loopback one included). Empty lists where all is well."""
    run = set(address.values())
    found = {}
    for host, table in seen.items():
        own = address[host]
        found[host] = sorted(
            row for row in table if row[1] != own or (row[0] != "LISTEN" and row[3] not in run)
        )
    return found


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip command"
    if shutil.which("unshare") is None:
        return "a host's own hostname needs util-linux's unshare"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    """Namespaces named for the hosts ``names`` (host -> its names, the first its hostname's)."""

    def __init__(self, names: Mapping[str, Sequence[str]], hostname_at: str | None = None) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"jx{tag}-sw"
        self.names = {host: list(n) for host, n in names.items()}
        self.hostname_at = hostname_at
        self.ns = {host: f"jx{tag}-{i}" for i, host in enumerate(names)}
        hosts = list(NETWORK.hosts())
        self.address = {host: str(hosts[i]) for i, host in enumerate(names)}
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                port,
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address[host]}/{NETWORK.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(self._table(host))

    def _table(self, here: str) -> str:
        """``/etc/hosts`` on host ``here``: every host's names, and its own hostname, at its
        address as in a pod (another pod's bare hostname does not resolve there), or at
        ``hostname_at`` (Debian writes 127.0.1.1)."""
        lines = ["127.0.0.1 localhost"]
        for host, names in self.names.items():
            lines.append(" ".join([self.address[host], *names]))
        hostname = self.names[here][0].split(".")[0]
        lines.append(f"{self.hostname_at or self.address[here]} {hostname}")
        return "\n".join(lines) + "\n"

    def popen(self, host: str, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``cmd`` on ``host``: in its namespace, its hostname its own."""
        hostname = self.names[host][0].split(".")[0]
        wrapped = ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c"]
        wrapped += ['hostname "$0" && exec "$@"', hostname, *cmd]
        proc = subprocess.Popen(wrapped, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def sockets(self, host: str, proc: subprocess.Popen) -> Table:
        """The TCP socket table of ``host``, read through ``proc`` running there (empty once it
        exited): ``(state, local address, port, remote address, port)``. Read from the kernel's
        table of its namespace (``/proc/PID/net/tcp``; psutil reads the caller's). A process
        that has exited shows another namespace's table there, so the read counts only when
        ``proc`` is in ``host``'s namespace before and after it."""
        found = set()
        for name in ("tcp", "tcp6"):
            if not self._inside(host, proc):
                return set()
            try:
                lines = Path(f"/proc/{proc.pid}/net/{name}").read_text().splitlines()[1:]
            except OSError:
                return set()
            for line in lines:
                fields = line.split()
                local, remote = _endpoint(fields[1]), _endpoint(fields[2])
                found.add((TCP_STATES.get(fields[3], fields[3]), *local, *remote))
        return found if self._inside(host, proc) else set()

    def _inside(self, host: str, proc: subprocess.Popen) -> bool:
        try:
            now = os.stat(f"/proc/{proc.pid}/ns/net").st_ino
            return now == os.stat(f"/run/netns/{self.ns[host]}").st_ino
        except OSError:
            return False

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        for ns in reversed(self._made):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()
