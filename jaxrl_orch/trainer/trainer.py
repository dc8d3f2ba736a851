"""Trainer: owns params and optimizer state on the trainer mesh; one optimizer step per batch.

What it owns
    The policy params (an NNX ``State``), the optax state, the step RNG and the policy version,
    all placed with explicit shardings on the trainer mesh: param shardings come from
    ``sharding.rules.resolve_shardings(logical_specs(state), mesh, TRAINER_RULES)`` and the
    optimizer state's from ``step.opt_state_shardings`` (Adam moments follow their params,
    counters are replicated). Params are initialised by a jitted init whose outputs land sharded
    (no replicated copy is ever materialised), or taken from ``init_params`` (e.g. imported HF
    weights) and moved onto the shardings.

Per batch (``train_step``): pack ``TrainBatch.samples`` with ``algorithms.packing.pack_samples``
into ``[R, row_len]`` rows (R padded to a multiple of ``chunk_rows * minibatches`` and to at
least ``min_rows``, or to ``num_rows`` when fixed), run the jitted step from
``trainer/step.py``, set ``version = batch.step``, then call every publisher with
``(version, params)``.

Fixed shapes: with ``min_rows`` at the most rows a batch can need (one per sample: every
sample fits a row) the step sees one shape for the whole run, so it compiles once; the chunks
of padding rows cost a ``lax.cond`` each, not a forward and backward pass (``trainer/chunks``).

Versions: the initial params are version ``initial_version`` (0); batch ``step`` must be trained
on version ``step - 1`` and produces version ``step``, so batches arrive in order and a batch
whose step is not ``version + 1`` is rejected (a skipped or repeated batch is an orchestrator
bug, not something to paper over).

Publishing contract: publishers run synchronously on the trainer's worker thread, after the step
has finished on device. The ``params`` they get are valid only until they return, because the
next step donates them; a publisher that keeps params beyond that (the weight watcher) must copy
or reshard them before returning, or the trainer must be built with ``copy_on_publish=True``.
Publishers that live on an asyncio loop hop over with ``loop.call_soon_threadsafe``.

Background mode: ``start()`` launches one worker thread; ``submit(batch)`` enqueues and returns
at once (so the orchestrator's event loop never blocks on device work); an exception in the
worker is kept and re-raised by the next ``submit``, ``check``, ``wait_idle`` or ``stop``.
``gauges()`` reports ``trainer/*`` numbers of the last step.

Never: imports orchestration code, writes metrics itself, or re-tokenizes anything.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.algorithms.packing import PackedBatch, pack_samples
from jaxrl_orch.models.transformer import ModelConfig, Transformer
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.programs import build_programs
from jaxrl_orch.types import TrainBatch
from sharding.rules import TRAINER_RULES, Rules

Publisher = Callable[[int, Any], None]


class Trainer:
    """See the module docstring. Driven by the orchestrator's loop (``submit``) or directly."""

    def __init__(
        self,
        model_config: ModelConfig,
        mesh: Mesh,
        *,
        row_len: int = 2048,
        step: step_lib.StepConfig | None = None,
        optim: step_lib.OptimConfig | None = None,
        seed: int = 0,
        rules: Rules = TRAINER_RULES,
        num_rows: int | None = None,
        min_rows: int | None = None,
        init_params: Any = None,
        initial_version: int = 0,
        copy_on_publish: bool = False,
        pad_id: int = 0,
    ) -> None:
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2 (targets are shifted by one), got {row_len}")
        if row_len > model_config.max_seq_len:
            raise ValueError(
                f"row_len {row_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
            )
        self.config = model_config
        self.mesh = mesh
        self.row_len = row_len
        self.step_cfg = step or step_lib.StepConfig()
        self.optim_cfg = optim or step_lib.OptimConfig()
        if num_rows is not None and num_rows % self.step_cfg.rows_multiple:
            raise ValueError(
                f"num_rows {num_rows} must be a multiple of chunk_rows * minibatches = "
                f"{self.step_cfg.rows_multiple}"
            )
        self.num_rows = num_rows
        mult = self.step_cfg.rows_multiple
        self.min_rows = -(-(min_rows or 0) // mult) * mult  # rounded up to whole chunks
        self.pad_id = pad_id
        self.copy_on_publish = copy_on_publish
        self._publishers: list[Publisher] = []

        programs = build_programs(
            model_config, mesh, self.step_cfg, self.optim_cfg, rules, seed, row_len
        )
        self.graphdef, abstract_state = programs.graphdef, programs.abstract_params
        self.param_shardings = programs.param_shardings
        if init_params is None:

            def init() -> Any:
                return nnx.split(Transformer(model_config, rngs=nnx.Rngs(seed)))[1]

            with jax.set_mesh(mesh):
                self.params = jax.jit(init, out_shardings=self.param_shardings)()
        else:
            _check_same_shapes(init_params, abstract_state)
            self.params = jax.device_put(init_params, self.param_shardings)

        self.optimizer = programs.optimizer
        self._schedule = step_lib.make_schedule(self.optim_cfg)
        self.opt_shardings = programs.opt_shardings
        self.opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(self.params)
        self._copy = jax.jit(
            lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings
        )
        self.ref_params = None
        if self.step_cfg.kind == "rl" and self.step_cfg.loss.kl_beta > 0:
            # The reference policy is the initial policy, frozen. It is not checkpointed: a
            # resumed trainer is rebuilt from the same seed / init_params, so it is rebuilt too.
            self.ref_params = self._copy(self.params)
        self._step_fn = programs.step_fn
        # A trainer group (several processes, DESIGN.md section 8): every process passes the
        # whole batch, placed with the step's shardings; process 0 hands it over (on_batch).
        self._batch_shardings = step_lib.batch_shardings(mesh, self.step_cfg)
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.on_batch: Callable[[dict[str, np.ndarray]], None] | None = None
        self.rng = jax.device_put(jax.random.PRNGKey(seed), self._replicated)
        self.version = int(initial_version)
        self.steps_done = 0

        self._queue: queue.Queue[TrainBatch | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._busy = False
        self._last: dict[str, float] = {}
        # Wraps every worker step (overlap.OverlapSchedule.training pauses the engine there).
        self.around_step: Callable[[], Any] = contextlib.nullcontext

    # ------------------------------------------------------------------ publishing

    def add_publisher(self, callback: Publisher) -> None:
        """Register ``callback(version, params)``, called after every step (see docstring)."""
        self._publishers.append(callback)

    def _publish(self) -> None:
        params = self._copy(self.params) if self.copy_on_publish else self.params
        for cb in self._publishers:
            cb(self.version, params)

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
        packed = pack_samples(
            batch.samples,
            self.row_len,
            num_rows=self.num_rows,
            pad_id=self.pad_id,
            truncate=truncate,
        )
        mult = self.step_cfg.rows_multiple
        rows = max(-(-packed.num_rows // mult) * mult, self.min_rows)
        if rows != packed.num_rows:
            packed = pack_samples(
                batch.samples, self.row_len, num_rows=rows, pad_id=self.pad_id, truncate=truncate
            )
        return packed

    def train_packed(self, packed: PackedBatch) -> dict[str, float]:
        """Run one step on already packed rows; returns host metrics. Does not bump versions."""
        arrays = {k: getattr(packed, k) for k in step_lib.BATCH_FIELDS}
        if self.on_batch is not None:
            self.on_batch(arrays)  # a group's process 0: its peers take the same step
        metrics = self.step_arrays(arrays)
        metrics["tokens_per_s"] = packed.num_tokens / metrics["step_s"]
        metrics["batch_tokens"] = float(packed.num_tokens)
        metrics["rows"] = float(packed.num_rows)
        metrics["fill_ratio"] = packed.fill_ratio
        return metrics

    def step_arrays(self, arrays: dict[str, np.ndarray]) -> dict[str, float]:
        """One optimizer step on a packed batch's arrays (``BATCH_FIELDS``); what every process
        of a trainer group runs in lockstep. Returns the step's host metrics."""
        self.rng, step_rng = jax.random.split(self.rng)
        # The rate of this step's first update (optax counts updates, several per step).
        updates = self.steps_done * self.step_cfg.minibatches * self.step_cfg.ppo_epochs
        lr = float(self._schedule(updates))
        t0 = time.perf_counter()
        batch = jax.device_put(arrays, self._batch_shardings)
        self.params, self.opt_state, metrics = self._step_fn(
            self.params, self.opt_state, batch, step_rng, self.ref_params
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
            metrics["truncated_samples"] = float(sum(len(s) > self.row_len for s in batch.samples))
            self.version = batch.step
            metrics["version"] = float(self.version)
            self._last = metrics
            self._publish()
        finally:
            self._busy = False
        return metrics

    @property
    def last_step_metrics(self) -> dict[str, float]:
        """The metrics of the last trained step (a copy; read it in a publisher callback to get
        exactly the published version's numbers)."""
        return dict(self._last)

    # ------------------------------------------------------------------ background worker

    def start(self) -> None:
        if self._worker is not None:
            raise RuntimeError("Trainer.start() called twice")
        self._worker = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if self._error is None:
                    with self.around_step():
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
        """Queue ``batch`` for the worker; returns immediately (``types.Trainer``)."""
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
        self.rng = jax.device_put(np.asarray(state["rng"], dtype=np.uint32), self._replicated)
        self.version = int(state["version"])
        self.steps_done = int(state["steps_done"])


def _check_same_shapes(params: Any, abstract: Any) -> None:
    """``init_params`` must match the model built from ``model_config`` leaf for leaf."""
    got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(abstract)}
    if got.keys() != want.keys():
        extra, missing = sorted(got.keys() - want.keys()), sorted(want.keys() - got.keys())
        raise ValueError(
            f"init_params do not match the model config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}"
        )
    for k, w in want.items():
        if tuple(np.shape(got[k])) != tuple(w.shape):
            raise ValueError(
                f"init_params{k} has shape {tuple(np.shape(got[k]))}, the model config "
                f"needs {tuple(w.shape)}"
            )
