"""Experiment: the stage sequence of ``python -m jaxrl_orch.train``, for one workdir.

Owns the workdir layout::

    config.gin          resolved gin config         metrics.jsonl   one row per RL step / eval
    sft/                SFT warm-up checkpoint      gauges.jsonl    periodic component gauges
    checkpoints/        RL checkpoints (orbax)      rollouts/       trained rollouts per step
    tb/                 TensorBoard events          summary.json, report.md, *.png
    export/             final policy as an HF checkpoint (config.json, safetensors, tokenizer)

The workdir is local or a ``gs://`` URL (``paths``). Stages: ``validate`` (meshes, model,
data, every example, the engine: before any work), ``run`` = the warm-up (``warmup.py``), then
RL on an asyncio loop (or the imitation control, ``control.py``), ``finish`` (summary + report).
Settings come from ``build/`` and ``TrainConfig.orchestrator``; the weight path and checkpoint
cadence are ``weights.WeightPath``; the summary is ``history.rl_summary``.

The model is a preset or an HF checkpoint directory: when the run starts fresh (no SFT or RL
checkpoint in the workdir) its safetensors give the initial weights. Eval runs the held-out
split twice per eval step: greedy (``eval/<env>/...``, the headline) and at the training
temperature (``eval/<env>@t<T>/...``). RL checkpoints are taken on the trainer's worker thread
between two optimizer steps, with the orchestrator's state fetched from the event loop; the
last one after the drain. On resume the engine is built with the restored weights, so no
rollout can come from older ones, and the orchestrator restores its state (``restore``).

Several processes (``role``; DESIGN.md section 8, ``roles.py``): an engine replica only serves
(``roles.serve_replica``); a trainer peer runs the same warm-up and then follows process 0's RL
steps (``roles.follow``); process 0 runs every stage, with the replicas as its engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxrl_orch.build import roles
from jaxrl_orch.build.accel import accel_model_config, engine_model_config, step_config
from jaxrl_orch.build.checks import check_examples
from jaxrl_orch.build.engines import (
    check_engine,
    engine_factory,
    engine_notes,
    recompute_old_logprobs,
    reports_logprobs,
)
from jaxrl_orch.build.orchestrator import build_orchestrator
from jaxrl_orch.build.parts import (
    build_data,
    build_placement,
    hf_checkpoint_dir,
    model_config,
    optim_config,
)
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.group import Role, resolve_role
from jaxrl_orch.envs.base import AtTemperature, make_env
from jaxrl_orch.envs.demonstrator import MixedDemonstrator
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.models.hf_import import export_hf_dir, load_hf_checkpoint
from jaxrl_orch.models.tokenizer import load_tokenizer, tokenizer_json_path
from jaxrl_orch.orchestrator.dispatcher.dispatch import EvalPlan
from jaxrl_orch.orchestrator.loop import Orchestrator
from jaxrl_orch.orchestrator.metrics.writers import JsonlWriter, stage
from jaxrl_orch.paths import as_path, copy_tree, is_url
from jaxrl_orch.run.control import run_imitation
from jaxrl_orch.run.history import rl_summary, trim_for_rl
from jaxrl_orch.run.summary import eval_line, merge_evals
from jaxrl_orch.run.telemetry import rl_telemetry
from jaxrl_orch.run.warmup import run_warmup
from jaxrl_orch.tools.report import write_report
from jaxrl_orch.trainer.checkpoint import Checkpointer, restore_trainer, save_trainer
from jaxrl_orch.trainer.sft import sft_sample
from jaxrl_orch.trainer.trainer import Trainer
from jaxrl_orch.types import PolicyHandle, Sample, SamplingParams

TOKENIZER_SIDECARS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


class Experiment:
    def __init__(
        self,
        cfg: TrainConfig,
        workdir: str | os.PathLike,
        role: Role | None = None,
        engine_addresses: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.workdir = as_path(workdir)  # local, or a gs:// URL (kept one: paths.as_path)
        self.role = role or resolve_role(1, 0, None)  # which process of the run this is (group)
        self.engine_addresses = list(engine_addresses)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        # The preset / checkpoint shapes with the run's precision, attention and remat.
        self.model_cfg = accel_model_config(model_config(cfg.model, self.tokenizer), cfg)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.orch: Orchestrator | None = None

    # ------------------------------------------------------------------ setup

    def validate(self) -> None:
        """Fail before any work: mesh shapes vs devices, env, data (built once if bundled)."""
        cfg = self.cfg
        if self.role.kind == "single":
            placement = build_placement(cfg, len(jax.devices()))
        else:
            placement = roles.placement(cfg, self.role)
        self.colocated, self.decode_mesh, self.trainer_mesh = placement
        env_kwargs = {} if cfg.instruction is None else {"instruction": cfg.instruction}
        self.env = make_env(cfg.env, tokenizer=self.tokenizer, **env_kwargs)
        if cfg.sft_steps or cfg.demonstrations or cfg.after_warmup == "sft":
            self.demonstrator = MixedDemonstrator(self.env, cfg.demonstrations)
        data = build_data(cfg)
        self.train_source, self.sft_source = data.train, data.sft
        self.eval_source, self.sampled_eval_source = data.eval, data.sampled_eval
        if cfg.warmup_from is not None and not (as_path(cfg.warmup_from) / "sft").is_dir():
            raise ValueError(
                f"warmup_from {cfg.warmup_from!r} has no sft/ checkpoint directory; name the "
                "workdir of a run whose warm-up finished"
            )
        self.max_prefill = cfg.max_target_length // 2  # the engine's prompt limit
        self.engine_factory = engine_factory(cfg.engine)
        self.engine_logprobs = True  # until make_engine built one that reports none
        self.recompute = recompute_old_logprobs(cfg, True)
        check_examples(self)
        mix = ", ".join(f"{b} {x:.0%}" for b, x in cfg.demonstrations) or "always right"
        stage(
            "data",
            f"{cfg.env} on {cfg.dataset}: {len(self.train_source)} train / "
            f"{len(self.eval_source)} held-out examples (eval on {cfg.eval_examples}); "
            f"warm-up demonstrator: {mix}",
        )

    def write_config(self, text: str) -> None:
        if not self.role.leader:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "config.gin").write_text(text)

    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: stop the SFT loop, or drain the RL loop (checkpoint, exit 0)."""
        self._stop.set()
        if self._loop is not None and self.orch is not None:
            self._loop.call_soon_threadsafe(self.orch.request_drain, self.cfg.drain_timeout_s)

    # ------------------------------------------------------------------ SFT

    def pretrained(self) -> Any:
        """The HF checkpoint's weights when ``TrainConfig.model`` names one, else None."""
        path = hf_checkpoint_dir(self.cfg.model)
        if path is None:
            return None
        mc = self.model_cfg
        _, model = load_hf_checkpoint(path, dtype=mc.dtype, param_dtype=mc.param_dtype)
        return nnx.split(model)[1]

    @property
    def stop_requested(self) -> bool:
        """SIGTERM / Ctrl-C seen (in a trainer group: by process 0, told to all at once)."""
        if self.role.kind == "trainer" and self.role.trainer_processes > 1:
            return bool(multihost_utils.broadcast_one_to_all(np.array(self._stop.is_set())))
        return self._stop.is_set()

    def sft_batches(self) -> Iterator[list[Sample]]:
        while True:
            batch = []
            for _ in range(self.cfg.sft_batch_size):
                batch.append(self.sft_sample(self.sft_source.next_example()))
            yield batch

    def sft_sample(self, ex: dict[str, Any]) -> Sample:
        answer = self.tokenizer.encode(self.demonstrator.completion(ex))
        return sft_sample(self.env.prompt_ids(ex), [*answer, self.tokenizer.eos_id])

    def make_engine(self) -> DecodeEngine:
        """The decoding engine (``TrainConfig.engine``) on the decode mesh, with the run's
        slots and lengths; ``engine_logprobs`` records whether it reports log-probs."""
        cfg = self.cfg
        model_cfg = engine_model_config(self.model_cfg, cfg)  # its dtypes (build/accel.py)
        extra = {"param_dtype": model_cfg.param_dtype} if cfg.engine == "builtin" else {}
        engine = check_engine(self.engine_factory(
            model_cfg,
            **extra,
            mesh=self.decode_mesh,
            max_concurrent_decodes=cfg.decode_slots,
            max_target_length=cfg.max_target_length,
            max_prefill_length=self.max_prefill,
            steps_per_call=cfg.steps_per_call,
            tokenizer=self.tokenizer,
            seed=cfg.seed,
        ), cfg.engine)  # fmt: skip
        self.engine_logprobs = reports_logprobs(engine)
        self.recompute = recompute_old_logprobs(cfg, self.engine_logprobs)
        if cfg.engine != "builtin":
            stage("engine", engine_notes(engine, cfg.engine, self.recompute))
        return engine

    def make_trainer(
        self, kind: str, lr: float, *, optim_kind: str | None = None, **kw: Any
    ) -> Trainer:
        """A trainer for a stage: ``kind`` picks the loss; ``optim_kind`` (default ``kind``)
        the optimizer schedule (the imitation control trains SFT on the RL schedule)."""
        cfg = self.cfg
        optim = optim_config(cfg, optim_kind or kind, lr)
        # recompute: see build.engines (make_engine runs first); the warm-up takes one plain
        # step per batch (minibatches / epochs are RL settings).
        step = step_config(cfg, kind, recompute=self.recompute)
        return Trainer(
            self.model_cfg,
            self.trainer_mesh,
            row_len=cfg.row_len,
            num_rows=cfg.rows_per_batch,
            # A row per sample at most: one shape all run long (no recompiles mid-run).
            min_rows=cfg.batch_size if kind == "rl" else cfg.sft_batch_size,
            step=step,
            optim=optim,
            seed=cfg.seed,
            pad_id=self.tokenizer.pad_id,
            **kw,
        )

    def sft(self, writer: JsonlWriter) -> tuple[Any, dict[str, float]]:
        """The warm-up stage (``warmup.run_warmup``): (params or None when stopped, info)."""
        return run_warmup(self, writer)

    def run(self) -> dict[str, Any]:
        if self.role.kind == "engine":
            return roles.serve_replica(self, self.role, self.engine_addresses[self.role.replica])
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A group's peers take the same warm-up steps (same data, same seed); process 0 writes.
        writer = JsonlWriter(self.workdir / "metrics.jsonl" if self.role.leader else os.devnull)
        try:
            params, info = self.sft(writer)
        finally:
            writer.close()
        summary: dict[str, Any] = {**info, "max_staleness": self.cfg.max_staleness}
        if params is None:
            return summary
        cfg = self.cfg
        if cfg.after_warmup == "sft":
            stage("imitation control", f"SFT for the {cfg.rl_steps} RL steps' updates instead")
            summary.update(run_imitation(self, params))
            return summary
        stage(
            "RL",
            f"{cfg.algorithm}, {cfg.rl_steps} steps of {cfg.prompts_per_step} prompts x "
            f"{cfg.group_size} samples, max_staleness {cfg.max_staleness} ({cfg.age_policy})",
        )
        summary.update(asyncio.run(self._rl(params)))
        return summary

    async def _rl(self, sft_params: Any) -> dict[str, Any]:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()
        engine = self.make_engine()  # first: whether it reports log-probs sets the trainer's step
        trainer = self.make_trainer(
            "rl", cfg.rl_learning_rate, init_params=sft_params, copy_on_publish=self.colocated
        )
        ckpt = Checkpointer(self.workdir / "checkpoints", max_to_keep=cfg.max_to_keep)
        orch_state: dict[str, Any] = {}
        if ckpt.latest_step() is not None:
            orch_state = restore_trainer(ckpt, trainer)
        if not self.role.leader:  # a peer of the trainer group: the leader's steps, in lockstep
            try:
                return roles.follow(self, trainer, ckpt, roles.make_stager(trainer, engine))
            finally:
                ckpt.close()
        start_step = trainer.version + 1
        # Rows an interrupted attempt wrote past the restored step are written again below.
        dropped = trim_for_rl(self.workdir, start_step, cfg.orchestrator.eval_at_start)
        if any(dropped.values()):
            what = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in dropped.items())
            stage("resume", f"at step {start_step}; the earlier attempt's rows past it: {what}")
        path_kw = dict(
            checkpoint_every=cfg.checkpoint_every,
            last_step=cfg.rl_steps,
            checkpoint=lambda v: self._checkpoint_from_trainer_thread(ckpt, trainer, v),
            synchronous=cfg.max_staleness == 0,
        )
        driver, wiring, weights, pool = roles.engine_side(self, engine, trainer, path_kw)
        self._wiring, engines = wiring, (driver or pool)
        sampling = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens)
        greedy = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
        name = self.env.name
        views = {name: self.env, self.sampled_eval: AtTemperature(self.env, cfg.temperature)}
        sources = {name: self.eval_source, self.sampled_eval: self.sampled_eval_source}
        self.orch = orch = build_orchestrator(
            cfg.orchestrator,
            PolicyHandle(trainer.version),
            pool=pool,
            envs={name: self.env},
            source=self.train_source,
            sampling=sampling,
            trainer=trainer,
            version_source=weights.publisher,
            reload_fn=weights.swap,
            algorithm=cfg.algorithm,
            sink_kwargs={
                "dynamic_sampling": cfg.dynamic_sampling,
                "engine_logprobs": self.engine_logprobs,
            },
            eval_plan=EvalPlan(views, sources, cfg.eval_examples, greedy),
            telemetry=rl_telemetry(self, engines, trainer, start_step),
            on_step=weights.on_ship,
            step_metrics=weights.step_metrics,
        )
        if orch_state:
            orch.restore(orch_state)
        if self._stop.is_set():
            orch.request_drain(cfg.drain_timeout_s)
        watch = None
        if wiring is not None:  # every replica holds the trainer's current weights first
            await wiring.pool.start(trainer.version, wiring.move(trainer.params))
            watch = asyncio.ensure_future(wiring.pool.watch())
        else:
            driver.start()
        trainer.start()
        t0 = time.perf_counter()
        try:
            await orch.run()
            trainer.wait_idle()
            ckpt.wait()
            if trainer.version not in ckpt.all_steps() and trainer.version > 0:
                state = orch.state()
                if wiring is not None:
                    wiring.before_save(trainer.version, state)
                save_trainer(ckpt, trainer, trainer.version, state)
            ckpt.wait()
            secs = time.perf_counter() - t0
            final = merge_evals(orch.eval_history).get(trainer.version, {})
            stage("final eval", eval_line(final))
            params = trainer.params if wiring is None else wiring.stop_peers(trainer)
            exported = self._export(params) if cfg.export_hf else None
        finally:
            trainer.stop()
            if driver is not None:
                driver.stop()
            if watch is not None:
                watch.cancel()
                await wiring.pool.close()
            ckpt.close()
        summary = rl_summary(self, orch, trainer.version, start_step, secs)
        if wiring is not None:
            summary["replicas"] = {k.split("/")[1]: v for k, v in wiring.pool.gauges().items()}
        summary["export_dir"] = None if exported is None else str(exported)
        return summary

    def _export(self, params: Any) -> Any:
        """The final policy as an HF checkpoint in ``WORKDIR/export`` (on ``gs://``: written
        locally, then copied up)."""
        dest = self.workdir / "export"
        stage("export", f"the final policy as an HF checkpoint to {dest}")
        tok = None if self.cfg.tokenizer == "byte" else tokenizer_json_path(self.cfg.tokenizer)
        with tempfile.TemporaryDirectory() as local:
            into = local if is_url(dest) else self.workdir
            out = export_hf_dir(params, self.model_cfg, into, tok)
            # The checkpoint's chat template and special tokens travel with its tokenizer.
            for name in TOKENIZER_SIDECARS if tok is not None else ():
                if (src := Path(tok).with_name(name)).is_file():
                    (out / name).write_bytes(src.read_bytes())
            if is_url(dest):
                if dest.exists():
                    dest.rmtree()
                copy_tree(out, dest)
        return dest

    def _checkpoint_from_trainer_thread(self, ckpt: Checkpointer, trainer: Trainer, v: int) -> None:
        async def snapshot() -> dict[str, Any]:
            return self.orch.state()

        state = asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(timeout=60)
        if self._wiring is not None:  # a trainer group: every process saves this step
            self._wiring.before_save(v, state)
        st = trainer.state()
        meta = {"version": st["version"], "steps_done": st["steps_done"]}
        ckpt.save(v, params=st["params"], opt_state=st["opt_state"], rng=st["rng"], meta=meta,
                  orchestrator_state=state)  # fmt: skip
        ckpt.wait()  # the next step donates these arrays: the copy to disk must finish first

    @property
    def sampled_eval(self) -> str:
        """Eval-env name of the held-out set sampled at the training temperature."""
        return f"{self.env.name}@t{self.cfg.temperature:g}"

    def finish(self, summary: dict[str, Any]) -> None:
        if not self.role.leader:
            return
        (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
        write_report(self.workdir)
