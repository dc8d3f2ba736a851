"""The jitted train step: packed rows in, one (or several) optimizer steps out.

What it owns
    ``StepConfig`` (RL or SFT, gradient-accumulation chunking,
    ``ppo_epochs x minibatches``, old-log-prob recomputation, the policy-loss settings) and
    ``build_train_step``, which returns one ``jax.jit``-compiled pure function

        ``step(params, opt_state, batch, rng, ref_params, frozen) -> (params, opt_state, metrics)``

    with explicit in/out shardings and ``params`` / ``opt_state`` donated; its traced pieces
    (forward, log-probs, chunk loss, minibatch update) are the methods of ``_StepProgram``.
    ``params`` are what the step trains: every weight, or a LoRA run's adapters, whose frozen
    base comes in as ``frozen`` (neither donated nor differentiated; None without LoRA).

The maths, per batch of packed rows ``[R, L]`` (``algorithms.packing.PackedBatch`` arrays,
aligned as in ``Sample``: token ``t``'s behavior log-prob, mask and advantage sit at ``t``)
    - Targets are the row shifted left by one: logits at ``t`` score token ``t + 1``. A target
      counts only if it is a loss token *and* belongs to the same segment as its predecessor, so
      the first token of a packed sample is never scored against the previous sample.
    - ``ppo_epochs`` passes, each splitting the rows (shuffled per epoch when ``minibatches >
      1``) into ``minibatches`` minibatches; each minibatch is one optimizer update. Within a
      minibatch the gradients of its row-chunks (``chunk_rows`` rows each) are summed by a
      ``lax.scan``; loss weights are computed once over the whole minibatch, so the sum of the
      chunk gradients equals the gradient of the minibatch loss (token or sequence norm).
    - ``recompute_old_logprobs``: a gradient-free forward over every row before the first update
      gives ``old_logp`` (the proximal policy of AReaL's decoupled objective); the ratio is then
      taken against it and TIS weights the engine mismatch. Otherwise the ratio is taken against
      the engine's behavior log-probs. The loss sees each target's segment id (GSPO, masks).
    - ``logprob_chunk > 0``: log-probs, entropy and loss from hidden states in sequence chunks
      (``trainer/logprobs.py``), equal to the plain path up to float32 rounding.
    - ``ref_params`` (only when ``loss.kl_beta > 0``) gives the reference log-probs of the k3 KL.

Invariants
    Rows must split evenly: ``R % (minibatches * chunk_rows) == 0`` (the trainer pads rows;
    padding rows carry no loss). Shapes are static per distinct ``R``, so the trainer keeps
    ``R`` on a small set of values to bound recompiles. The step never reads the host, never
    allocates outside XLA and never calls back into Python.

Driven by ``trainer/trainer.py`` (and ``benchmarks/train_step.py``); never touches
orchestration, the engine or checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_orch.algorithms import losses
from jaxrl_orch.trainer.chunks import scan as _scan
from jaxrl_orch.trainer.chunks import shift_targets, skip_empty
from jaxrl_orch.trainer.chunks import take_rows as _take_rows
from jaxrl_orch.trainer.chunks import to_chunks as _to_chunks
from jaxrl_orch.trainer.logprobs import sft_loss_from_logprobs, token_stats

__all__ = ["shift_targets"]

BATCH_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "loss_mask",
    "advantages",
    "logprobs",
    "temperatures",
)
KINDS = ("rl", "sft")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What one step does with a batch (gin binds these keyword arguments)."""

    kind: str = "rl"
    chunk_rows: int = 1
    ppo_epochs: int = 1
    minibatches: int = 1
    recompute_old_logprobs: bool = False
    shuffle_minibatches: bool = True
    loss: losses.PolicyLossConfig = dataclasses.field(default_factory=losses.PolicyLossConfig)
    # Log-probs / entropy / loss in chunks of this many positions (trainer/logprobs.py) so no
    # [rows, T, V] float32 logits exist; 0: the plain path over the whole length.
    logprob_chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.logprob_chunk, int) or self.logprob_chunk < 0:
            raise ValueError(
                f"StepConfig.logprob_chunk must be an int >= 0 (0: off), got {self.logprob_chunk!r}"
            )
        for name in ("chunk_rows", "ppo_epochs", "minibatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StepConfig.{name} must be an int >= 1, got {v!r}")

    @property
    def rows_multiple(self) -> int:
        """The batch's row count must be a multiple of this."""
        return self.chunk_rows * self.minibatches


