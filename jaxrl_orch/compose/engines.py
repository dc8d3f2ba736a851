"""Which decoding engine the run uses, built in one place for the run and for ``jaxrl-aot``.

What it owns: ``build_engine(cfg, model_cfg, mesh, tokenizer)``, the one engine builder: the
engine's limits from ``engine_limits(cfg)`` (slots, cache length, the prefill limit, decode steps
per call: the only place they are read from the settings), its dtypes from ``precision``.
``engine_factory(spec)`` resolves ``Engine.kind``: ``"builtin"`` is
``inference.engine.DecodeEngine``; ``"package.module:callable"`` names a factory called with
the same arguments (``model_config`` positionally; ``mesh``, ``limits`` (an ``EngineLimits``),
``tokenizer``, ``seed`` by keyword) that returns an engine with JetStream's method shape
(``prefill``, ``insert``,
``generate``, ``init_decode_state``, ``max_concurrent_decodes``, ``max_prefill_length``) plus
``param_shardings`` (where the trainer's weights are resharded to). Upstream JetStream's
results carry no log-probs or versions; ``reports_logprobs(engine)`` says whether an engine's
do (``engine.reports_logprobs``, True for the built-in one, False when absent), so the run can
have the trainer recompute the behaviour log-probs instead (``recompute_old_logprobs``).
``to_engine(params, engine)`` moves the trainer's weights onto the engine's shardings, cast to
its weight dtype on the way (``engine.param_dtype``: bf16 on TPU/GPU for the built-in one).

A bad spec fails in ``compose.parts.build_run``, naming the value and the allowed forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from jaxrl_orch.compose.precision import engine_model_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.engine_api import RLEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.inference.requests import accepts
from jaxrl_orch.models.configs import ModelConfig
from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.tokenizer import Tokenizer
from jaxrl_orch.plugins import load_factory
from sharding.reshard import reshard

REQUIRED = ("prefill", "insert", "generate", "init_decode_state", "param_shardings")


@dataclasses.dataclass(frozen=True)
class BuiltEngine:
    """An engine and what the run must know of it: whether it reports behaviour log-probs,
    and so whether the trainer recomputes them (``recompute_old_logprobs``)."""

    engine: RLEngine
    logprobs: bool
    recompute: bool


def engine_limits(cfg: TrainConfig) -> EngineLimits:
    return EngineLimits(
        max_concurrent_decodes=cfg.engine.slots,
        max_target_length=cfg.engine.max_target_length,
        steps_per_call=cfg.engine.steps_per_call,
    )


def build_engine(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    mesh: Mesh,
    tokenizer: Tokenizer,
    backend: str | None = None,
    programs: Callable[[str, str, Any], Any] | None = None,
) -> BuiltEngine:
    """The engine of ``Engine.kind`` on ``mesh`` with the run's limits and dtypes
    (``backend``: the one compiled for, default this process's; ``programs``: the built-in
    engine's programs are called through it, the run's executable store)."""
    engine_cfg = engine_model_config(model_cfg, cfg, backend)
    extra = {}
    if cfg.engine.kind == "builtin":
        extra = {"param_dtype": engine_cfg.param_dtype, "programs": programs}
    factory = engine_factory(cfg.engine.kind)
    limits = engine_limits(cfg)
    engine = factory(
        engine_cfg, **extra, mesh=mesh, limits=limits, tokenizer=tokenizer, seed=cfg.seed
    )
    check_engine(engine, cfg.engine.kind)
    logprobs = reports_logprobs(engine)
    return BuiltEngine(engine, logprobs, recompute_old_logprobs(cfg, logprobs))


def engine_factory(spec: str) -> Callable[..., RLEngine]:
    if spec == "builtin":
        return DecodeEngine
    if ":" not in spec:
        raise ValueError(f"Engine.kind must be 'builtin' or 'package.module:factory', got {spec!r}")
    return load_factory(spec, "Engine.kind")


def check_engine(engine: object, spec: str) -> RLEngine:
    missing = [name for name in REQUIRED if not hasattr(engine, name)]
    if missing:
        raise TypeError(
            f"the engine built by {spec!r} ({type(engine).__name__}) lacks {missing}; an engine "
            f"needs {list(REQUIRED)}"
        )
    return engine


def to_engine(params: Any, engine: RLEngine) -> Any:
    """``params`` on the engine's shardings, cast to its weight dtype first (bf16 on TPU/GPU:
    half the bytes to move). An ``HFCheckpoint`` is read there, each device its own shard."""
    dtype = getattr(engine, "param_dtype", None)
    if isinstance(params, HFCheckpoint):
        return params.load(params.abstract(), engine.param_shardings, dtype=dtype)
    return reshard(params, engine.param_shardings, dtype=dtype)


def reports_logprobs(engine: RLEngine) -> bool:
    return bool(getattr(engine, "reports_logprobs", isinstance(engine, DecodeEngine)))


def recompute_old_logprobs(cfg: TrainConfig, engine_logprobs: bool) -> bool:
    """``RL.recompute_old_logprobs``, or when unset (None) whether the engine reports
    no behaviour log-probs (the trainer's recomputed ones then stand in for them)."""
    setting = cfg.rl.recompute_old_logprobs
    if setting is False and not engine_logprobs:
        raise ValueError(
            f"engine {cfg.engine.kind!r} reports no behaviour log-probs, so "
            "RL.recompute_old_logprobs=False has nothing to take the ratio against: "
            "leave it unset (None) or set True"
        )
    return (not engine_logprobs) if setting is None else bool(setting)


def engine_notes(engine: RLEngine, spec: str, recompute: bool) -> str:
    """What a plugged-in engine does differently, for the run's console header."""
    notes = [f"{spec} ({type(engine).__name__})"]
    if not reports_logprobs(engine):
        notes.append("reports no log-probs: the trainer recomputes them" if recompute else "")
    if not accepts(engine.insert, "sampling"):
        notes.append(
            "takes no per-request sampling: every request, greedy evals included, samples "
            "with the engine's own settings"
        )
    return "; ".join(n for n in notes if n)
