"""Why ``Processes.weight_transport = 'jax'`` is an opt-in for trusted networks only.

A process serving ``jax.experimental.transfer`` (``transfer.JaxWeightOffer``, as trainer
process 0 does with 'jax'; a replica's receiver-side server is the same server) dies on 72
bytes anyone who reaches its port can send: a little-endian frame size of 2**32, then 64 zero
bytes. Its C++ socket server fails a check (``socket-server.cc``) and aborts the whole process
(SIGABRT). The same bytes sent to the default transport's server (``HttpWeightOffer``) get a
400, and it goes on serving: a keyed request for its offer is answered, and the process exits
only when told to. And the opt-in still works: a replica's source with ``transport='jax'``
pulls an offer into its engine's shardings.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess

import pytest
from support.checkout import helper_cmd, subprocess_env, xla_flags
from support.offer_process import KEY

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

ABORT_BYTES = struct.pack("<Q", 2**32) + bytes(64)


def _start(kind: str) -> tuple[subprocess.Popen, str, int]:
    env = subprocess_env(JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        helper_cmd("offer_process", kind),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().split()
    assert line[:1] == ["READY"], (line, proc.poll(), proc.stderr.read()[-2000:])
    return proc, line[1], int(line[2])


def _send(address: str, data: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(data)
        try:
            return conn.recv(4096)
        except OSError:  # reset by a process that died
            return b""


def test_72_bytes_abort_a_process_serving_jax_transfer_and_not_the_default_one():
    jax_proc, jax_address, _ = _start("jax")
    try:
        _send(jax_address, ABORT_BYTES)
        assert jax_proc.wait(60) == -signal.SIGABRT
        assert "socket-server.cc" in jax_proc.stderr.read()
    finally:
        jax_proc.kill()

    http_proc, http_address, uuid = _start("http")
    try:
        answer = _send(http_address, ABORT_BYTES)
        assert answer.startswith(b"HTTP/1.0 400"), answer
        request = f"GET /offers/{uuid} HTTP/1.1\r\nHost: w\r\nAuthorization: Bearer {KEY}\r\n\r\n"
        assert _send(http_address, request.encode()).startswith(b"HTTP/1.1 200"), http_address
        assert http_proc.poll() is None
        http_proc.stdin.close()
        assert http_proc.wait(60) == 0
    finally:
        http_proc.kill()


def test_the_opt_in_still_moves_weights_into_a_replicas_shardings():
    env = subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
    done = subprocess.run(
        helper_cmd("offer_process", "jax-roundtrip"),
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["SAME"], done.stdout


def test_the_opt_in_refuses_a_host_name_which_would_bind_every_interface():
    from jaxrl_orch.distributed.transfer import JaxWeightOffer

    with pytest.raises(ValueError, match=r"needs an IP address to bind, got 'localhost'"):
        JaxWeightOffer("localhost")
