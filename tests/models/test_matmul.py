"""models/matmul.py: the low-precision matmul's backward runs on low-precision operands (the
point of its custom VJP), equals the plain einsum's gradients within bf16 rounding, and the
CPU operand copy changes no number; in float32 the written-out backward is autodiff's maths."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_orch.compose.precision import accel_model_config, engine_model_config
from jaxrl_orch.config.load import make_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.attention import einsum_attention
from jaxrl_orch.models.configs import get_config
from jaxrl_orch.models.matmul import dot32, matmul

# The model's specs and shapes (transformer.py): q/k/v, o, gate/up, down projections.
CASES = {
    "bte,ehd->bthd": ((2, 24, 16), (16, 4, 8)),
    "bthd,hde->bte": ((2, 24, 4, 8), (4, 8, 16)),
    "bte,ef->btf": ((2, 24, 16), (16, 40)),
    "btf,fe->bte": ((2, 24, 40), (40, 16)),
}


def _operands(spec):
    xs, ws = CASES[spec]
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=xs), jnp.float32), jnp.asarray(rng.normal(size=ws))


def _grads(fn, x, w):
    # A non-linear loss: the cotangent differs per output element.
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w).astype(jnp.float32))), (0, 1))(x, w)


def _dots(fn, *args):
    """(operand dtypes) of every dot_general the gradient's jaxpr runs, custom VJPs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(v.aval.dtype.name for v in eqn.invars))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), (0, 1)))(*args))
    return found


@pytest.mark.parametrize("spec", sorted(CASES))
@pytest.mark.parametrize("transpose_copy", [False, True])
def test_bf16_backward_runs_bf16_dots_and_matches_the_einsum(spec, transpose_copy):
    x, w = _operands(spec)
    ours = lambda x, w: matmul(spec, x, w, jnp.bfloat16, transpose_copy)
    # Every dot forward and backward takes bf16 x bf16 (plain autodiff would feed the backward
    # dots the float32 cotangent, promoting them to float32 x float32).
    dots = _dots(ours, x, w)
    assert len(dots) == 3 and set(dots) == {("bfloat16", "bfloat16")}, dots
    # The reference: the same bf16 operands through float32 maths.
    ref = lambda x, w: jnp.einsum(
        spec, x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32)
    )
    np.testing.assert_allclose(ours(x, w).astype(jnp.float32), ref(x, w), rtol=2e-2, atol=5e-2)
    for got, want in zip(_grads(ours, x, w), _grads(ref, x, w), strict=True):
        assert got.dtype == jnp.float32  # float32 master operands get float32 gradients
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, atol=2e-2 * scale)


@pytest.mark.parametrize("spec", sorted(CASES))
def test_the_cpu_operand_copy_changes_no_number(spec):
    x, w = _operands(spec)
    plain = _grads(lambda x, w: matmul(spec, x, w, jnp.bfloat16, False), x, w)
    copied = _grads(lambda x, w: matmul(spec, x, w, jnp.bfloat16, True), x, w)
    for a, b in zip(plain, copied, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # ... and the copy is really there: a barrier XLA cannot fold into the weight-gradient dot.
    jaxpr = str(
        jax.make_jaxpr(
            lambda x, w: _grads(lambda x, w: matmul(spec, x, w, jnp.bfloat16, True), x, w)
        )(x, w)
    )
    assert "optimization_barrier" in jaxpr


@pytest.mark.parametrize("spec", sorted(CASES))
def test_float32_backward_is_written_out_and_equals_autodiff(spec):
    x, w = _operands(spec)
    w = w.astype(jnp.float32)
    ours = lambda x, w: matmul(spec, x, w, jnp.float32)
    plain = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(ours(x, w), plain(x, w))  # the forward is the einsum itself
    for got, want in zip(_grads(ours, x, w), _grads(plain, x, w), strict=True):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The weight gradient is one dot straight into w's axes: JAX's own transpose computes it as
    # [w's axes reversed] then transposes, which XLA:CPU fused with the SiLU backward into a
    # slow transposing loop. Float32 operands only, no cast.
    grads_jaxpr = lambda f: str(jax.make_jaxpr(lambda x, w: _grads(f, x, w))(x, w))
    assert "custom_vjp" in str(jax.make_jaxpr(ours)(x, w))
    assert "transpose[" not in grads_jaxpr(ours)
    assert "transpose[" in grads_jaxpr(plain)  # what the plain einsum's autodiff does
    assert set(_dots(ours, x, w)) == {("float32", "float32")}
    assert "convert_element_type" not in grads_jaxpr(ours)


def test_bf16_attention_backward_runs_bf16_dots():
    """The score and value einsums (dot32) keep a bf16 attention's backward in bf16 too."""
    rng = np.random.default_rng(1)
    q, k, v = (
        jnp.asarray(rng.normal(size=s), jnp.bfloat16)
        for s in [(2, 12, 4, 8), (2, 12, 2, 8), (2, 12, 2, 8)]
    )
    idx = jnp.broadcast_to(jnp.arange(12)[None], (2, 12))
    dots = _dots(lambda q, k: einsum_attention(q, k, v, idx), q, k)
    assert dots and set(dots) == {("bfloat16", "bfloat16")}, dots
    assert dot32("bd,de->be", q[0, :, 0], k[0, :, 0].T).dtype == jnp.float32


def test_accel_sets_the_copy_for_low_precision_on_cpu_only():
    base = get_config("tiny-byte")
    bf16 = make_config({"Model.compute_dtype": "bfloat16"})
    assert accel_model_config(base, bf16, "cpu").grad_transpose_copy
    assert not accel_model_config(base, bf16, "tpu").grad_transpose_copy
    assert not accel_model_config(base, TrainConfig(), "cpu").grad_transpose_copy  # float32


def test_engine_dtypes_follow_the_trainer_unless_set():
    bf16 = make_config({"Model.compute_dtype": "bfloat16"})
    base = accel_model_config(get_config("tiny-byte"), bf16, "cpu")
    same = engine_model_config(base, bf16, "cpu")
    assert (same.dtype, same.param_dtype) == (jnp.bfloat16, jnp.bfloat16)
    cfg = make_config({"Model.compute_dtype": "bfloat16", "Engine.compute_dtype": "float32"})
    split = engine_model_config(base, cfg, "cpu")
    assert (split.dtype, split.param_dtype) == (jnp.float32, jnp.float32)
    assert dataclasses.replace(split, dtype=base.dtype, param_dtype=base.param_dtype) == base
    with pytest.raises(ValueError, match="Engine.compute_dtype must be one of .*'fp16'"):
        make_config({"Engine.compute_dtype": "fp16"})
