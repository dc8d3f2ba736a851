"""The imitation controls of the RL demo: the RL stage's update budget spent on SFT instead.

What it owns: ``run_imitation(parts, params, stop)``, the stage that replaces RL when
``RL.after_warmup = "sft"``. From the same warm-up, it takes exactly as many optimizer
updates as the RL stage would (``rl_steps * minibatches * ppo_epochs``), with the RL stage's
optimizer (learning rate, warmup, AdamW settings), on the demonstrator's completions
(``Warmup.demonstrations``: the warm-up's mixed ones for "imitation alone", ``()`` for clean
ones, the upper bound). It evaluates the held-out split greedy and at the training temperature
before the first update, every ``eval_every`` RL-step equivalents and at the end, through the
same decoding engine and the same ``eval_metrics`` as the RL run, so the controls' rows and
summary keys (``eval/<env>/...``, ``eval_reward_before_rl`` / ``_final``, ``behaviour``) read
exactly like the RL run's and one comparison script reads them all.

Step numbering: row ``step`` is the RL-step equivalent (updates / updates per RL step), so a
control's curve lies on the same x axis as the RL curve it is compared with.

Never: touches the RL stage's checkpoints (a control is a separate workdir started with
``warmup_from``), or changes the environment's reward.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import jax

from jaxrl_orch.compose.engines import build_engine, to_engine
from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.compose.trainers import build_trainer
from jaxrl_orch.envs.base import AtTemperature, close_env
from jaxrl_orch.inference.client import EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import RLEngine
from jaxrl_orch.orchestrator.eval_sink import eval_metrics
from jaxrl_orch.orchestrator.metrics.writers import ConsoleWriter, JsonlWriter
from jaxrl_orch.run.ending import run_coroutine
from jaxrl_orch.run.stop import StopFlag
from jaxrl_orch.run.summary import eval_summary
from jaxrl_orch.trainer.sft import run_sft
from jaxrl_orch.trainer.trainer import Trainer
from jaxrl_orch.types import SamplingParams


async def evaluate(parts: RunParts, client: EngineClient) -> dict[str, float]:
    """Greedy and sampled eval of the held-out examples, keyed as the RL run's eval rows."""
    cfg = parts.cfg
    env = parts.env
    data = parts.data
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.rl.max_new_tokens)
    views = {
        env.name: (env, data.eval),
        parts.sampled_eval: (AtTemperature(env, cfg.rl.temperature), data.sampled_eval),
    }
    metrics: dict[str, float] = {}
    try:
        for name, (view, source) in views.items():
            n = min(cfg.rl.eval_examples, len(source))
            rollouts = await asyncio.gather(
                *(
                    view.run(
                        client, source.example_at(i), group_id=i, episode_id=0, sampling=greedy
                    )
                    for i in range(n)
                )
            )
            for r in rollouts:
                r.env = name
            metrics.update(eval_metrics(name, list(rollouts), pass_threshold=1.0))
    finally:
        await close_env(env)  # each eval runs in a loop of its own
    return metrics


def run_imitation(parts: RunParts, params: Any, stop: StopFlag) -> dict[str, Any]:
    """The SFT control stage (see the module docstring); returns the summary's RL-stage keys."""
    cfg = parts.cfg
    trainer = build_trainer(parts, "sft", cfg.rl.learning_rate, optim_kind="rl", init_params=params)
    mesh = parts.placement.decode_mesh
    engine = build_engine(
        cfg, parts.model_cfg, mesh, parts.tokenizer, programs=parts.compile_cache.program
    ).engine
    first = jax.tree.map(jax.numpy.copy, trainer.params)
    driver = InferenceDriver(engine, to_engine(first, engine), 0)
    writer = JsonlWriter(parts.workdir / "metrics.jsonl")
    evals: dict[int, dict[str, float]] = {}
    t0 = time.perf_counter()
    driver.start()
    try:
        done = _updates(parts, trainer, driver, engine, writer, evals, stop)
    finally:
        driver.stop()
        writer.close()
    return {
        "after_warmup": "sft",
        **eval_summary(evals, parts.env.name, parts.sampled_eval),
        "eval_temperature": cfg.rl.temperature,
        "control_updates": float(done),
        "rl_steps": max(evals),
        "rl_seconds": time.perf_counter() - t0,
    }


def _updates(
    parts: RunParts,
    trainer: Trainer,
    driver: InferenceDriver,
    engine: RLEngine,
    writer: JsonlWriter,
    evals: dict[int, dict[str, float]],
    stop: StopFlag,
) -> int:
    """The control's updates with an eval every ``eval_every`` RL-step equivalents; returns
    how many updates it took."""
    cfg = parts.cfg
    per_step = cfg.rl.minibatches * cfg.rl.ppo_epochs
    updates = cfg.rl.steps * per_step
    every = cfg.rl.eval_every or cfg.rl.steps
    client = EngineClient(driver)
    console = ConsoleWriter(keys=["eval/*/reward_mean", "eval/*/behaviour/*", "sft/loss"])
    done = 0
    while True:
        step = done // per_step
        if step not in evals:
            # A copy: the next SFT step donates the trainer's buffers.
            moved = to_engine(jax.tree.map(jax.numpy.copy, trainer.params), engine)
            driver.swap_params(moved, step).result()
            evals[step] = run_coroutine(evaluate(parts, client))
            writer.write(step, evals[step])
            console.write(step, evals[step])
        if done >= updates or stop.group_requested():  # SIGTERM: end at this eval
            return done
        n = min(every * per_step, updates - done)

        def log(i: int, m: dict[str, float], base: int = done) -> None:
            writer.write((base + i) // per_step, {**m, "sft/update": float(base + i)})

        run_sft(trainer, parts.sft_batches(), n, on_step=log)
        done += n
