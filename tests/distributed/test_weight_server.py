"""The default weight transport in one process: ``offer_server.HttpWeightOffer`` (the trainer's
sender) and ``offer_pull.pull`` (a replica's receiver) over loopback, on the 8 fake CPU devices.

What a pull must land (every leaf bit for bit in its target sharding, a replicated shard sent
once), what the sender must survive (random bytes, the frame that aborts a JAX transfer server,
a wrong or missing key, truncated or over-long requests, a declared body, connections that send
nothing or trickle), what a receiver must refuse before reading a byte (a leaf of another dtype,
shape or layout), and what nobody may keep (an offer past its pull or expiry, a thread or the
memory of a pull abandoned at its deadline). Nothing here asserts a time.
"""

from __future__ import annotations

import gc
import socket
import struct
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_orch.distributed import offer_server
from jaxrl_orch.distributed.launch_local import free_ports
from jaxrl_orch.distributed.offer_pull import PullRefused, pull
from jaxrl_orch.distributed.offer_server import HttpWeightOffer, open_offer
from jaxrl_orch.distributed.source import TransferSource

pytestmark = pytest.mark.timeout(60)

KEY = "s3cret-key"
IDLE_S = 0.5  # the test sender's idle bound, so held connections close within the test


def _mesh(devices):
    return Mesh(np.array(devices).reshape(2, 2), ("fsdp", "tp"))


def _tree(mesh, seed: int = 0) -> dict:
    """Leaves of every kind a version holds: split both ways, split one way, replicated, bf16,
    int32, a scalar."""
    rng = np.random.default_rng(seed)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
    return {
        "w": put(rng.standard_normal((8, 6), np.float32), "fsdp", "tp"),
        "rows": put(rng.standard_normal((4, 4), np.float32), "tp", None),
        "norm": put(rng.standard_normal(6, np.float32), None),
        "half": put(jnp.asarray(rng.standard_normal((2, 4)), jnp.bfloat16), None, "tp"),
        "ids": put(np.arange(8, dtype=np.int32), "fsdp"),
        "scale": put(np.float32(0.5)),
    }


def _targets(tree, mesh) -> dict:
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)
        ),
        tree,
    )


def _assert_same(out, tree, targets) -> None:
    for k, x in tree.items():
        assert out[k].dtype == x.dtype and out[k].sharding == targets[k].sharding, k
        assert np.asarray(out[k]).tobytes() == np.asarray(x).tobytes(), k  # bit for bit


@pytest.fixture
def sender():
    offer = HttpWeightOffer(api_key=KEY, idle_s=IDLE_S)
    yield offer
    offer.close()


@pytest.fixture(scope="module")
def meshes():
    devices = jax.devices()
    return _mesh(devices[:4]), _mesh(devices[4:8])


def _answer(sender, data: bytes, *, shut: bool = False) -> bytes:
    """What the sender answers a connection that sends ``data`` (b"": the connection closed
    without an answer); a connection it neither answers nor closes fails the test."""
    with socket.create_connection((sender.host, sender.port)) as conn:
        conn.settimeout(10 * IDLE_S + 5)
        if data:
            conn.sendall(data)
        if shut:
            conn.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
        return got


def _get(uuid, headers: str = "") -> bytes:
    return f"GET /offers/{uuid} HTTP/1.1\r\nHost: w\r\n{headers}\r\n".encode()


def test_a_pull_lands_every_leaf_bit_for_bit_and_sends_a_replicated_shard_once(sender, meshes):
    mine, theirs = meshes
    tree = _tree(mine)
    targets = _targets(tree, theirs)
    uuid = sender.offer(tree, expire_s=30)
    head = _answer(sender, _get(uuid, f"Authorization: Bearer {KEY}\r\n"))
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    distinct = sum(
        len({str(s.index) for s in x.addressable_shards}) * x.addressable_shards[0].data.nbytes
        for x in tree.values()
    )
    every = sum(s.data.nbytes for x in tree.values() for s in x.addressable_shards)
    header = int.from_bytes(head.split(b"\r\n\r\n", 1)[1][:8], "big")
    assert length == 8 + header + distinct and distinct < every  # replicated leaves sent once

    out = pull(sender.address, sender.offer(tree), targets, 30.0, api_key=KEY)
    _assert_same(out, tree, targets)
    assert sender.outstanding == 0  # both offers taken


