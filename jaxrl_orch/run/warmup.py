"""The SFT warm-up stage: run it, continue it, or restore it, with checkpoints along the way.

What it owns: ``run_warmup(parts, writer, stop)``, the stage before RL. Its checkpoint lives in
``WORKDIR/sft`` (one kept). A checkpoint records whether the warm-up was ``complete`` and the
SFT data cursor; so the same command after a SIGTERM or a crash continues from the last
checkpoint (one every ``Warmup.checkpoint_every`` steps, and one at the step a SIGTERM stopped)
with the same data order (rows past the restored step are trimmed from ``metrics.jsonl``,
``history.trim_for_sft``), and a complete warm-up (this run's, or another run's copied via
``Warmup.from_workdir``) is restored and skipped. A fresh warm-up starts from the model's
initial or pretrained weights; a resumed one never reloads them.

Driven by ``stages.run`` on the main thread; the loop body is
``trainer/sft.run_sft``. Returns ``(params, info)``; params are None when a stop was requested
(its progress is on disk).
"""

from __future__ import annotations

import time
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from jaxrl_orch.compose.model import pretrained_params
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.trainers import build_trainer
from jaxrl_orch.orchestrator.metrics.writers import (
    ConsoleWriter,
    JsonlWriter,
    ProgressWriter,
    stage,
)
from jaxrl_orch.paths import as_path, copy_tree
from jaxrl_orch.run.history import trim_for_sft
from jaxrl_orch.run.stop import StopFlag
from jaxrl_orch.trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    restore_trainer,
    save_trainer,
)
from jaxrl_orch.trainer.params import Restoring
from jaxrl_orch.trainer.sft import run_sft
from jaxrl_orch.trainer.trainer import Trainer


def rl_restores_every_weight(parts: RunParts) -> bool:
    """Whether the RL stage will take every weight it trains from its own checkpoint: a resumed
    full fine-tune without a KL reference. The warm-up's weights would only be overwritten
    then (with LoRA they are the frozen base; with ``kl_beta`` the reference policy)."""
    cfg = parts.cfg
    plain = not cfg.lora.rank and cfg.rl.loss.kl_beta == 0 and cfg.rl.after_warmup != "sft"
    return plain and has_steps(parts.workdir / "checkpoints")


def run_warmup(
    parts: RunParts, writer: JsonlWriter, stop: StopFlag, *, weights: bool = True
) -> tuple[Any, dict[str, float]]:
    """The warm-up, or its checkpoint: complete (skip), partial (continue), or none.
    ``weights=False``: a complete warm-up on disk is reported and its arrays are not read: the
    params are ``Restoring()``, the RL trainer's weights coming from its own checkpoint (see
    ``rl_restores_every_weight``)."""
    cfg = parts.cfg
    own = parts.workdir / "sft"
    if cfg.warmup.from_workdir is not None and not has_steps(own) and parts.role.leader:
        # Start from that run's warm-up: copied, so this workdir stays self-contained.
        if own.exists():
            own.rmtree()
        copy_tree(as_path(cfg.warmup.from_workdir) / "sft", own)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("warm-up checkpoint in place")
    ckpt = Checkpointer(own, max_to_keep=1, async_save=False)
    latest = ckpt.latest_step()
    if not weights and _complete_on_disk(ckpt, latest, cfg.warmup.steps):
        ckpt.close()
        if latest is None:
            return Restoring(), {"sft_steps": 0.0}
        held = "not loaded: the RL checkpoint holds every weight"
        stage("warm-up", f"complete after {latest} SFT steps in {own} ({held})")
        return Restoring(), {"sft_steps": float(latest), "sft_restored": 1.0}
    resuming = latest is not None or has_steps(parts.workdir / "checkpoints")
    init = None if resuming else pretrained_params(parts.cfg.model.name)
    trainer = build_trainer(parts, "sft", cfg.warmup.learning_rate, init_params=init)
    info: dict[str, float] = {"sft_steps": float(cfg.warmup.steps)}
    try:
        done = 0
        if latest is not None:
            state = restore_trainer(ckpt, trainer)
            latest = ckpt.latest_step()  # a corrupt newest one was set aside: the restored one
            # Checkpoints without the flag are complete warm-ups (e.g. via warmup_from).
            if state.get("complete", True) or latest >= cfg.warmup.steps:
                stage("warm-up", f"restored after {latest} SFT steps from {own}")
                # The warm-up that was run (e.g. another run's), not the setting.
                info.update(sft_restored=1.0, sft_steps=float(latest))
                return trainer.params, info
            parts.data.sft.restore(state["sft_source"])
            done = latest
            info["sft_resumed_from_step"] = float(latest)
        # Rows an interrupted attempt wrote past the restored step are written again.
        if parts.role.leader:
            trim_for_sft(parts.workdir, done)
        if not cfg.warmup.steps:
            return trainer.params, info
        if parts.demonstrator is None:
            raise ValueError(
                f"the warm-up in {own} stopped at step {done} of Warmup.steps = "
                f"{cfg.warmup.steps}, and env {parts.env.name!r} has no demonstrations to "
                f"continue it; set Warmup.steps = {done} or warm up a run that has them"
            )
        return _train(parts, trainer, ckpt, writer, stop, done, info)
    finally:
        ckpt.close()


