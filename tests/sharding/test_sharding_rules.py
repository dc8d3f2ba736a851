"""Logical-axis rules: table resolution, replication fallback, unknown names, error messages."""

import math

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.mesh import make_meshes
from sharding.rules import DECODE_RULES, TRAINER_RULES, logical_to_mesh_spec, resolve_shardings

# The model's parameter / cache / activation annotations (interfaces agreement).
MODEL_SPECS = {
    "embedding": ("vocab", "embed"),
    "q": ("embed", "heads", "head_dim"),
    "k": ("embed", "kv_heads", "head_dim"),
    "o": ("heads", "head_dim", "embed"),
    "gate": ("embed", "mlp"),
    "down": ("mlp", "embed"),
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
    "cache": ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim"),
    "act": ("batch", "length", "embed"),
    "logits": ("batch", "length", "vocab"),
}


_MESHES = make_meshes({"tp": 4}, {"fsdp": 2, "tp": 2})


@pytest.fixture(scope="module")
def meshes():
    return _MESHES


def test_trainer_rules_fsdp_plus_tp():
    spec = {k: logical_to_mesh_spec(v, TRAINER_RULES) for k, v in MODEL_SPECS.items()}
    assert spec["embedding"] == P("tp", "fsdp")
    assert spec["q"] == P("fsdp", "tp", None)
    assert spec["k"] == P("fsdp", "tp", None)
    assert spec["o"] == P("tp", None, "fsdp")
    assert spec["gate"] == P("fsdp", "tp")
    assert spec["down"] == P("tp", "fsdp")
    assert spec["norm"] == P(None)
    assert spec["lm_head"] == P("fsdp", "tp")
    assert spec["cache"] == P(None, "fsdp", None, "tp", None)
    # fsdp goes to the batch, so the width dim of the same array is not also split over it.
    assert spec["act"] == P("fsdp", None, None)
    assert spec["logits"] == P("fsdp", None, "tp")


def test_decode_rules_are_tp_only():
    spec = {k: logical_to_mesh_spec(v, DECODE_RULES) for k, v in MODEL_SPECS.items()}
    assert spec["embedding"] == P("tp", None)
    assert spec["q"] == P(None, "tp", None)
    assert spec["down"] == P("tp", None)
    assert spec["cache"] == P(None, None, None, "tp", None)
    assert spec["act"] == P(None, None, None)
    for s in spec.values():
        assert "fsdp" not in jax.tree.leaves(tuple(s))


def test_one_mesh_axis_never_maps_to_two_dims():
    rules = (("a", "tp"), ("b", "tp"), ("c", ("fsdp", "tp")), ("d", "fsdp"))
    assert logical_to_mesh_spec(("a", "b"), rules) == P("tp", None)
    assert logical_to_mesh_spec(("b", "a"), rules) == P(None, "tp")  # rule order decides
    assert logical_to_mesh_spec(("a", "c", "d"), rules) == P("tp", None, "fsdp")
    assert logical_to_mesh_spec(("c", "d"), rules) == P(("fsdp", "tp"), None)
    assert logical_to_mesh_spec(("a", "a"), rules) == P("tp", None)


def test_fallback_rules_and_explicit_replication():
    rules = (("x", "tp"), ("x", "fsdp"), ("y", None), ("y", "tp"))
    assert logical_to_mesh_spec(("x", "x"), rules) == P("tp", "fsdp")
    # An explicit None rule settles the dim; a later rule for the same name cannot shard it.
    assert logical_to_mesh_spec(("y",), rules) == P(None)


def test_unknown_names_and_none_are_replicated(meshes):
    _, trainer = meshes
    assert logical_to_mesh_spec(("nope", None, "embed"), TRAINER_RULES) == P(None, None, "fsdp")
    out = resolve_shardings({"w": ("mystery", "other")}, trainer, TRAINER_RULES)
    assert out["w"].spec == P(None, None)


