"""The RL stage: asynchronous RL from the warm-up's params, resumable, on one event loop.

What it owns: ``run_rl(parts, params, stop)``, which builds the stage's parts in dependency order
(no part is attached to another after it is built) and drives them:

1. the engine (``compose.engines.build_engine``: whether it reports log-probs decides the
   trainer's step);
2. a trainer group's peer (``Role.follows``) builds its trainer, restores the newest checkpoint
   onto it and follows the leader's steps (``compose.peer.follow``); nothing below is its;
3. the engine side's plan (``compose.sides.side_plan``: the overlap schedule, or the group's
   channel), whose step hooks the trainer is built with; then the trainer on the warm-up's
   params, the newest RL checkpoint restored onto it, and the side built from the trainer
   (the engine starts on the restored weights, so no rollout comes from older ones);
4. the history trimmed to the restored step, the orchestrator (``compose.orchestrator``) with
   the weight path's publisher, the side's pool and swap, the step times and the restart clock
   (``restart``: the first rollout's and the first step's seconds), restored too;
5. the weight path (``compose.weights.WeightPath``: move, checkpoint, publish on the trainer's
   thread), handed to the trainer when it starts.

Then the loop runs to its last step or a drain (SIGTERM: ``StopFlag`` polled on the loop), the
final checkpoint is written with the orchestrator's final state, the final eval is announced,
the policy exported, and the summary's RL keys returned. A failure of trainer process 0, once
its trainer thread is stopped, is passed to the group's peers (``side.abort``) so they exit too.

Never: sets a hook on a part after it is built, or reads a setting a part was built with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

from jaxrl_orch.compose.engines import BuiltEngine, build_engine, engine_notes
from jaxrl_orch.compose.orchestrator import Backend, SinkSettings, Workload, build_orchestrator
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.peer import follow
from jaxrl_orch.compose.sides import EngineSide, side_plan
from jaxrl_orch.compose.staging import GroupStaging
from jaxrl_orch.compose.trainers import build_trainer
from jaxrl_orch.compose.weights import StepTimes, WeightPath
from jaxrl_orch.envs.base import AtTemperature, close_env
from jaxrl_orch.orchestrator.components import LoopHooks
from jaxrl_orch.orchestrator.dispatcher.dispatch import EvalPlan
from jaxrl_orch.orchestrator.loop import Orchestrator
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from jaxrl_orch.run.ending import freeze_heap
from jaxrl_orch.run.export import export_policy
from jaxrl_orch.run.harness_eval import HarnessEvals, harness_evals
from jaxrl_orch.run.history import rl_evals, rl_summary, trim_for_rl
from jaxrl_orch.run.restart import RestartClock
from jaxrl_orch.run.stop import StopFlag
from jaxrl_orch.run.summary import eval_line, merge_evals
from jaxrl_orch.run.telemetry import rl_telemetry
from jaxrl_orch.trainer.checkpoint import Checkpointer, restore_trainer, save_trainer
from jaxrl_orch.trainer.trainer import StepHooks, Trainer
from jaxrl_orch.types import PolicyHandle, SamplingParams

SNAPSHOT_TIMEOUT_S = 60.0  # the event loop hands the trainer thread the orchestrator's state


async def run_rl(parts: RunParts, sft_params: Any, stop: StopFlag) -> dict[str, Any]:
    cfg = parts.cfg
    built = build_engine(
        cfg,
        parts.model_cfg,
        parts.placement.decode_mesh,
        parts.tokenizer,
        programs=parts.compile_cache.program,
    )
    if cfg.engine.kind != "builtin":
        stage("engine", engine_notes(built.engine, cfg.engine.kind, built.recompute))
    if parts.role.follows:
        return _follow(parts, built, sft_params)
    plan = side_plan(parts, built)
    trainer = _trainer(parts, built, sft_params, plan.hooks)
    ckpt = _checkpointer(parts)
    try:
        orch_state = restore_trainer(ckpt, trainer) if ckpt.latest_step() is not None else {}
        side = plan.side(trainer)
        try:
            return await _lead(parts, built, side, trainer, ckpt, orch_state, stop)
        except BaseException as exc:  # the trainer thread is stopped: the peers may be told
            side.abort(f"{type(exc).__name__}: {exc}")
            raise
    finally:
        ckpt.close()


def _trainer(parts: RunParts, built: BuiltEngine, sft_params: Any, hooks: StepHooks) -> Trainer:
    lr = parts.cfg.rl.learning_rate
    recompute = built.recompute
    return build_trainer(parts, "rl", lr, recompute=recompute, init_params=sft_params, hooks=hooks)


def _checkpointer(parts: RunParts) -> Checkpointer:
    return Checkpointer(parts.workdir / "checkpoints", max_to_keep=parts.cfg.outputs.max_to_keep)


def _follow(parts: RunParts, built: BuiltEngine, sft_params: Any) -> dict[str, Any]:
    """A peer of the trainer group: the leader's steps, in lockstep, from the same restore."""
    trainer = _trainer(parts, built, sft_params, StepHooks())
    ckpt = _checkpointer(parts)
    try:
        if ckpt.latest_step() is not None:
            restore_trainer(ckpt, trainer)
        return follow(trainer, ckpt, GroupStaging.of(trainer, built.engine))
    finally:
        ckpt.close()


