"""Trainer: owns params and optimizer state on the trainer mesh; one optimizer step per batch.

What it owns
    The policy params (an NNX ``State``), the optax state, the step RNG and the policy version,
    all placed with explicit shardings on the trainer mesh: param shardings come from
    ``sharding.rules.resolve_shardings(logical_specs(state), mesh, TRAINER_RULES)`` and the
    optimizer state's from ``optim.opt_state_shardings`` (Adam moments follow their params,
    counters are replicated). Params are initialised by a jitted init whose outputs land sharded
    (no replicated copy is ever materialised), or taken from ``init_params`` (e.g. imported HF
    weights) and moved onto the shardings.

Construction: ``Trainer(model_config, mesh, *, rows=RowLayout(...), step=StepConfig(...),
optim=OptimConfig(...), seed, rules, init_params, initial_version, hooks=StepHooks(...))``.
Everything that shapes a step is given here; nothing is set on a trainer after it is built.

Per batch (``train_step``): pack ``TrainBatch.samples`` with ``algorithms.packing.pack_samples``
into ``[R, rows.row_len]`` rows (R padded to a multiple of ``chunk_rows * minibatches`` and to at
least ``rows.min_rows``, or to ``rows.num_rows`` when fixed), run the jitted step from
``trainer/step.py``, set ``version = batch.step``, then publish (below).

Fixed shapes: with ``min_rows`` at the most rows a batch can need (one per sample: every
sample fits a row) the step sees one shape for the whole run, so it compiles once; the chunks
of padding rows cost a ``lax.cond`` each, not a forward and backward pass (``trainer/chunks``).

Versions: the initial params are version ``initial_version`` (0); batch ``step`` must be trained
on version ``step - 1`` and produces version ``step``, so batches arrive in order and a batch
whose step is not ``version + 1`` is rejected (a skipped or repeated batch is an orchestrator
bug, not something to paper over).

Publishing contract: ``start(publish, copy_params=...)`` names the one callback; after every
``train_step`` it is called as ``publish(version, params, metrics)`` (``metrics``: that step's,
a copy) on the thread that stepped (the worker's, once started), after the step has finished on
device. The ``params`` are valid only until it returns, because the next step donates them; a
callback that keeps them (the weight path) must copy or reshard them before returning, or pass
``copy_params=True`` to get a copy of its own. Callbacks that live on an asyncio loop hop over
with ``loop.call_soon_threadsafe``.

Hooks (``StepHooks``): ``around_step()`` is entered around every worker step (the overlap
schedule pauses a colocated engine there); ``on_batch(arrays)`` gets each packed batch before
the step (a trainer group's process 0 hands it to its peers, docs/design.md section 8). A peer takes
the same step with ``follow(arrays)``: same arrays, same RNG stream, so the same params.
``programs(group, name, jitted)``, when given, is what the step is called through (the run's
executable store, ``compose.executables``: it loads the step whole on a restart).

Background mode: ``start()`` launches one worker thread, which first compiles the step for the
one batch shape a row floor gives (``precompile``: while the first rollouts are drawn, not when
the first batch is in); ``submit(batch)`` enqueues and returns at once (so the orchestrator's
event loop never blocks on device work); an exception in the worker is kept and re-raised by
the next ``submit``, ``check``, ``wait_idle`` or ``stop``.
``gauges()`` reports ``trainer/*`` numbers of the last step.

Never: imports orchestration code, writes metrics itself, or re-tokenizes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.algorithms.packing import PackedBatch, pack_samples
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.params import BaseWeights, Restoring, fingerprint, initial_params
from jaxrl_orch.trainer.programs import build_programs, step_programs
from jaxrl_orch.trainer.rows import RowLayout
from jaxrl_orch.types import TrainBatch
from sharding.rules import TRAINER_RULES, Rules, abstract_arrays

# publish(version, params, metrics): see "Publishing contract" in the module docstring.
Publisher = Callable[[int, Any, dict[str, float]], None]


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What the trainer's owner runs at a step (see "Hooks" in the module docstring)."""

    around_step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    on_batch: Callable[[dict[str, np.ndarray]], None] | None = None
    programs: Callable[[str, str, Any], Any] | None = None


