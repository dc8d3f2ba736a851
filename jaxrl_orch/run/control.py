"""The imitation controls of the RL demo: the RL stage's update budget spent on SFT instead.

What it owns: ``run_imitation(exp, params)``, the stage that replaces RL when
``TrainConfig.after_warmup = "sft"``. From the same warm-up, it takes exactly as many optimizer
updates as the RL stage would (``rl_steps * minibatches * ppo_epochs``), with the RL stage's
optimizer (learning rate, warmup, AdamW settings), on the demonstrator's completions
(``TrainConfig.demonstrations``: the warm-up's mixed ones for "imitation alone", ``()`` for clean
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

from jaxrl_orch.build.engines import to_engine
from jaxrl_orch.envs.base import AtTemperature
from jaxrl_orch.inference.client import EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.orchestrator.eval_sink import eval_metrics
from jaxrl_orch.orchestrator.metrics.writers import ConsoleWriter, JsonlWriter
from jaxrl_orch.run.summary import eval_summary
from jaxrl_orch.trainer.sft import run_sft
from jaxrl_orch.types import SamplingParams


async def evaluate(exp: Any, client: EngineClient) -> dict[str, float]:
    """Greedy and sampled eval of the held-out examples, keyed as the RL run's eval rows."""
    cfg = exp.cfg
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
    views = {
        exp.env.name: (exp.env, exp.eval_source),
        exp.sampled_eval: (AtTemperature(exp.env, cfg.temperature), exp.sampled_eval_source),
    }
    metrics: dict[str, float] = {}
    for name, (env, source) in views.items():
        n = min(cfg.eval_examples, len(source))
        rollouts = await asyncio.gather(
            *(
                env.run(client, source.example_at(i), group_id=i, episode_id=0, sampling=greedy)
                for i in range(n)
            )
        )
        for r in rollouts:
            r.env = name
        metrics.update(eval_metrics(name, list(rollouts), pass_threshold=1.0))
    return metrics


def run_imitation(exp: Any, params: Any) -> dict[str, Any]:
    """The SFT control stage (see the module docstring); returns the summary's RL-stage keys."""
    cfg = exp.cfg
    per_step = cfg.minibatches * cfg.ppo_epochs
    updates = cfg.rl_steps * per_step
    trainer = exp.make_trainer("sft", cfg.rl_learning_rate, optim_kind="rl", init_params=params)
    engine = exp.make_engine()
    first = jax.tree.map(jax.numpy.copy, trainer.params)
    driver = InferenceDriver(engine, to_engine(first, engine), 0)
    client = EngineClient(driver)
    writer = JsonlWriter(exp.workdir / "metrics.jsonl")
    console = ConsoleWriter(keys=["eval/*/reward_mean", "eval/*/behaviour/*", "sft/loss"])
    evals: dict[int, dict[str, float]] = {}
    every = cfg.eval_every or cfg.rl_steps
    t0 = time.perf_counter()
    driver.start()
    try:
        done = 0
        while True:
            step = done // per_step
            if step not in evals:
                # A copy: the next SFT step donates the trainer's buffers.
                moved = to_engine(jax.tree.map(jax.numpy.copy, trainer.params), engine)
                driver.swap_params(moved, step).result()
                evals[step] = asyncio.run(evaluate(exp, client))
                writer.write(step, evals[step])
                console.write(step, evals[step])
            if done >= updates or exp.stop_requested:  # SIGTERM: end at this eval
                break
            n = min(every * per_step, updates - done)
            batches = exp.sft_batches()

            def log(i: int, m: dict[str, float], base: int = done) -> None:
                writer.write((base + i) // per_step, {**m, "sft/update": float(base + i)})

            run_sft(trainer, batches, n, on_step=log)
            done += n
    finally:
        driver.stop()
        writer.close()
    return {
        "after_warmup": "sft",
        **eval_summary(evals, exp.env.name, exp.sampled_eval),
        "eval_temperature": cfg.temperature,
        "control_updates": float(done),
        "rl_steps": max(evals),
        "rl_seconds": time.perf_counter() - t0,
    }