def test_hostile_connections_get_an_error_or_a_close_and_the_next_pull_is_exact(sender, meshes):
    mine, theirs = meshes
    tree = _tree(mine, seed=1)
    targets = _targets(tree, theirs)
    uuid = sender.offer(tree, expire_s=60)
    held = socket.create_connection((sender.host, sender.port))  # sends nothing, stays open
    rng = np.random.default_rng(7)
    keyed = f"Authorization: Bearer {KEY}\r\n"
    hostile = {
        "random bytes": (rng.bytes(4096), True),
        "a frame of size 2**32 then zeros": (struct.pack("<Q", 2**32) + bytes(64), False),
        "a wrong key": (_get(uuid, "Authorization: Bearer guess\r\n"), False),
        "no key": (_get(uuid), False),
        "truncated HTTP": (b"GET /offers/1 HTT", False),
        "a huge declared body": (_get(uuid, keyed + "Content-Length: 4294967296\r\n"), False),
        "an over-long line": (b"GET /offers/" + b"1" * 10_000 + b" HTTP/1.1\r\n\r\n", False),
        "a uuid that is not one": (_get("x" * 30, keyed), False),
    }
    answers = {name: _answer(sender, data, shut=shut) for name, (data, shut) in hostile.items()}
    for name, answer in answers.items():
        assert answer == b"" or answer.startswith((b"HTTP/1.0 4", b"HTTP/1.1 4")), (name, answer)
    for name in ("a wrong key", "no key"):
        assert answers[name].startswith(b"HTTP/1.1 401"), answers[name]
    assert b"400" in answers["a frame of size 2**32 then zeros"].split(b"\r\n")[0]
    assert answers["a huge declared body"].startswith(b"HTTP/1.1 400")
    assert sender.outstanding == 1  # no refused request took the offer

    # A trickle: one byte at a time, never a whole request. Cut off, with the held one.
    with socket.create_connection((sender.host, sender.port)) as slow, pytest.raises(OSError):
        for byte in _get(uuid, keyed) * 100:
            slow.send(bytes([byte]))
            time.sleep(IDLE_S / 5)
    held.settimeout(10 * IDLE_S + 5)
    assert held.recv(1) == b""  # closed by the server, not by this test
    held.close()

    out = pull(sender.address, uuid, targets, 30.0, api_key=KEY)
    _assert_same(out, tree, targets)


def test_int32_leaves_of_the_right_shapes_are_refused_naming_the_leaf_before_any_byte(
    sender, meshes, monkeypatch
):
    mine, theirs = meshes
    tree = _tree(mine, seed=2)
    targets = _targets(tree, theirs)
    # The sender writes its header, then nothing: a receiver that read any shard before it
    # checked the header would time out instead of refusing.

    async def header_only(response, offer):
        await response.write(offer.head)
        await offer_server.asyncio.sleep(30)

    monkeypatch.setattr(sender, "_stream", header_only)
    wrong = dict(tree, w=tree["w"].astype(jnp.int32))  # the right shape, another dtype
    with pytest.raises(ValueError, match=r"leaf 5 \['w'\] came with dtype int32 where float32"):
        pull(sender.address, sender.offer(wrong), targets, 20.0, api_key=KEY)
    moved = dict(tree, rows=jax.device_put(tree["rows"], NamedSharding(mine, P(None, "tp"))))
    with pytest.raises(ValueError, match=r"leaf 3 \['rows'\] came with shards \[\[\(0, 4\)"):
        pull(sender.address, sender.offer(moved), targets, 20.0, api_key=KEY)
    fewer = {k: v for k, v in tree.items() if k != "scale"}
    with pytest.raises(ValueError, match=r"holds 5 arrays; this receiver expects 6"):
        pull(sender.address, sender.offer(fewer), targets, 20.0, api_key=KEY)


