"""reshard: placement, bit-equality, source-side casting, donation; the two-process transfer."""

import json
import socket
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from support.checkout import helper_cmd, subprocess_env

from sharding.mesh import make_meshes
from sharding.reshard import reshard, reshard_cross_process
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings

LOGICAL = {
    "embedding": ("vocab", "embed"),
    "layers": [
        {"q": ("embed", "heads", "head_dim"), "down": ("mlp", "embed")},
        {"q": ("embed", "heads", "head_dim"), "down": ("mlp", "embed")},
    ],
    "norm": ("norm",),
    "odd": ("vocab", "embed"),  # 10 rows: tp=4 does not divide, falls back to replication
    "step": (),
}


def _reference():
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)
    layer = lambda: {"q": f(32, 4, 8), "down": f(64, 32)}
    return {
        "embedding": f(64, 32),
        "layers": [layer(), layer()],
        "norm": f(32),
        "odd": f(10, 32),
        "step": np.array(3, np.int32),
    }


@pytest.fixture(scope="module")
def meshes():
    return make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})


@pytest.fixture
def setup(meshes):
    decode, trainer = meshes
    ref = _reference()
    src_sh = resolve_shardings(LOGICAL, trainer, TRAINER_RULES, shapes=ref)
    dst_sh = resolve_shardings(LOGICAL, decode, DECODE_RULES, shapes=ref)
    return ref, jax.device_put(ref, src_sh), dst_sh, decode, trainer


def _check_placed(out, dst_sh, mesh):
    ids = {d.id for d in mesh.devices.flat}
    for y, s in zip(jax.tree.leaves(out), jax.tree.leaves(dst_sh), strict=True):
        assert y.sharding == s
        assert {d.id for d in y.devices()} <= ids


def test_moves_every_leaf_bit_equal(setup):
    ref, src, dst_sh, decode, _ = setup
    out = reshard(src, dst_sh)
    _check_placed(out, dst_sh, decode)
    assert out["odd"].sharding.spec == P(None, None)
    assert out["layers"][1]["q"].sharding.spec == P(None, "tp", None)
    for want, got in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        assert np.asarray(got).dtype == want.dtype
        assert np.asarray(got).tobytes() == want.tobytes()
    # Without donation the source stays usable.
    assert not any(x.is_deleted() for x in jax.tree.leaves(src))


def test_dtype_casts_on_source_before_transfer(setup, monkeypatch):
    ref, src, dst_sh, decode, trainer = setup
    moved = []
    real_put = jax.device_put

    def spy(x, *args, **kwargs):
        moved.extend(jax.tree.leaves(x))
        return real_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    out = reshard(src, dst_sh, dtype=jnp.bfloat16)
    monkeypatch.undo()
    _check_placed(out, dst_sh, decode)
    trainer_ids = {d.id for d in trainer.devices.flat}
    floats = [x for x in moved if x.dtype != np.int32]
    assert len(floats) == 7 and all(x.dtype == jnp.bfloat16 for x in floats)
    assert all({d.id for d in x.devices()} <= trainer_ids for x in moved)
    for want, got in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        expect = want if want.dtype == np.int32 else want.astype(jnp.bfloat16)
        assert np.asarray(got).dtype == expect.dtype
        assert np.asarray(got).tobytes() == expect.tobytes()


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_donate_frees_sources(setup, dtype):
    ref, src, dst_sh, _, _ = setup
    out = reshard(src, dst_sh, donate=True, dtype=dtype)
    assert all(x.is_deleted() for x in jax.tree.leaves(src))
    np.testing.assert_array_equal(
        np.asarray(out["embedding"], np.float32), ref["embedding"].astype(dtype or np.float32)
    )


def test_donate_on_colocated_meshes_keeps_aliased_outputs_alive():
    decode, trainer = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2}, colocated=True)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    # Same devices and the same per-device layout: jax hands back the source's own buffers for
    # "a" and "c", so donating must not delete them; "b" needs a real relayout and is freed.
    src_specs = {"a": P(), "b": P("fsdp", "tp"), "c": P(None, ("fsdp", "tp"))}
    dst_specs = {"a": P(), "b": P(None, "tp"), "c": P(None, "tp")}
    src = {k: jax.device_put(x, NamedSharding(trainer, s)) for k, s in src_specs.items()}
    dst = {k: NamedSharding(decode, s) for k, s in dst_specs.items()}
    out = reshard(src, dst, donate=True)
    assert src["b"].is_deleted()
    for k in "abc":
        assert out[k].sharding == dst[k]
        np.testing.assert_array_equal(np.asarray(out[k]), x)


def test_single_sharding_and_nnx_state(meshes):
    decode, trainer = meshes

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(32, dtype=jnp.float32).reshape(8, 4))

    _, state = nnx.split(Tiny())
    # Both shapes of logical tree a model may hand over: tuples inside the Variables, or tuples
    # in place of the Variables (then the shardings are a prefix of the state's structure).
    inside = jax.tree.map(lambda _: ("embed", "mlp"), state)
    in_place = jax.tree.map(
        lambda _: ("embed", "mlp"), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    for logical in (inside, in_place):
        dst = resolve_shardings(logical, decode, DECODE_RULES, shapes=state)
        out = reshard(state, dst)
        assert isinstance(out, nnx.State)
        assert out["w"][...].sharding.spec == P(None, "tp")
    rep = NamedSharding(decode, P())
    out2 = reshard(state, rep)
    assert out2["w"][...].sharding == rep
    np.testing.assert_array_equal(np.asarray(out2["w"][...]), np.arange(32).reshape(8, 4))


def test_bad_inputs(setup):
    _, src, dst_sh, _, _ = setup
    with pytest.raises(ValueError, match="floating-point dtype.*int32"):
        reshard(src, dst_sh, dtype=jnp.int32)
    with pytest.raises(ValueError, match="prefix of the"):
        reshard(src, {"embedding": dst_sh["embedding"]})
    with pytest.raises(TypeError, match="must be jax Shardings"):
        reshard({"a": src["norm"]}, {"a": P()})
    with pytest.raises(RuntimeError, match=r"jax.process_count\(\) is 1"):
        reshard_cross_process(src, dst_sh)


def _free_ports(n):
    # Hold all sockets open together so the OS cannot hand out the same port twice.
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.multiprocess
def test_two_process_transfer(tmp_path):
    env = subprocess_env()
    coord, *sock_ports = _free_ports(3)
    logs = [tmp_path / f"{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "w") as log:
            ports = (str(coord), str(sock_ports[i]))
            cmd = helper_cmd("xproc_worker", str(i), *ports, str(tmp_path / f"{i}.json"))
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 120
        # If one side dies the other blocks in the transfer or the shutdown barrier: stop early.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for i, p in enumerate(procs):
        tail = logs[i].read_text()[-3000:]
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{tail}"
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    # Receiver checked placement + bit-equality (fp32) and bf16 casting for every leaf.
    assert len(results[1]["checks"]) == 10
    assert results[0]["checks"] == results[1]["checks"]
