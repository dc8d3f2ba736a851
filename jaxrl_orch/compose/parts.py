"""The run's parts, built and checked once: ``build_run(cfg, workdir, role, replicas)``.

What it owns: ``RunParts``, the frozen, typed record every stage of ``run/`` receives instead of
a mutable experiment object: the settings, the workdir (local or ``gs://``), this process's
role, where the run's engine replicas are (``engine_addresses``: their URLs, the weight source,
the API key; empty for one process), the tokenizer and the model config (the run's precision,
attention and remat), the meshes, the environment and its demonstrator, the data sources, the
compilation cache (``compile_cache``, set up before anything else: nothing has compiled yet)
and when the command started (``started``, ``time.monotonic()``: what a restart cost is
measured from).
Stages read it; nothing writes to it. ``build_run`` validates before any work: the mesh shapes
against the devices, the environment, the data (every example checked to fit, ``checks``), the
engine setting, ``Warmup.from_workdir`` and that what this process will listen on may bind
(``replica.check_bind``: a replica's URL, trainer process 0's weight server). What a stage
builds later (the engine, a trainer) comes from the builders in ``engines`` and ``trainers``,
fed from the parts.

Never: holds a built engine or trainer (those belong to the stage that runs them), or reads a
setting a stage could be handed.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from etils import epath

from jaxrl_orch.compose.checks import check_examples
from jaxrl_orch.compose.compile_cache import CompileCache, use_compile_cache
from jaxrl_orch.compose.data import DataSources, build_data
from jaxrl_orch.compose.engines import engine_factory, engine_limits
from jaxrl_orch.compose.model import build_model, tokenizer_spec
from jaxrl_orch.compose.placement import Placement, build_placement, group_placement
from jaxrl_orch.compose.replica import check_bind
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import Replicas
from jaxrl_orch.distributed.group import Role
from jaxrl_orch.envs.base import RunEnv, make_env
from jaxrl_orch.envs.demonstrator import MixedDemonstrator
from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.models.tokenizer import Tokenizer
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.paths import Pathish, as_path
from jaxrl_orch.trainer.sft import sft_sample
from jaxrl_orch.types import Sample


@dataclasses.dataclass(frozen=True)
class RunParts:
    """Everything a stage of the run reads (see the module docstring)."""

    cfg: TrainConfig
    workdir: epath.Path
    role: Role
    engine_addresses: Replicas
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    placement: Placement
    env: RunEnv
    demonstrator: MixedDemonstrator | None
    data: DataSources
    compile_cache: CompileCache
    started: float

    @property
    def sampled_eval(self) -> str:
        """Eval-env name of the held-out set sampled at the training temperature."""
        return f"{self.env.name}@t{self.cfg.rl.temperature:g}"

    def sft_sample(self, ex: dict[str, Any]) -> Sample:
        """A warm-up sample: the prompt, then the demonstrator's completion and EOS."""
        answer = self.tokenizer.encode(self.demonstrator.completion(ex))
        return sft_sample(self.env.prompt_ids(ex), [*answer, self.tokenizer.eos_id])

    def sft_batches(self) -> Iterator[list[Sample]]:
        while True:
            source = self.data.sft
            yield [
                self.sft_sample(source.next_example()) for _ in range(self.cfg.warmup.batch_size)
            ]


def build_run(
    cfg: TrainConfig,
    workdir: Pathish,
    role: Role,
    engine_addresses: Replicas = Replicas(),
    started: float | None = None,
) -> RunParts:
    """The run's parts, every check done (see the module docstring). ``started``: when the
    command started (``time.monotonic()``); None: now."""
    started = time.monotonic() if started is None else started
    compile_cache = use_compile_cache(cfg.processes.compile_cache, cfg.processes.keep_executables)
    check_bind(engine_addresses, role)  # before minutes of building, not after
    tokenizer, model_cfg = build_model(cfg)
    if role.kind == "single":
        placement = build_placement(cfg, len(jax.devices()))
    else:
        placement = group_placement(cfg, role)
    env = make_env(cfg.data.env, tokenizer=tokenizer, **env_kwargs(cfg))
    wants_demos = cfg.warmup.steps or cfg.warmup.demonstrations or cfg.rl.after_warmup == "sft"
    # A warm-up copied from another run needs no demonstrations (an env may have none).
    if cfg.warmup.from_workdir and not hasattr(env, "reference_completion"):
        wants_demos = False
    demonstrator = MixedDemonstrator(env, cfg.warmup.demonstrations) if wants_demos else None
    _check_warmup_from(cfg)
    engine_factory(cfg.engine.kind)  # a bad spec fails here, before any work
    parts = RunParts(
        cfg=cfg,
        workdir=as_path(workdir),  # local, or a gs:// URL kept as one
        role=role,
        engine_addresses=engine_addresses,
        tokenizer=tokenizer,
        model_cfg=model_cfg,
        placement=placement,
        env=env,
        demonstrator=demonstrator,
        data=build_data(cfg, env),
        compile_cache=compile_cache,
        started=started,
    )
    recalled = check_examples(parts, engine_limits(cfg).max_prefill_length)
    _announce_data(parts, recalled)
    return parts


def env_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """What ``make_env`` passes the env's constructor besides the tokenizer."""
    if cfg.data.env == "verifiers":
        from jaxrl_orch.envs.vf.env import tokenizer_dir_for

        vf = cfg.verifiers
        # This process's own directory: runs on one machine never write each other's files.
        scratch = Path(tempfile.mkdtemp(prefix="jaxrl_orch_tokenizer_"))
        return {
            "env": vf.env,
            "tokenizer_dir": tokenizer_dir_for(tokenizer_spec(cfg.model), scratch),
            "renderer": vf.renderer,
            "max_prompt_len": engine_limits(cfg).max_prefill_length,
            "holdout_every": vf.holdout_every,
        }
    return {} if cfg.data.instruction is None else {"instruction": cfg.data.instruction}


def _check_warmup_from(cfg: TrainConfig) -> None:
    if (
        cfg.warmup.from_workdir is not None
        and not (as_path(cfg.warmup.from_workdir) / "sft").is_dir()
    ):
        raise ValueError(
            f"warmup_from {cfg.warmup.from_workdir!r} has no sft/ checkpoint directory; name the "
            "workdir of a run whose warm-up finished"
        )


def _announce_data(parts: RunParts, recalled: bool) -> None:
    cfg = parts.cfg
    data = parts.data
    mix = ", ".join(f"{b} {x:.0%}" for b, x in cfg.warmup.demonstrations) or "always right"
    checked = "; every example fits (checked by an earlier start: same data)" if recalled else ""
    stage(
        "data",
        f"{cfg.data.env} on {_dataset_name(parts)}: {len(data.train)} train / {len(data.eval)} "
        f"held-out examples (eval on {cfg.rl.eval_examples}); warm-up demonstrator: {mix}"
        f"{checked}",
    )


def _dataset_name(parts: RunParts) -> str:
    """What the examples come from: the env's own tasks, or ``Data.dataset``."""
    has_own = hasattr(parts.env, "examples")
    return f"{parts.env.name}'s tasks" if has_own else parts.cfg.data.dataset