async def _lead(
    parts: RunParts,
    built: BuiltEngine,
    side: EngineSide,
    trainer: Trainer,
    ckpt: Checkpointer,
    orch_state: dict[str, Any],
    stop: StopFlag,
) -> dict[str, Any]:
    """Trainer process 0 (or the only process): the orchestrator and the weight path."""
    cfg = parts.cfg
    start_step = trainer.version + 1
    eval_at_start = _eval_at_start(parts, start_step)
    _trim_history(parts, start_step, eval_at_start)
    times = StepTimes(side.engine_seconds, synchronous=cfg.orchestrator.synchronous)
    publisher = InProcessPublisher()
    restart = RestartClock(parts.started, parts.compile_cache)
    # its rows go to the orchestrator's writers, which exist once the orchestrator does
    harness = harness_evals(
        parts, side.live_url, lambda: trainer.version, lambda *row: orch.write_metrics(*row)
    )
    hooks = _hooks(side, times, restart, harness, stop)
    orch = _orchestrator(parts, built, side, trainer, publisher, hooks, eval_at_start)
    if orch_state:
        orch.restore(orch_state)
    path = _weight_path(parts, side, trainer, ckpt, orch, times, publisher, restart)
    await side.start()
    freeze_heap()  # the engine and the trainer the stage built, before the first rollout
    trainer.start(path.on_publish, copy_params=parts.placement.colocated)
    drain = asyncio.ensure_future(_drain_on_stop(stop, orch, cfg.orchestrator.drain_timeout_s))
    t0 = time.perf_counter()
    try:
        await orch.run()
        policy = _finish(side, trainer, ckpt, orch)
        secs = time.perf_counter() - t0
    finally:
        drain.cancel()
        await close_env(parts.env)
        trainer.stop()
        await side.stop()
    names = (parts.env.name, parts.sampled_eval)
    summary = rl_summary(parts.workdir, cfg, names, orch, (trainer.version, start_step, secs))
    summary.update(side.summary())
    summary.update(restart.summary())
    if harness is not None:
        summary["harness_eval"] = harness.summary()
    summary["stop"] = stop.report(cfg.orchestrator.drain_timeout_s)
    exported = export_policy(parts, **policy) if cfg.outputs.export_hf else None
    summary["export_dir"] = None if exported is None else str(exported)
    return summary


def _weight_path(
    parts: RunParts,
    side: EngineSide,
    trainer: Trainer,
    ckpt: Checkpointer,
    orch: Orchestrator,
    times: StepTimes,
    publisher: InProcessPublisher,
    restart: RestartClock,
) -> WeightPath:
    """The trainer thread's hops; its checkpoint takes the orchestrator's state from the loop."""
    loop = asyncio.get_running_loop()

    def checkpoint(version: int) -> None:  # the trainer's thread, between two steps
        state = asyncio.run_coroutine_threadsafe(_snapshot(orch), loop).result(SNAPSHOT_TIMEOUT_S)
        side.before_save(version, state)
        save_trainer(ckpt, trainer, version, state, between_steps=True)
        ckpt.wait()  # the next step donates these arrays: the copy to disk must finish first

    every = parts.cfg.outputs.checkpoint_every
    last = parts.cfg.rl.steps
    return WeightPath(
        side,
        times,
        publisher,
        checkpoint,
        checkpoint_every=every,
        last_step=last,
        on_trained=restart.trained,
    )


