"""The model's weight matmul: ``einsum(spec, x, w)`` in the compute dtype, float32 partial sums,
forward and backward alike, with the backward written out (a ``custom_vjp``) in every dtype.

Why it is more than ``jnp.einsum``:

- **bf16.** ``einsum(bf16, bf16, preferred_element_type=f32)`` keeps float32 partial sums (as
  the MXU does), but its JAX transpose takes the float32 cotangent, so both backward matmuls
  (``dx``, ``dw``: two thirds of a train step's FLOPs) run as float32 x bf16, which XLA promotes
  to float32 x float32. On XLA:CPU that is the slow path: bf16 x bf16 -> f32 runs on the AMX /
  AVX512-BF16 units through its YNNPACK dot fusions (measured on this project's 2-core Sapphire
  Rapids machine: a ``[4672, 256] @ [256, 768]`` dot 1.6 ms in bf16 against 7.2 ms in float32,
  while bf16 x bf16 -> bf16 takes the generic path, 9 ms). The backward here casts the
  cotangent to the compute dtype and runs ``dx`` and ``dw`` as bf16 x bf16 -> f32 too: mixed
  precision as MaxText and every TPU trainer run it (bf16 operands, f32 accumulation, f32
  master weights, since ``w.astype`` outside turns ``dw`` back into float32).
- **float32.** The same explicit backward (the cast is then a no-op, the products are
  autodiff's). With JAX's own transpose of the einsum, XLA:CPU fused the MLP's SiLU backward
  into the transposing copy that feeds the gate/up weight gradient, an elementwise loop run in
  transposed order: 53 ms per layer of a 16 x 256-token small-byte step (profiled with
  ``benchmarks/train_step.py --profile``), and the whole step took 1.14-1.18 s. Written out as
  ``einsum(x, g -> w)``, the dot reads the cotangent as it lies: 0.85-0.94 s, same maths.

``dw`` contracts over the token axes, which lead in both of its operands; XLA:CPU's bf16 dot
is fast only when the left operand's contracted axes are innermost (the same dot measured
11.8 ms with them leading, 2.0 ms with them innermost). ``transpose_copy`` (set by
``compose/precision.py`` for low-precision compute on CPU) lays the smaller operand out
contracted-axes-last with a real copy (an ``optimization_barrier`` keeps XLA from folding the
transpose back into the dot): 1.7 ms of copy + 2.0 ms of dot. Float32 dots need no copy (the
same step measured equal with and without it); TPU and GPU compilers choose their own operand
layouts, so it stays off there.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def matmul(spec: str, x: jax.Array, w: jax.Array, dtype: Any, transpose_copy: bool = False):
    """``einsum(spec, x, w)`` in ``dtype`` with float32 accumulation, returned in ``dtype``.
    ``spec`` names every axis (no ``...``) and sums only over axes ``x`` and ``w`` share."""
    x = x.astype(dtype)
    w = w.astype(dtype)
    return matmul_vjp(spec, transpose_copy, x, w).astype(dtype)


def dot32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` -> float32 for operands of one dtype (attention's score and value
    einsums): in low precision through ``matmul_vjp``, so its backward stays low precision; in
    float32 the plain einsum (the explicit backward measured no faster there)."""
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return _einsum32(spec, a, b)
    return matmul_vjp(spec, False, a, b)


def _einsum32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def matmul_vjp(spec: str, transpose_copy: bool, x: jax.Array, w: jax.Array) -> jax.Array:
    """``einsum(spec, x, w)`` -> float32, both operands in one dtype; its backward runs both
    matmuls on operands of that dtype (float32 results)."""
    return _einsum32(spec, x, w)


def _fwd(spec, transpose_copy, x, w):
    return _einsum32(spec, x, w), (x, w)


def _bwd(spec, transpose_copy, res, g):
    x, w = res
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    g = g.astype(x.dtype)
    dx = _einsum32(f"{out},{ws}->{xs}", g, w).astype(x.dtype)
    if transpose_copy:
        dw = _weight_grad(xs, out, ws, x, g)
    else:
        dw = _einsum32(f"{xs},{out}->{ws}", x, g)
    return dx, dw.astype(w.dtype)


def _weight_grad(xs: str, out: str, ws: str, x: jax.Array, g: jax.Array) -> jax.Array:
    """``einsum(xs, out -> ws)`` with the smaller operand copied contracted-axes-last, so that it
    is a dot whose left operand is ``[free, contracted]`` in memory."""
    (small, s_spec), (big, b_spec) = sorted(((x, xs), (g, out)), key=lambda p: p[0].size)
    free = "".join(c for c in s_spec if c in ws)
    order = free + "".join(c for c in s_spec if c not in ws)
    moved = jnp.transpose(small, [s_spec.index(c) for c in order])
    flat = jax.lax.optimization_barrier(moved.reshape(-1))  # a copy, not a bitcast
    return _einsum32(f"{order},{b_spec}->{ws}", flat.reshape(moved.shape), big)


matmul_vjp.defvjp(_fwd, _bwd)
