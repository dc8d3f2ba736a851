"""An engine replica in another process, over gRPC, with weights pulled device to device.

Each test starts its own replica subprocess (``python -m support.replica_main``: tiny-byte on a
tp=2 mesh of its 2 CPU devices, ``max_queued=3``), so none depends on what another loaded, on
the version another reached, or on another having killed it; they pass in any order. This
process builds the same engine on its first 2 devices as the reference (once: it keeps only
compiled programs between drivers), stages params with ``local_layout`` and offers them with
``WeightOffer`` (one server; every offer has its own uuid, pulled at most once).
"""

from __future__ import annotations

import asyncio
import math
import os
import queue
import signal
import subprocess
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from support.checkout import helper_cmd, subprocess_env
from support.replica_main import make_engine

from jaxrl_orch.distributed.client import RemoteEngineClient, ReplicaLost, WeightPullError
from jaxrl_orch.distributed.server import spec_to_json
from jaxrl_orch.distributed.transfer import WeightOffer, local_layout
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.types import SamplingParams
from sharding.reshard import reshard

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

PROMPTS = [list(b"the quick brown"), list(b"jax on two cores")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Compiled programs the replicas share: each fresh one compiles only what none before did."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("replica_programs")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture
def replica(compile_cache):
    """A fresh replica, holding no weights: ``(address, process)``."""
    env = subprocess_env(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", **compile_cache
    )
    proc = subprocess.Popen(
        helper_cmd("replica_main", "--max-queued", "3"), stdout=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    address = None
    while address is None and proc.poll() is None:  # it prints READY once bound, or exits
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith("READY "):
            address = line.split()[1]
    assert address, f"replica did not come up (exit code {proc.poll()})"
    yield address, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def reference():
    engine = make_engine()  # the replica's engine, here on this process's first 2 devices
    return engine, {v: engine.load_params(seed=v) for v in (1, 2)}


@pytest.fixture(scope="module")
def offer():
    return WeightOffer()


def _reference_run(engine, params, version, prompts, sampling):
    driver = InferenceDriver(engine, params, version)
    driver.start()
    try:
        return [driver.submit(p, sampling)[0].result(timeout=60) for p in prompts]
    finally:
        driver.stop()


async def _load(client, offer, engine, params, version, timeout_s=30.0, expire_s=None):
    staged = reshard(params, local_layout(engine.param_shardings))
    uuid = offer.offer(staged, expire_s=expire_s)
    return await client.load_weights(version, offer.address, uuid, timeout_s)


def test_replica_without_weights_reports_it_and_refuses_generate(replica):
    address, proc = replica

    async def main():
        client = RemoteEngineClient(address, replica=1)
        health = await client.health()
        with pytest.raises(RuntimeError, match="FAILED_PRECONDITION.*replica 1 holds no weights"):
            await client.generate(PROMPTS[0], GREEDY)
        assert client.alive and client.in_flight == 0
        await client.close()
        return health

    health = asyncio.run(main())
    assert health == {
        "engine_s": 0.0,
        "replica": 1,
        "ready": False,
        "version": -1,
        "in_flight": 0,
        "queued": 0,
        "slots": 4,
        "pid": proc.pid,
    }


def test_pulled_weights_decode_like_the_in_process_engine_and_stamp_their_version(
    replica, reference, offer
):
    engine, params = reference
    want = {v: _reference_run(engine, params[v], v, PROMPTS, GREEDY) for v in (1, 2)}

    async def main():
        client = RemoteEngineClient(replica[0], replica=1)
        got, loads = {}, {}
        for v in (1, 2):
            loads[v] = await _load(client, offer, engine, params[v], v)
            got[v] = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        health = await client.health()
        await client.close()
        return got, loads, health

    got, loads, health = asyncio.run(main())
    for v in (1, 2):
        assert loads[v]["version"] == v and loads[v]["pull_s"] > 0
        for g, w in zip(got[v], want[v], strict=True):
            assert g.token_ids == w.token_ids
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)
            assert g.versions == [v] * len(g.token_ids) and g.finish_reason == "length"
    # The second load really changed the weights (random tiny models repeat the same greedy
    # byte, so compare log-probs), not just the stamp.
    assert not np.allclose(got[1][0].logprobs, got[2][0].logprobs, atol=1e-3)
    assert health["ready"] and health["version"] == 2


def test_a_sender_with_fewer_devices_names_its_layout_and_the_replica_reshards(
    replica, reference, offer
):
    # A trainer host with fewer devices than the replica's decode mesh (tp=2 here) stages on
    # one device; the replica pulls in that layout, then reshards onto its own two.
    engine, params = reference
    want = _reference_run(engine, params[1], 3, PROMPTS, GREEDY)
    one = Mesh(np.array(jax.local_devices()[:1]), ("tp",))
    shardings = jax.tree.map(lambda s: NamedSharding(one, s.spec), engine.param_shardings)
    staged = reshard(params[1], shardings)
    specs = [spec_to_json(s.spec) for s in jax.tree.leaves(shardings)]
    assert any(any(p is not None for p in sp) for sp in specs)  # some leaves are split on tp

    async def main():
        client = RemoteEngineClient(replica[0], replica=1)
        layout = {"mesh": {"tp": 1}, "specs": specs}
        loaded = await client.load_weights(3, offer.address, offer.offer(staged), 30.0, layout)
        got = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        await client.close()
        return loaded, got

    loaded, got = asyncio.run(main())
    assert loaded["version"] == 3
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.versions == [3] * len(g.token_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)


def test_failed_pulls_name_replica_and_version_swap_nothing_in_and_the_replica_keeps_serving(
    replica, reference, offer
):
    engine, params = reference

    async def main():
        client = RemoteEngineClient(replica[0], replica=1)
        # A uuid never offered: the pull's own timeout ends it.
        with pytest.raises(WeightPullError, match="replica 1: weight pull of version 7") as err:
            await client.load_weights(7, offer.address, 12345, timeout_s=1.5)
        # An offer past its expiry is dropped: the same failure.
        staged = reshard(params[1], local_layout(engine.param_shardings))
        expired = offer.offer(staged, expire_s=0.2)
        await asyncio.sleep(0.5)
        with pytest.raises(WeightPullError, match="version 8 .* timed out after 1.0 s"):
            await client.load_weights(8, offer.address, expired, timeout_s=1.0)
        after_failures = await client.health()
        # Still serving: the next offer loads, and its version decodes.
        loaded = await _load(client, offer, engine, params[1], 9)
        done = await client.generate(PROMPTS[0], GREEDY)
        # Never back to an older version (no pull is even tried).
        with pytest.raises(WeightPullError, match="must not go backwards"):
            await client.load_weights(8, offer.address, expired, timeout_s=1.0)
        final = await client.health()
        await client.close()
        return err.value, after_failures, loaded, done, final

    err, after_failures, loaded, done, final = asyncio.run(main())
    assert (err.replica, err.version) == (1, 7)
    assert "DEADLINE_EXCEEDED" in str(err) and "timed out after 1.5 s" in str(err)
    assert offer.address in str(err)
    assert after_failures["version"] == -1 and not after_failures["ready"]  # nothing swapped in
    assert after_failures["in_flight"] == 0 and after_failures["queued"] == 0
    assert loaded["version"] == 9 and done.versions == [9] * len(done.token_ids)
    assert final["version"] == 9 and final["ready"]


def test_generate_beyond_max_queued_is_refused_naming_the_bound(replica, reference, offer):
    engine, params = reference
    sampling = SamplingParams(temperature=1.0, max_tokens=48)

    async def main():
        client = RemoteEngineClient(replica[0], replica=1)
        await _load(client, offer, engine, params[1], 1)
        out = await asyncio.gather(
            *(client.generate(PROMPTS[i % 2], sampling) for i in range(8)),
            return_exceptions=True,
        )
        health = await client.health()
        await client.close()
        return out, health

    out, health = asyncio.run(main())
    refused = [r for r in out if isinstance(r, BaseException)]
    done = [r for r in out if not isinstance(r, BaseException)]
    assert len(done) >= 3 and refused, out
    for r in refused:
        assert isinstance(r, RuntimeError) and not isinstance(r, ReplicaLost)
        assert "RESOURCE_EXHAUSTED" in str(r) and "max_queued=3" in str(r)
    assert all(len(c.token_ids) == 48 and not math.isnan(c.logprobs[0]) for c in done)
    assert health["in_flight"] == 0 and health["queued"] == 0


def test_kill_9_of_the_replica_raises_replica_lost(replica, reference, offer):
    address, proc = replica
    engine, params = reference

    async def main():
        client = RemoteEngineClient(address, replica=1)
        await _load(client, offer, engine, params[1], 1)
        sampling = SamplingParams(temperature=1.0, max_tokens=48)
        pending = [asyncio.ensure_future(client.generate(PROMPTS[0], sampling)) for _ in range(3)]
        await asyncio.sleep(0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        inflight = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(r, ReplicaLost) for r in inflight), inflight
        with pytest.raises(ReplicaLost) as err:
            await client.generate(PROMPTS[0], GREEDY)
        alive_after_loss = client.alive
        health = await client.health(timeout_s=1.0)
        await client.close()
        return inflight, err.value, alive_after_loss, health

    inflight, err, alive, health = asyncio.run(main())
    assert (err.replica, err.address) == (1, address)
    assert f"replica 1 at {address} is lost" in str(err)
    assert not alive and health is None
    assert all(r.replica == 1 for r in inflight)


def test_local_layout_rebuilds_meshes_over_local_devices_and_refuses_too_few(monkeypatch):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("fsdp", "tp"))
    tree = {
        "a": NamedSharding(mesh, PartitionSpec("tp", None)),
        "b": [NamedSharding(mesh, PartitionSpec())],
    }
    out = local_layout(tree)
    a = out["a"]
    assert a.spec == PartitionSpec("tp", None) and a.mesh.axis_names == ("fsdp", "tp")
    assert a.mesh.devices.shape == (2, 2)
    assert list(a.mesh.devices.flat) == jax.local_devices()[:4]
    assert out["b"][0].mesh is a.mesh and out["b"][0].spec == PartitionSpec()
    monkeypatch.setattr(jax, "local_devices", lambda: jax.devices()[:2])
    with pytest.raises(ValueError, match=r"needs 4 devices but this process has 2 local"):
        local_layout(tree)
