"""Checkpoints of the whole run state, saved together and atomically with orbax-checkpoint.

What it owns
    ``Checkpointer``: one ``orbax.checkpoint.CheckpointManager`` whose every step directory is a
    Composite of three items written in one atomic save (orbax writes into a temporary
    directory and renames it when every item is complete, so a crash never leaves a half
    checkpoint that ``latest_step`` would pick):

    - ``state`` (``StandardSave``): params, optimizer state and the step RNG key, as one flat
      dict of arrays keyed by their dotted pytree path (``params.layers.0.attn.q_proj.value``);
      flattening keeps orbax independent of NNX / optax container classes, and restoring into
      the caller's tree structure is exact.
    - ``meta`` (``JsonSave``): step, policy version, optimizer steps done, format version, and
      a LoRA run's base fingerprint (its adapters restore onto that base only).
    - ``orchestrator`` (``JsonSave``): the orchestrator's arbitrary JSON-serialisable state
      (progress step, data cursor, gate counters, per-env sampler state).

Restoring onto another mesh: the caller passes abstract targets (``jax.ShapeDtypeStruct`` with
``sharding=``, e.g. ``Trainer.abstract_state()``), and orbax reads every array straight into
those shardings; the mesh at save time does not matter.

Before a save, the free space of the checkpoint's filesystem is checked against the arrays'
size: a full disk is an ``OSError(ENOSPC)`` naming the directory, raised before any write.

Saves are asynchronous by default: ``save`` returns once arrays are copied off the device
(so the next train step may donate them); ``wait()`` blocks until the write is committed.
``max_to_keep`` prunes old steps.

Errors: a missing directory, an empty one, an unknown step, or a checkpoint whose files are
unreadable / do not match the target structure raise ``CheckpointError`` (a
``FileNotFoundError`` for the missing cases) naming the path.

Fallback (``restore_trainer`` without a step): the newest checkpoint that restores is used. One
that fails is reported in one line (step, path, cause) and moved aside to
``<directory>.corrupt/<step>`` (kept for inspection, out of the manager's way so the resumed
run can save that step again), and the previous one is tried; when none restores, the error
says which steps failed and what to delete to start over.

Driven by the orchestrator's loop (through ``save_trainer`` / ``restore_trainer``); never
touches the engine and never decides *when* to checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_orch.paths import as_path, copy_tree, is_url
from jaxrl_orch.trainer.trainer import Trainer

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be restored (corrupt, truncated or mismatched)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for."""


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """``{dotted.path: leaf}`` and the treedef to rebuild ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise ValueError("pytree paths collide after flattening; cannot checkpoint this tree")
    return flat, treedef


def unflatten(flat: dict[str, Any], like: Any) -> Any:
    names, treedef = flatten(like)
    missing = [n for n in names if n not in flat]
    if missing:
        raise KeyError(f"restored state lacks {len(missing)} entries, e.g. {missing[:3]}")
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])


class Checkpointer:
    """See the module docstring."""

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep!r}")
        # A gs:// URL stays a URL (orbax and tensorstore write it); a local path goes absolute.
        url = is_url(directory)
        self.directory = os.fspath(directory) if url else os.path.abspath(os.fspath(directory))
        self.is_url = url
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
            ),
            item_names=("state", "meta", "orchestrator"),
        )

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save / restore

    def save(
        self,
        step: int,
        *,
        params: Any,
        opt_state: Any,
        rng: Any,
        meta: dict[str, Any],
        orchestrator_state: dict[str, Any],
        force: bool = True,
    ) -> bool:
        """Queue an atomic save of everything under ``step``; returns whether one started."""
        try:
            json.dumps(orchestrator_state)
        except TypeError as e:
            raise TypeError(f"orchestrator_state must be JSON-serialisable: {e}") from e
        flat_state, _ = flatten({"params": params, "opt_state": opt_state})
        flat_state["rng"] = np.asarray(jax.device_get(rng))
        self.check_space(step, sum(int(getattr(x, "nbytes", 0)) for x in flat_state.values()))
        meta = {**meta, "step": int(step), "format": FORMAT_VERSION}
        return self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(flat_state),
                meta=ocp.args.JsonSave(meta),
                orchestrator=ocp.args.JsonSave(orchestrator_state),
            ),
            force=force,
        )

    def check_space(self, step: int, nbytes: int) -> None:
        """Refuse a save the disk cannot hold, as one ``OSError(ENOSPC)`` naming the path, before
        orbax's writer threads start (a write failing there ends in pages of thread noise)."""
        if self.is_url:
            return  # object storage has no free-space figure to check against
        need = int(nbytes * 1.05) + (1 << 20)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise OSError(
                errno.ENOSPC,
                f"No space left on device: checkpoint step {step} needs about "
                f"{need / 1e6:.1f} MB, {free / 1e6:.1f} MB free",
                self.directory,
            )

    def wait(self) -> None:
        """Block until every queued save is committed to disk."""
        self._manager.wait_until_finished()

    def restore(self, abstract: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Restore ``step`` (default: latest) into ``abstract = {"params", "opt_state"}`` trees of
        ``jax.ShapeDtypeStruct`` with shardings. Returns ``{"params", "opt_state", "rng",
        "meta", "orchestrator"}``."""
        if not as_path(self.directory).is_dir():
            raise CheckpointNotFoundError(f"no checkpoint directory at {self.directory}")
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints found in {self.directory}")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        flat_target, _ = flatten({"params": abstract["params"], "opt_state": abstract["opt_state"]})
        flat_target["rng"] = jax.ShapeDtypeStruct((2,), np.uint32)
        path = os.path.join(self.directory, str(step))
        try:
            out = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(flat_target),
                    meta=ocp.args.JsonRestore(),
                    orchestrator=ocp.args.JsonRestore(),
                ),
            )
            tree = unflatten(
                {k: v for k, v in out["state"].items() if k != "rng"},
                {"params": abstract["params"], "opt_state": abstract["opt_state"]},
            )
        except Exception as e:  # noqa: BLE001 - any failure here means an unusable checkpoint
            raise CheckpointError(
                f"checkpoint step {step} at {path} could not be restored ({type(e).__name__}: {e})"
            ) from e
        if out["meta"] is None or out["orchestrator"] is None:
            raise CheckpointError(f"checkpoint step {step} at {path} lacks meta/orchestrator")
        return {
            "params": tree["params"],
            "opt_state": tree["opt_state"],
            "rng": np.asarray(out["state"]["rng"]),
            "meta": dict(out["meta"]),
            "orchestrator": dict(out["orchestrator"]),
        }

    def read_state(self, step: int) -> dict[str, Any]:
        """The orchestrator's dict saved under ``step``, without reading a single array: what a
        stage that keeps its arrays elsewhere (a resumed run's warm-up) needs to know."""
        path = os.path.join(self.directory, str(step))
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(orchestrator=ocp.args.JsonRestore())
            )
        except Exception as e:  # noqa: BLE001 - any failure here means an unusable checkpoint
            raise CheckpointError(
                f"checkpoint step {step} at {path} could not be read ({type(e).__name__}: {e})"
            ) from e
        if out["orchestrator"] is None:
            raise CheckpointError(f"checkpoint step {step} at {path} lacks its orchestrator item")
        return dict(out["orchestrator"])

    def set_aside(self, step: int) -> str:
        """Move step ``step``'s directory to ``<directory>.corrupt/<step>``; returns where."""
        src = as_path(self.directory) / str(step)
        dest = as_path(self.directory + ".corrupt")
        dest = dest / str(step)
        if dest.exists():
            dest.rmtree()
        if self.is_url:  # objects: copied, then deleted (there is no directory to rename)
            copy_tree(src, dest)
            src.rmtree()
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(os.fspath(src), os.fspath(dest))
        self._manager.reload()
        return os.fspath(dest)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def restore_newest_intact(
    ckpt: Checkpointer, abstract: dict[str, Any], report: Callable[[str], None] = _stderr
) -> dict[str, Any]:
    """``ckpt.restore`` of the newest step that restores (see the module docstring)."""
    steps = ckpt.all_steps()
    if not steps:
        raise CheckpointNotFoundError(f"no checkpoints found in {ckpt.directory}")
    failed = []
    for step in reversed(steps):
        try:
            out = ckpt.restore(abstract, step)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as exc:
            cause = (str(exc.__cause__ or exc).strip().splitlines() or ["?"])[0][:300]
            moved = ckpt.set_aside(step)
            failed.append(step)
            report(
                f"!! checkpoint step {step} at {os.path.join(ckpt.directory, str(step))} does "
                f"not restore ({cause}); moved to {moved}, trying the previous one"
            )
            continue
        return out
    raise CheckpointError(
        f"no checkpoint in {ckpt.directory} restores: steps {failed} all failed (moved to "
        f"{ckpt.directory}.corrupt/). To start this stage afresh, delete {ckpt.directory} "
        "(and its .corrupt/ copy) and rerun the same command"
    )


def save_trainer(
    ckpt: Checkpointer,
    trainer: Trainer,
    step: int,
    orchestrator_state: dict[str, Any],
    *,
    between_steps: bool = False,
) -> bool:
    """Save a ``Trainer``'s state with the orchestrator's dict under ``step``.

    The trainer must be idle (``wait_idle()`` first): a step in flight would donate the very
    arrays being saved, and params and optimizer state could come from different steps. Its
    own worker thread may save ``between_steps`` (from the publish callback, after step
    ``step`` and before the next one), then wait for the write before returning.
    """
    if not (between_steps or trainer.is_idle):
        raise RuntimeError(
            f"cannot checkpoint step {step}: the trainer is busy; call trainer.wait_idle() first"
        )
    st = trainer.state()
    return ckpt.save(
        step,
        params=st["params"],
        opt_state=st["opt_state"],
        rng=st["rng"],
        meta={
            "version": st["version"],
            "steps_done": st["steps_done"],
            # A LoRA run saves only its adapters: the base they were trained over, by content.
            "base": trainer.base_fingerprint,
        },
        orchestrator_state=orchestrator_state,
    )


def restore_trainer(
    ckpt: Checkpointer, trainer: Trainer, step: int | None = None
) -> dict[str, Any]:
    """Restore onto ``trainer``'s own mesh/shardings; returns the orchestrator's dict. Without
    ``step``, the newest checkpoint that restores (``restore_newest_intact``)."""
    abstract = trainer.abstract_state()
    out = restore_newest_intact(ckpt, abstract) if step is None else ckpt.restore(abstract, step)
    saved = out["meta"].get("base")
    ours = trainer.base_fingerprint
    if saved != ours:
        raise CheckpointError(
            f"checkpoint step {out['meta']['version']} in {ckpt.directory} holds LoRA adapters "
            f"trained over base {saved}, but this run's base is {ours}: resume with the base "
            "the run started from (the same warm-up / init checkpoint), or a fresh workdir"
        )
    trainer.load_state(
        {
            "params": out["params"],
            "opt_state": out["opt_state"],
            "rng": out["rng"],
            "version": out["meta"]["version"],
            "steps_done": out["meta"]["steps_done"],
        }
    )
    return out["orchestrator"]