def build_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    cfg: StepConfig,
    *,
    param_shardings: Any,
    opt_shardings: Any,
    mesh: jax.sharding.Mesh,
    row_axis: str | None = "fsdp",
    splash_specs: Any = None,
    frozen_shardings: Any = None,
) -> Callable[..., tuple[Any, Any, dict[str, jax.Array]]]:
    """Compile-ready train step (see module docstring). ``row_axis`` shards packed rows
    (data parallel) when the chunk's row count divides over it; ``None`` replicates rows.
    ``splash_specs``: what the model's splash attention runs under (``Trainer`` resolves it)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    row_size = mesh.shape[row_axis] if row_axis else 1
    rows_spec = PartitionSpec(row_axis) if row_axis and cfg.chunk_rows % row_size == 0 else None
    program = _StepProgram(graphdef, optimizer, cfg, mesh, rows_spec, splash_specs)
    use_ref = cfg.kind == "rl" and cfg.loss.kl_beta > 0
    ref_sh = param_shardings if use_ref else None
    batch_sh = batch_shardings(mesh, cfg, row_axis)
    return jax.jit(
        program.step,
        in_shardings=(
            param_shardings,
            opt_shardings,
            batch_sh,
            replicated,
            ref_sh,
            frozen_shardings,
        ),
        out_shardings=(param_shardings, opt_shardings, replicated),
        donate_argnums=(0, 1),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _StepProgram:
    """The pieces ``build_train_step`` traces, each a pure function of its array arguments (the
    fields are static: they pick the program, never enter it as data)."""

    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    cfg: StepConfig
    mesh: jax.sharding.Mesh
    rows_spec: PartitionSpec | None  # None: rows replicated (the chunk does not divide)
    splash_specs: Any

    def constrain_rows(self, tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
        if self.rows_spec is None:
            return tree
        sharding = NamedSharding(self.mesh, self.rows_spec)
        return {k: jax.lax.with_sharding_constraint(v, sharding) for k, v in tree.items()}

    def hidden(self, model: Any, chunk: dict[str, jax.Array]) -> jax.Array:
        return model.hidden_states(
            chunk["tokens"],
            chunk["positions"],
            chunk["segment_ids"],
            splash_specs=self.splash_specs,
        )

    def model(self, params: Any, frozen: Any) -> Any:
        """The module on ``params`` (and a LoRA run's frozen base)."""
        parts = (params,) if frozen is None else (params, frozen)
        return nnx.merge(self.graphdef, *parts)

    def forward(self, params: Any, chunk: dict[str, jax.Array], frozen: Any) -> jax.Array:
        model = self.model(params, frozen)
        return model.logits_from_hidden(self.hidden(model, chunk))[:, :-1]

    def stats(self, params, frozen, chunk: dict[str, jax.Array], temps: jax.Array, entropy: bool):
        """Chunked path: (logp, entropy) [C, L-1] from hidden states, no full logits."""
        model = self.model(params, frozen)
        hidden = self.hidden(model, chunk)[:, :-1]
        head = model.logits_from_hidden
        lp_chunk = self.cfg.logprob_chunk
        return token_stats(head, hidden, chunk["targets"], temps, lp_chunk, entropy=entropy)

    def logprobs_only(self, params: Any, chunks: dict[str, jax.Array], frozen: Any) -> jax.Array:
        """Gradient-free log-probs of every chunk's targets: ``[n_chunks, C, L-1]``."""

        def chunk_lp(chunk):
            chunk = self.constrain_rows(chunk)
            if self.cfg.logprob_chunk:
                return self.stats(params, frozen, chunk, chunk["temperatures"], False)[0]
            logits = self.forward(params, chunk, frozen)
            return losses.token_logprobs(logits, chunk["targets"], chunk["temperatures"])

        zeros = lambda chunk: jnp.zeros(chunk["targets"].shape, jnp.float32)
        _, lp = _scan(lambda _, c: (None, skip_empty(c, chunk_lp, zeros, c)), None, chunks)
        return jax.lax.stop_gradient(lp)

    def chunk_loss(self, params: Any, chunk: dict[str, jax.Array], frozen: Any):
        """``(loss, metric sums)`` of one row-chunk, weighted by its minibatch's loss weights."""
        cfg = self.cfg
        chunk = self.constrain_rows(chunk)
        if cfg.logprob_chunk:
            if cfg.kind == "sft":
                ones = jnp.ones(chunk["targets"].shape, jnp.float32)
                lp = self.stats(params, frozen, chunk, ones, False)[0]
                return sft_loss_from_logprobs(lp, chunk["mask"], chunk["weights"])
            new_lp, ent = self.stats(params, frozen, chunk, chunk["temperatures"], True)
        else:
            logits = self.forward(params, chunk, frozen)
            if cfg.kind == "sft":
                return losses.sft_loss(logits, chunk["targets"], chunk["mask"], chunk["weights"])
            new_lp, ent = losses.logprobs_and_entropy(
                logits, chunk["targets"], chunk["temperatures"]
            )
        return losses.policy_loss(
            new_lp,
            chunk["behavior"],
            chunk["advantages"],
            chunk["mask"],
            chunk["weights"],
            cfg.loss,
            old_logp=chunk.get("old_logp"),
            ref_logp=chunk.get("ref_logp"),
            entropy=ent,
            segment_ids=chunk["target_segments"],
        )

    def minibatch_update(self, params: Any, opt_state: Any, mb: dict[str, jax.Array], frozen):
        """One optimizer update: the chunks' gradients summed by a scan, then AdamW."""
        loss_cfg = self.cfg.loss
        mb = dict(mb)
        mb["weights"] = losses.loss_weights(
            mb["mask"], mb["target_segments"], loss_cfg.norm, loss_cfg.norm_constant
        )
        chunks = _to_chunks(mb, self.cfg.chunk_rows)
        first = jax.tree.map(lambda v: v[0], chunks)
        sums_shape = jax.eval_shape(lambda p, c: self.chunk_loss(p, c, frozen)[1], params, first)
        grad_fn = jax.value_and_grad(self.chunk_loss, has_aux=True)

        def accumulate(acc, chunk):
            grads_acc, sums_acc = acc
            (_, sums), grads = grad_fn(params, chunk, frozen)
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
            return grads_acc, losses.merge_metric_sums(sums_acc, sums)

        def body(acc, chunk):  # an all-padding chunk adds exact zeros: skip its work
            return skip_empty(chunk, lambda c: accumulate(acc, c), lambda _: acc, chunk), None

        zero_sums = {
            k: jnp.full(v.shape, -jnp.inf if k == "ratio_max" else 0.0, v.dtype)
            for k, v in sums_shape.items()
        }
        zero_grads = jax.tree.map(jnp.zeros_like, params)
        (grads, sums), _ = _scan(body, (zero_grads, zero_sums), chunks)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = losses.finalize_metrics(sums)
        metrics["grad_norm"] = grad_norm
        return params, opt_state, metrics

    def step(self, params, opt_state, batch, rng, ref_params=None, frozen=None):
        """The jitted step (see the module docstring): ``ppo_epochs x minibatches`` updates."""
        cfg = self.cfg
        data = shift_targets(batch)
        rows = data["tokens"].shape[0]
        if rows % cfg.rows_multiple:
            raise ValueError(
                f"batch has {rows} rows; it must be a multiple of chunk_rows * minibatches = "
                f"{cfg.rows_multiple} (pad rows in the trainer)"
            )
        chunks = lambda: _to_chunks(data, cfg.chunk_rows)
        lp_of = lambda p: self.logprobs_only(p, chunks(), frozen).reshape(rows, -1)
        if cfg.kind == "rl" and cfg.recompute_old_logprobs:
            data["old_logp"] = lp_of(params)
        if cfg.kind == "rl" and cfg.loss.kl_beta > 0:
            data["ref_logp"] = lp_of(ref_params)
        per_mb = rows // cfg.minibatches

        def epoch(carry, epoch_rng):
            params, opt_state = carry
            if cfg.minibatches > 1 and cfg.shuffle_minibatches:
                order = jax.random.permutation(epoch_rng, rows)
            else:
                order = jnp.arange(rows)
            order = order.reshape(cfg.minibatches, per_mb)

            def minibatch(carry, idx):
                params, opt_state = carry
                # One unshuffled minibatch is the whole batch: skip the row gather.
                mb = data if order.shape[0] == 1 else _take_rows(data, idx)
                params, opt_state, metrics = self.minibatch_update(params, opt_state, mb, frozen)
                return (params, opt_state), metrics

            return _scan(minibatch, (params, opt_state), order)

        (params, opt_state), metrics = _scan(
            epoch, (params, opt_state), jax.random.split(rng, cfg.ppo_epochs)
        )
        return params, opt_state, _summarize(metrics, cfg.kind)


def _summarize(metrics: dict[str, jax.Array], kind: str) -> dict[str, jax.Array]:
    """Per-update metrics (leaves ``[epochs, minibatches]``) -> the step's. The first update's
    numbers are the on-policy check (ratio ~ 1 when old log-probs are consistent); the rest are
    averaged."""
    out = {k: (jnp.max(v) if k == "ratio_max" else jnp.mean(v)) for k, v in metrics.items()}
    out["loss"] = jnp.mean(metrics["loss"])
    out["num_tokens"] = jnp.sum(metrics["num_tokens"][0])
    if kind == "rl":
        out["first/ratio_mean"] = metrics["ratio_mean"][0, 0]
        out["first/clip_low"] = metrics["clip_low"][0, 0]
        out["first/clip_high"] = metrics["clip_high"][0, 0]
    return out


def batch_shardings(mesh: jax.sharding.Mesh, cfg: StepConfig, row_axis: str | None = "fsdp"):
    """Each packed field's sharding: rows over ``row_axis`` when a chunk's rows divide over it,
    else replicated (a multi-process trainer builds its global batch with these)."""
    split = row_axis is not None and cfg.chunk_rows % mesh.shape[row_axis] == 0
    spec = PartitionSpec(row_axis if split else None, None)
    return {k: NamedSharding(mesh, spec) for k in BATCH_FIELDS}