def test_resolve_with_shapes_falls_back_when_not_divisible(meshes):
    decode, trainer = meshes
    specs = {"emb": ("vocab", "embed"), "act": ("batch", "length", "embed"), "q": MODEL_SPECS["q"]}
    shapes = {
        "emb": (258, 128),  # 258 % 2 == 0 but 258 % 4 != 0
        "act": jax.ShapeDtypeStruct((1, 16, 128), np.float32),  # batch 1 cannot split over fsdp
        "q": np.zeros((128, 6, 8), np.float32),  # 6 heads: ok for tp=2, not tp=4
    }
    tr = resolve_shardings(specs, trainer, TRAINER_RULES, shapes=shapes)
    assert tr["emb"].spec == P("tp", "fsdp")
    # batch fell back, so fsdp stays free and the width dim takes it.
    assert tr["act"].spec == P(None, None, "fsdp")
    assert tr["q"].spec == P("fsdp", "tp", None)
    de = resolve_shardings(specs, decode, DECODE_RULES, shapes=shapes)
    assert de["emb"].spec == P(None, None)
    # 6 heads do not split over tp=4: the head dim (8) takes tp instead of replicating q.
    assert de["q"].spec == P(None, None, "tp")
    for s in jax.tree.leaves(de):
        assert isinstance(s, NamedSharding) and s.mesh is decode


def test_resolve_nnx_state_treats_tuples_as_leaves(meshes):
    _, trainer = meshes

    class Tiny(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.zeros((8, 4), np.float32))
            self.b = nnx.Param(np.zeros((4,), np.float32))

    _, state = nnx.split(Tiny())
    logical = jax.tree.map(lambda x: ("embed", "mlp") if x.ndim == 2 else ("norm",), state)
    out = resolve_shardings(logical, trainer, TRAINER_RULES, shapes=state)
    assert isinstance(out, nnx.State)
    assert out["w"].get_value().spec == P("fsdp", "tp")
    assert out["b"].get_value().spec == P(None)
    placed = jax.device_put(state, out)
    assert placed["w"][...].sharding == out["w"].get_value()


def test_bad_inputs_raise_clear_errors(meshes):
    decode, trainer = meshes
    with pytest.raises(TypeError, match=r"tuple of str \| None.*\['embed'\]"):
        logical_to_mesh_spec(["embed"], TRAINER_RULES)
    with pytest.raises(TypeError, match=r"tuple of str.*\('embed', 3\)"):
        resolve_shardings({"w": ("embed", 3)}, trainer, TRAINER_RULES)
    with pytest.raises(
        ValueError, match=r"names mesh axes \['fsdp'\] but the mesh has axes \('tp',\)"
    ):
        resolve_shardings({"w": ("embed",)}, decode, TRAINER_RULES)
    with pytest.raises(ValueError, match="bad sharding rule"):
        logical_to_mesh_spec(("embed",), [("embed", 3)])
    with pytest.raises(ValueError, match="have 2 entries but the array shape"):
        resolve_shardings({"w": ("embed", "mlp")}, trainer, TRAINER_RULES, shapes={"w": (4,)})
    with pytest.raises(ValueError, match="does not match the logical specs tree"):
        resolve_shardings({"w": ("embed",)}, trainer, TRAINER_RULES, shapes={"v": (4,)})
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        resolve_shardings({"w": ("embed",)}, "mesh", TRAINER_RULES)


_NAMES = ["batch", "embed", "vocab", "heads", "mlp", "head_dim", "unknown", None]


@settings(max_examples=200, deadline=None)
@given(
    dims=st.lists(
        st.tuples(st.sampled_from(_NAMES), st.integers(min_value=1, max_value=12)),
        max_size=5,
    ),
    trainer=st.booleans(),
)
def test_resolved_specs_are_always_valid(dims, trainer):
    """Any logical tuple + shape: no mesh axis twice, every sharded dim divisible."""
    decode, train_mesh = _MESHES
    mesh, rules = (train_mesh, TRAINER_RULES) if trainer else (decode, DECODE_RULES)
    logical = tuple(name for name, _ in dims)
    shape = tuple(size for _, size in dims)
    spec = logical_to_mesh_spec(logical, rules, mesh=mesh, shape=shape)
    assert len(spec) == len(shape)
    used = []
    for entry, size, name in zip(spec, shape, logical, strict=True):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        used.extend(axes)
        assert size % math.prod(mesh.shape[a] for a in axes) == 0
        if axes:
            assert any(rule_name == name for rule_name, _ in rules)
    assert len(used) == len(set(used))
    # The resolved sharding is accepted by jax for an array of that shape.
    NamedSharding(mesh, spec).shard_shape(shape)