def _train(
    parts: RunParts,
    trainer: Trainer,
    ckpt: Checkpointer,
    writer: JsonlWriter,
    stop: StopFlag,
    done: int,
    info: dict[str, float],
) -> tuple[Any, dict[str, float]]:
    """SFT steps ``done + 1 .. sft_steps``, checkpointed on the way (see the docstring)."""
    cfg = parts.cfg
    more = f", continuing after step {done}" if done else ""
    stage("warm-up", f"{cfg.warmup.steps} SFT steps of {cfg.warmup.batch_size} examples{more}")
    t0 = time.perf_counter()
    bar = ProgressWriter(cfg.warmup.steps, initial=done, desc="sft", postfix_keys=["sft/loss"])
    console = ConsoleWriter(keys=["sft/loss", "sft/lr"])
    last = [done]

    def save(i: int, complete: bool) -> None:
        state = {"complete": complete, "sft_source": parts.data.sft.state()}
        save_trainer(ckpt, trainer, i, state)

    def log(i: int, m: dict[str, float]) -> None:
        last[0] = i
        writer.write(i, m)
        bar.write(i, m)
        if i % 25 == 0 or i == cfg.warmup.steps:
            console.write(i, m)
        if i % cfg.warmup.checkpoint_every == 0 and i < cfg.warmup.steps:
            save(i, complete=False)
        if stop.group_requested():
            raise _Stopped

    try:
        hist = run_sft(trainer, parts.sft_batches(), cfg.warmup.steps, start=done, on_step=log)
    except _Stopped:
        if last[0] and last[0] not in ckpt.all_steps():
            save(last[0], complete=last[0] >= cfg.warmup.steps)
        info["sft_steps"] = float(last[0])
        return None, info
    finally:
        bar.close()
    info["sft_seconds"] = time.perf_counter() - t0
    if hist:
        info["sft_final_loss"] = hist[-1]["sft/loss"]
    save(cfg.warmup.steps, complete=True)
    return trainer.params, info


def _complete_on_disk(ckpt: Checkpointer, step: int | None, steps: int) -> bool:
    """Whether the warm-up is complete: none asked for, or checkpoint ``step`` says so in its
    JSON item alone; one that cannot be read is left to the restore, which sets it aside."""
    if step is None:
        return steps == 0
    try:
        state = ckpt.read_state(step)
    except CheckpointError:
        return False
    # Checkpoints without the flag are complete warm-ups (e.g. via warmup_from).
    return bool(state.get("complete", True)) or step >= steps


def has_steps(directory: epath.Path) -> bool:
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


class _Stopped(Exception):
    pass