def _finish(
    side: EngineSide, trainer: Trainer, ckpt: Checkpointer, orch: Orchestrator
) -> dict[str, Any]:
    """After the loop: the final checkpoint (the drained orchestrator's state), the final
    eval's line; returns what the export writes (``compose.staging.final_policy``)."""
    trainer.wait_idle()
    ckpt.wait()
    if trainer.version not in ckpt.all_steps() and trainer.version > 0:
        state = orch.state()
        side.before_save(trainer.version, state)
        save_trainer(ckpt, trainer, trainer.version, state)
    ckpt.wait()
    final = merge_evals(orch.eval_history).get(trainer.version, {})
    stage("final eval", eval_line(final))
    return side.final_params()


def _orchestrator(
    parts: RunParts,
    built: BuiltEngine,
    side: EngineSide,
    trainer: Trainer,
    publisher: InProcessPublisher,
    hooks: LoopHooks,
    eval_at_start: bool,
) -> Orchestrator:
    cfg = parts.cfg
    env = parts.env
    sampling = SamplingParams(temperature=cfg.rl.temperature, max_tokens=cfg.rl.max_new_tokens)
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.rl.max_new_tokens)
    views = {env.name: env, parts.sampled_eval: AtTemperature(env, cfg.rl.temperature)}
    sources = {env.name: parts.data.eval, parts.sampled_eval: parts.data.sampled_eval}
    return build_orchestrator(
        dataclasses.replace(cfg.loop, eval_at_start=eval_at_start),
        PolicyHandle(trainer.version),
        backend=Backend(
            pool=side.pool, trainer=trainer, version_source=publisher, reload_fn=side.swap
        ),
        workload=Workload(
            envs={env.name: env},
            source=parts.data.train,
            sampling=sampling,
            eval_plan=EvalPlan(views, sources, cfg.rl.eval_examples, greedy),
        ),
        sink=SinkSettings(
            algorithm=cfg.rl.algorithm,
            dynamic_sampling=cfg.rl.dynamic_sampling,
            engine_logprobs=built.logprobs,
        ),
        hooks=hooks,
        telemetry=rl_telemetry(parts, side, trainer, trainer.version + 1),
    )


def _hooks(
    side: EngineSide,
    times: StepTimes,
    restart: RestartClock,
    harness: HarnessEvals | None,
    stop: StopFlag,
) -> LoopHooks:
    def on_step(step: int, state: dict[str, Any]) -> None:
        times.on_ship(step, state)
        if harness is not None:
            harness.after_step(step)

    async def before_close(finished: bool) -> None:
        # The last harness run scores the live server, which the stage stops after the loop;
        # neither a stop signal's drain bound nor a failing run waits for one.
        if harness is not None:
            await harness.close(abort=stop.is_set() or not finished)

    return LoopHooks(
        on_step=on_step,
        step_metrics=times.step_metrics,
        engine_held=side.held,
        on_landed=restart.landed,
        on_recovered=restart.recovered,
        before_close=before_close,
    )


def _eval_at_start(parts: RunParts, start_step: int) -> bool:
    """Whether this start evaluates the policy it starts from: not on a resume whose restored
    version's eval is already on record for every view (a restart then reaches its first train
    step without the engine's time for it)."""
    if not parts.cfg.loop.eval_at_start:
        return False
    if start_step == 1:
        return True
    recorded = rl_evals(parts.workdir).get(start_step - 1, {})
    views = (parts.env.name, parts.sampled_eval)
    return not all(any(k.startswith(f"eval/{v}/") for k in recorded) for v in views)


def _trim_history(parts: RunParts, start_step: int, eval_at_start: bool) -> None:
    """Rows an interrupted attempt wrote past the restored step are written again."""
    dropped = trim_for_rl(parts.workdir, start_step, eval_at_start)
    if any(dropped.values()):
        what = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in dropped.items())
        stage("resume", f"at step {start_step}; the earlier attempt's rows past it: {what}")


async def _snapshot(orch: Orchestrator) -> dict[str, Any]:
    return orch.checkpoint_state()


async def _drain_on_stop(stop: StopFlag, orch: Orchestrator, timeout_s: float) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await stop.wait()
        orch.request_drain(timeout_s)