def test_offers_are_pulled_once_expire_and_release_their_arrays(sender, meshes):
    mine, theirs = meshes
    tree = _tree(mine, seed=3)
    targets = _targets(tree, theirs)
    once = sender.offer(tree)
    pull(sender.address, once, targets, 30.0, api_key=KEY)
    with pytest.raises(PullRefused, match=rf"uuid {once} .*HTTP 404: no offer uuid={once}"):
        pull(sender.address, once, targets, 30.0, api_key=KEY)

    fresh = _tree(mine, seed=4)
    expiring = sender.offer(fresh, expire_s=0.2)
    del fresh
    # Weak references to the shards the offer holds: other tests' arrays coming and going (a
    # whole suite in one process) cannot move what these see, as a count of live arrays would.
    held = [weakref.ref(x) for x in sender._offers[expiring].shards]
    gc.collect()
    assert held and all(r() is not None for r in held)  # the offer holds its shards
    while sender.outstanding:  # the sweep drops it without any request
        time.sleep(0.05)
    gc.collect()
    assert all(r() is None for r in held)  # and nothing of it is held any more
    with pytest.raises(PullRefused, match="HTTP 404.*never offered, already pulled, or expired"):
        pull(sender.address, expiring, targets, 30.0, api_key=KEY)


def test_a_pull_past_its_deadline_closes_its_connection_and_leaves_no_thread(
    sender, meshes, monkeypatch
):
    mine, theirs = meshes
    tree = _tree(mine, seed=5)
    targets = _targets(tree, theirs)

    async def stalled(response, offer):
        await response.write(offer.head[:4])  # a few bytes, then silence
        await offer_server.asyncio.sleep(30)

    monkeypatch.setattr(sender, "_stream", stalled)
    threads = threading.active_count()
    for _ in range(3):
        uuid = sender.offer(tree)
        with pytest.raises(TimeoutError, match=rf"uuid {uuid} from {sender.address} .*0.2 s"):
            pull(sender.address, uuid, targets, 0.2, api_key=KEY)
    assert threading.active_count() <= threads
    monkeypatch.undo()
    out = pull(sender.address, sender.offer(tree), targets, 30.0, api_key=KEY)
    _assert_same(out, tree, targets)


def test_the_sender_binds_loopback_without_a_key_and_refuses_any_other_address():
    with pytest.raises(ValueError, match=r"refusing to bind '0.0.0.0' without an API key"):
        HttpWeightOffer("0.0.0.0")
    with pytest.raises(ValueError, match=r"weight transport must be one of \('http', 'jax'\)"):
        open_offer("grpc", "127.0.0.1:1", None)
    with pytest.raises(ValueError, match=r"weight transport must be one of \('http', 'jax'\)"):
        TransferSource(object(), "127.0.0.1:1", transport="tcp")


def test_the_jax_transport_is_opt_in_and_says_so_once(monkeypatch, capsys):
    made = []
    monkeypatch.setattr(offer_server, "JaxWeightOffer", lambda *a: made.append(a) or "jax")
    port = free_ports(1)[0]
    offer = open_offer("http", f"127.0.0.1:{port}", KEY)
    try:
        assert isinstance(offer, HttpWeightOffer) and offer.address == f"127.0.0.1:{port}"
    finally:
        offer.close()
    assert capsys.readouterr().out == "" and not made
    assert open_offer("jax", f"127.0.0.1:{port}", KEY) == "jax" and made == [("127.0.0.1", port)]
    (line,) = capsys.readouterr().out.splitlines()
    assert "'jax'" in line and "no authentication" in line and "aborts this process" in line
    assert f"127.0.0.1:{port}" in line and "network no one else can reach" in line
