"""Hosts of their own on this machine (``support.netns``), and the trainer group's one listener
no flag names on them: its CPU collectives (``distributed.collectives``).

A host's loopback is its own: a process that dials 127.0.0.1 reaches its own host, never the one
it meant. jax's gloo collectives listen where the hostname resolves, so on a host whose
/etc/hosts puts it on 127.0.1.1 (Debian's convention) every peer would dial its own loopback;
the group's processes listen on the host's address on the route to the coordinator instead.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support import netns
from support.checkout import helper_cmd, subprocess_env

pytestmark = pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))

LISTEN = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 8000))
s.listen()
print("up", flush=True)
s.accept()
"""
DIAL = """
import socket, sys
for host in sys.argv[1:]:
    try:
        socket.create_connection((host, 8000), timeout=5).close()
        print(host, "reached")
    except OSError as exc:
        print(host, type(exc).__name__)
"""


def test_hosts_have_their_own_addresses_names_and_loopback_and_leave_nothing_behind():
    hosts = netns.Hosts({"a": ["a-0.run"], "b": ["b-0.run"]})
    made = [hosts.switch, *hosts.ns.values()]
    try:
        server = hosts.popen(
            "a",
            [sys.executable, "-c", LISTEN, hosts.address["a"]],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline() == "up\n"
        dial = [sys.executable, "-c", DIAL, "127.0.0.1", "a-0.run"]
        out = subprocess.run(
            ["ip", "netns", "exec", hosts.ns["b"], *dial],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        # b's loopback is b's own: a's listener is reached only at a's address, by its name.
        assert out.splitlines() == ["127.0.0.1 ConnectionRefusedError", "a-0.run reached"], out
        hostname = subprocess.run(
            ["ip", "netns", "exec", hosts.ns["b"], "getent", "hosts", "b-0", "a-0"],
            capture_output=True,
            text=True,
        ).stdout
        assert hostname.split() == [hosts.address["b"], "b-0"], hostname  # a pod's own name only
    finally:
        hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in made), listed
    assert not any((netns.NETNS_ETC / ns).exists() for ns in made)


def test_a_groups_collectives_listen_on_the_hosts_address_where_its_hostname_is_loopback():
    """Each host's own hostname on 127.0.1.1: jax's own choice fails the group with
    ``timed out connecting ... remote=[127.0.1.1]``."""
    hosts = netns.Hosts({"t0": ["t0.run"], "t1": ["t1.run"]}, hostname_at="127.0.1.1")
    try:
        coordinator = "t0.run:8476"
        procs = {
            host: hosts.popen(
                host,
                helper_cmd("group_netns_worker", str(k), coordinator),
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for k, host in enumerate(("t0", "t1"))
        }
        seen: dict[str, netns.Table] = {host: set() for host in procs}
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            for host, proc in procs.items():
                seen[host] |= hosts.sockets(host, proc)
            time.sleep(0.2)
    finally:
        hosts.close()  # kills what still runs
    outs = {host: p.communicate()[0] for host, p in procs.items()}
    for k, (host, out) in enumerate(outs.items()):
        assert procs[host].returncode == 0, out[-3000:]
        assert "gathered [1, 2]" in out, out[-3000:]
        assert (
            f"[process {k}] the trainer group's collectives listen on {hosts.address[host]} "
            f"(the route to {coordinator})"
        ) in out
    assert netns.misplaced(seen, hosts.address) == {"t0": [], "t1": []}
    # t1 dialled t0's collectives at t0's address (t0 listens for both the coordinator and them).
    gloo = {r[1:3] for r in seen["t0"] if r[0] == "LISTEN" and r[2] != 8476}
    assert gloo and all(a == hosts.address["t0"] for a, _ in gloo)
    assert any(r[3:5] in gloo for r in seen["t1"]), seen["t1"]
