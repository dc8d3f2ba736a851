"""Rules when the heads do not divide the tensor-parallel axis (Qwen2.5-0.5B: 14 heads, 2 kv
heads on tp 4): the KV cache and the projections still shard, nothing large is replicated."""

import math

import pytest
from jax.sharding import PartitionSpec as P

from sharding.mesh import make_meshes
from sharding.rules import DECODE_RULES, TRAINER_RULES, resolve_shardings

CACHE = ("layers", "cache_batch", "kv_heads", "cache_length", "head_dim")
SPECS = {
    "cache": CACHE,
    "q": ("embed", "heads", "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
}


def _shapes(heads, kv, hd, slots=128, length=1024, layers=24, d=896):
    return {
        "cache": (layers, slots, kv, length, hd),
        "q": (d, heads, hd),
        "k": (d, kv, hd),
        "o": (heads, hd, d),
    }


@pytest.fixture(scope="module")
def decode():
    return make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})[0]


def _specs(mesh, rules, shapes):
    return {k: s.spec for k, s in resolve_shardings(SPECS, mesh, rules, shapes=shapes).items()}


def _replication(spec, shape, mesh) -> float:
    """Fraction of the array each device holds (1.0: fully replicated)."""
    split = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            split *= mesh.shape[axis]
    return 1.0 / split


def test_qwen25_05b_on_tp4_shards_cache_slots_and_head_dim(decode):
    shapes = _shapes(heads=14, kv=2, hd=64)
    spec = _specs(decode, DECODE_RULES, shapes)
    # 2 kv heads cannot split 4 ways: the cache splits its 128 slots instead.
    assert spec["cache"] == P(None, "tp", None, None, None)
    # 14 heads cannot either: q / o split the head dim, k splits its head dim too.
    assert spec["q"] == P(None, None, "tp")
    assert spec["k"] == P(None, None, "tp")
    assert spec["o"] == P(None, "tp", None)
    for name, sh in shapes.items():
        assert _replication(spec[name], sh, decode) == 0.25, name


def test_dividing_kv_heads_keep_the_head_layout(decode):
    """Qwen3-0.6B (16 heads, 8 kv heads): heads shard, cache slots stay whole on every chip."""
    spec = _specs(decode, DECODE_RULES, _shapes(heads=16, kv=8, hd=128, d=1024))
    assert spec["cache"] == P(None, None, "tp", None, None)
    assert spec["q"] == P(None, "tp", None)
    assert spec["k"] == P(None, "tp", None)


def test_trainer_mesh_falls_back_to_head_dim():
    trainer = make_meshes({"tp": 1}, {"fsdp": 1, "tp": 4})[1]
    spec = _specs(trainer, TRAINER_RULES, _shapes(heads=14, kv=2, hd=64))
    assert spec["q"] == P("fsdp", None, "tp")  # fsdp has size 1 here; it splits embed
    assert spec["k"] == P("fsdp", None, "tp")


def test_nothing_divides_replicates_rather_than_fails(decode):
    spec = _specs(decode, DECODE_RULES, _shapes(heads=3, kv=1, hd=6, slots=3, d=5))
    assert all(e is None for e in spec["cache"])
    assert math.isclose(_replication(spec["q"], (5, 3, 6), decode), 1.0)