class Trainer:
    """See the module docstring. Driven by the orchestrator's loop (``submit``) or directly."""

    def __init__(
        self,
        model_config: ModelConfig,
        mesh: Mesh,
        *,
        rows: RowLayout = RowLayout(),
        step: step_lib.StepConfig | None = None,
        optim: optim_lib.OptimConfig | None = None,
        seed: int = 0,
        rules: Rules = TRAINER_RULES,
        init_params: Any = None,
        initial_version: int = 0,
        hooks: StepHooks = StepHooks(),
    ) -> None:
        self.config = model_config
        self.mesh = mesh
        self.step_cfg = step or step_lib.StepConfig()
        self.optim_cfg = optim or optim_lib.OptimConfig()
        self.rows = rows
        self._min_rows = rows.floor(model_config, self.step_cfg.rows_multiple)
        self.hooks = hooks

        built = build_programs(
            model_config, mesh, self.step_cfg, self.optim_cfg, rules, seed, rows.row_len
        )
        self.graphdef = built.graphdef
        self.param_shardings = built.param_shardings
        self.frozen_shardings = built.frozen_shardings
        # LoRA: params are the adapters, frozen the base (trainer/params.py); else frozen None.
        self.params, self.frozen = initial_params(built, model_config, mesh, seed, init_params)
        self._unrestored = isinstance(init_params, Restoring)  # abstract arrays until load_state
        lora = model_config.lora
        self._base = None if lora is None else BaseWeights(built, lora)
        self._fingerprint: str | None = None
        self.optimizer = built.optimizer
        self._schedule = optim_lib.make_schedule(self.optim_cfg)
        self.opt_shardings = built.opt_shardings
        self.opt_state = self._initial_opt_state(built)
        self._copy = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings
        )
        self.ref_params = None
        if self.step_cfg.kind == "rl" and self.step_cfg.loss.kl_beta > 0:
            # The reference policy is the initial policy, frozen. It is not checkpointed: a
            # resumed trainer is rebuilt from the same seed / init_params, so it is rebuilt too.
            if self._unrestored:
                raise ValueError("with kl_beta > 0 the reference is the initial policy: give it")
            self.ref_params = self._copy(self.params)
        # A trainer group (several processes, docs/design.md section 8): every process passes the
        # whole batch, placed with the step's shardings.
        self._batch_shardings = step_lib.batch_shardings(mesh, self.step_cfg)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        # The group of its programs names all they are built from (compose.executables).
        group = f"trainer {(model_config, self.step_cfg, self.optim_cfg, rows.row_len, rules)!r}"
        self._step_fn, self._lr, self._split = step_programs(
            hooks.programs, group, built.step_fn, self._schedule, self._replicated
        )
        self.rng = jax.device_put(jax.random.PRNGKey(seed), self._replicated)
        self.version = int(initial_version)
        self.steps_done = 0

        self._queue: queue.Queue[TrainBatch | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._publish: Publisher | None = None
        self._copy_params = False
        self._error: BaseException | None = None
        self._busy = False
        self._last: dict[str, float] = {}

    def _initial_opt_state(self, programs: Any) -> Any:
        """Fresh optimizer state on its shardings; abstract where a restore fills it."""
        if self._unrestored:
            return abstract_arrays(programs.abstract_opt_state, self.opt_shardings)
        return jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(self.params)

    # ------------------------------------------------------------------ stepping

    def pack(self, batch: TrainBatch) -> PackedBatch:
        """Pack a batch's samples into rows the step accepts (row count padded, see docstring).

        RL samples longer than ``row_len`` keep their first ``row_len`` tokens (their tail is
        not trained on; ``truncated_samples`` counts them) instead of failing a run mid-way on
        one long rollout; SFT samples are data the user controls, so they still raise.
        """
        if not batch.samples:
            raise ValueError(f"TrainBatch step {batch.step} has no samples; nothing to train on")
        truncate = self.step_cfg.kind == "rl"
        row_len = self.rows.row_len
        pad_id = self.rows.pad_id
        packed = pack_samples(
            batch.samples, row_len, num_rows=self.rows.num_rows, pad_id=pad_id, truncate=truncate
        )
        mult = self.step_cfg.rows_multiple
        rows = max(-(-packed.num_rows // mult) * mult, self._min_rows)
        if rows != packed.num_rows:
            packed = pack_samples(
                batch.samples, row_len, num_rows=rows, pad_id=pad_id, truncate=truncate
            )
        return packed

    def train_packed(self, packed: PackedBatch) -> dict[str, float]:
        """Run one step on already packed rows; returns host metrics. Does not bump versions."""
        arrays = {k: getattr(packed, k) for k in step_lib.BATCH_FIELDS}
        if self.hooks.on_batch is not None:
            self.hooks.on_batch(arrays)  # a group's process 0: its peers take the same step
        metrics = self.step_arrays(arrays)
        metrics["tokens_per_s"] = packed.num_tokens / metrics["step_s"]
        metrics["batch_tokens"] = float(packed.num_tokens)
        metrics["rows"] = float(packed.num_rows)
        metrics["fill_ratio"] = packed.fill_ratio
        return metrics

    def step_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, float]:
        """One optimizer step on a packed batch's arrays (``BATCH_FIELDS``); what every process
        of a trainer group runs in lockstep. Returns the step's host metrics."""
        if self._unrestored:
            raise RuntimeError("this trainer was built to be restored (Restoring()): restore it")
        self.rng, step_rng = self._split(self.rng)
        # The rate of this step's first update (optax counts updates, several per step).
        updates = self.steps_done * self.step_cfg.minibatches * self.step_cfg.ppo_epochs
        lr = float(self._lr(updates))
        t0 = time.perf_counter()
        batch = jax.device_put(arrays, self._batch_shardings)
        self.params, self.opt_state, metrics = self._step_fn(
            self.params, self.opt_state, batch, step_rng, self.ref_params, self.frozen
        )
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        jax.block_until_ready(self.params)
        self.steps_done += 1
        metrics["step_s"] = max(time.perf_counter() - t0, 1e-9)
        metrics["lr"] = lr
        return metrics

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Pack, step, set ``version = batch.step``, publish. Returns this step's metrics."""
        if batch.step != self.version + 1:
            raise ValueError(
                f"TrainBatch step {batch.step} cannot be trained on policy version "
                f"{self.version}: expected step {self.version + 1} (batches arrive in order)"
            )
        self._busy = True
        try:
            metrics = self.train_packed(self.pack(batch))
            too_long = sum(len(s) > self.rows.row_len for s in batch.samples)
            metrics["truncated_samples"] = float(too_long)
            self.version = batch.step
            metrics["version"] = float(self.version)
            self._last = metrics
            if self._publish is not None:
                params = self._copy(self.params) if self._copy_params else self.params
                self._publish(self.version, params, dict(metrics))
        finally:
            self._busy = False
        return metrics

    def follow(self, arrays: dict[str, np.ndarray]) -> dict[str, float]:
        """A trainer-group peer's step on the leader's packed ``arrays`` (what its ``on_batch``
        handed over): the same step the leader takes, then ``version + 1``. Publishes nothing:
        the peer's owner stages its params itself."""
        metrics = self.step_arrays(arrays)
        self.version += 1
        metrics["version"] = float(self.version)
        self._last = metrics
        return metrics

    # ------------------------------------------------------------------ background worker

    def start(self, publish: Publisher | None = None, *, copy_params: bool = False) -> None:
        """Launch the worker; ``publish`` is called after every step (module docstring)."""
        if self._worker is not None:
            raise RuntimeError("Trainer.start() called twice")
        self._publish = publish
        self._copy_params = copy_params
        self._worker = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._worker.start()

    def precompile(self) -> bool:
        """Compile the step for the one batch shape a row floor gives (module docstring) while
        the first rollouts are drawn, so the first batch does not wait for it (the jitted step
        then finds it compiled). False where the shape is not known before (no floor)."""
        rows = max(self.rows.num_rows or 0, self._min_rows)
        if not rows:
            return False
        batch = self.rows.abstract_batch(rows, self._batch_shardings)
        # A step's key is a split of this one, alike in shape, type and placement. Nothing
        # runs here: a trainer group's peers take no part in the leader's compile.
        rng = jax.ShapeDtypeStruct(self.rng.shape, self.rng.dtype, sharding=self.rng.sharding)
        args = (self.params, self.opt_state, batch, rng, self.ref_params, self.frozen)
        prepare = getattr(self._step_fn, "prepare", None)  # an executable store's: loaded whole
        if prepare is not None:
            prepare(*args)
        else:
            self._step_fn.lower(*args).compile()
        return True

    def _run(self) -> None:
        try:
            self.precompile()
        except BaseException as e:  # noqa: BLE001 - kept and re-raised on the caller's side
            self._error = e
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if self._error is None:
                    with self.hooks.around_step():
                        self.train_step(batch)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised on the caller's side
                self._error = e
            finally:
                self._queue.task_done()

    def check(self) -> None:
        """Re-raise a worker failure on the calling thread."""
        if self._error is not None:
            raise RuntimeError("trainer worker failed") from self._error

    def submit(self, batch: TrainBatch) -> None:
        """Queue ``batch`` for the worker; returns immediately (``types.BatchTrainer``)."""
        self.check()
        if self._worker is None:
            raise RuntimeError("Trainer.submit() needs start() first")
        self._queue.put(batch)

    def wait_idle(self) -> None:
        """Block until every submitted batch is trained (or the worker failed)."""
        self._queue.join()
        self.check()

    def stop(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self.check()

    @property
    def is_idle(self) -> bool:
        """No batch queued or in flight (the moment a checkpoint may be taken)."""
        return not self._busy and self._queue.unfinished_tasks == 0

    def gauges(self) -> dict[str, float]:
        g = {f"trainer/{k}": float(v) for k, v in self._last.items()}
        g.update(
            {
                "trainer/version": float(self.version),
                "trainer/steps": float(self.steps_done),
                "trainer/queue_depth": float(self._queue.qsize()),
                "trainer/busy": 1.0 if self._busy else 0.0,
            }
        )
        return g

    # ------------------------------------------------------------------ LoRA

    @property
    def base_fingerprint(self) -> str | None:
        """A LoRA run's frozen base by content (``params.fingerprint``); None without LoRA."""
        if self.frozen is not None and self._fingerprint is None:
            self._fingerprint = fingerprint(self.frozen)
        return self._fingerprint

    def merged_params(self) -> Any:
        """Every weight of the current policy: the params, or the base with the adapters
        folded in (a new array set on the base's shardings; what an export writes)."""
        return self.params if self._base is None else self._base.merged(self.frozen, self.params)

    def dense_base(self) -> Any:
        """A LoRA run's frozen base as dense weights (QLoRA: dequantized)."""
        return self._base.dense(self.frozen)

    # ------------------------------------------------------------------ checkpoint state

    def abstract_state(self) -> dict[str, Any]:
        """``jax.ShapeDtypeStruct`` targets (with this trainer's shardings) for a restore."""

        def sds(x: jax.Array) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

        # The live arrays already carry this trainer's shardings, leaf for leaf.
        return {
            "params": jax.tree.map(sds, self.params),
            "opt_state": jax.tree.map(sds, self.opt_state),
        }

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint must hold to resume this trainer (arrays stay on device)."""
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "rng": np.asarray(jax.device_get(self.rng)),
            "version": self.version,
            "steps_done": self.steps_done,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Adopt a restored ``state()`` (arrays must already carry this trainer's shardings)."""
        self.params = jax.device_put(state["params"], self.param_shardings)
        self.opt_state = jax.device_put(state["opt_state"], self.opt_shardings)
        self._unrestored = False
        self.rng = jax.device_put(np.asarray(state["rng"], dtype=np.uint32), self._replicated)
        self.version = int(state["version"])
        self.steps_done = int(state["steps_done"])
