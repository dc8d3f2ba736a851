"""TrainConfig: every setting of ``python -m jaxrl_orch.train``, in sections, bound by gin.

Each section is a frozen dataclass that gin configures by its section name, read by the code it
names: ``Model`` (the network, its precision and kernels: ``compose.model``,
``compose.precision``), ``Data`` (the task and its examples: ``compose.data``), ``Verifiers``
(a verifiers environment: ``compose.parts``), ``Warmup`` (the SFT stage: ``run.warmup``), ``RL``
(the algorithm, optimizer, sampling and evals, and ``RL.loss``, the ``Loss`` section:
``config.rl``), ``HarnessEval`` (lm-eval tasks scored while it trains: ``run.harness_eval``,
``config.rl``), ``Lora`` (the RL stage's adapters: ``models.lora_config``), ``Trainer`` (rows and
the trainer mesh), and the runtime sections ``Engine``, ``Orchestrator``, ``Processes`` and
``Outputs`` (``config.runtime``). A gin file binds ``RL.steps = 40``; ``TrainConfig`` itself
holds the seed and builds each section from its bindings.

Every field states its default, range and meaning once, on itself (``jaxrl_orch.settings``):
the section's check and ``--list_config`` (``config.listing``) read the same declaration. An
unknown binding fails at parse time naming it (``config.load``); every value is checked here,
before any work, naming the setting and what is allowed; the conditions that span two sections
are ``TrainConfig``'s own.

The defaults are the embedded CPU scenario (tiny byte-level model, bundled reverse-text task);
``configs/*.gin`` override them. Pure: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import gin

from jaxrl_orch.config.orchestrator import OrchestratorConfig
from jaxrl_orch.config.rl import HarnessEvalSettings, Loss, RLSettings
from jaxrl_orch.config.runtime import (
    DTYPES,
    EngineSettings,
    OrchestratorSettings,
    OutputsSettings,
    ProcessesSettings,
)
from jaxrl_orch.config.section import bind, section
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.settings import Allowed, check_settings, require, setting

ATTENTION = ("auto", "einsum", "xla", "chunked", "splash")
REMAT = ("none", "full", "dots", "dots_no_batch")
Lora = bind(LoraConfig)


@section("Model")
class ModelSettings:
    name: str = setting(
        "tiny-byte",
        "a preset name, or an HF checkpoint directory (config.json), local or gs://",
    )
    tokenizer: str | None = setting(
        None,
        "None: the checkpoint's own (tokenizer.json, chat template) when Model.name is one, else "
        "'byte'; or 'byte', or a tokenizer.json path / a directory holding one (local or gs://)",
    )
    random_init: bool = setting(
        False,
        "start a preset of a published model (qwen*, llama*) from random weights; without it "
        "such a preset is refused: name its checkpoint in Model.name",
    )
    compute_dtype: str = setting(
        "auto",
        "matmuls and activations; 'auto': bfloat16 on TPU/GPU, else float32 (python -m "
        "jaxrl_orch.tools.aot checks the fit)",
        Allowed.one_of("auto", *DTYPES),
    )
    param_dtype: str = setting(
        "float32", "the trainer's master weights and Adam moments", Allowed.one_of(*DTYPES)
    )
    attention: str = setting(
        "auto",
        "'auto': splash on TPU, xla on GPU, chunked on CPU; 'einsum': the reference",
        Allowed.one_of(*ATTENTION),
    )
    remat: str = setting(
        "none",
        "per-block rematerialisation: none, full, dots, dots_no_batch",
        Allowed.one_of(*REMAT),
    )
    scan_layers: bool = setting(
        False, "trainer forward as one lax.scan over layers (fast TPU compile)"
    )


@section("Data")
class DataSettings:
    env: str = setting(
        "reverse_text",
        "the environment: a bundled one, 'verifiers', or 'package.module:factory'",
    )
    instruction: str | None = setting(None, "the prompt's instruction; None: the env's default")
    dataset: str = setting(
        "jaxrl_reverse_text", "bundled, a prepared tfds name, or text:PATH / *.txt"
    )
    eval_dataset: str | None = setting(None, "None: the held-out split of `dataset`")
    data_dir: str | None = setting(None, "where prepared tfds datasets live; None: tfds' default")
    rl_prompt_pool: int | None = setting(
        None,
        "RL prompts from only the first N train examples (a probe); None: all",
        Allowed.at_least(1).or_none(),
    )


@section("Verifiers")
class VerifiersSettings:
    """With ``Data.env = 'verifiers'``: the verifiers environment the run trains on (``envs.vf``);
    its taskset supplies the prompts and the held-out split."""

    env: dict | None = setting(
        None, "the SingleAgentEnvConfig dict (configs/verifiers.gin: VERIFIERS_ENV)"
    )
    renderer: str = setting("default", "the renderers config for chat turns -> ids (e.g. 'qwen3')")
    holdout_every: int = setting(
        10, "a taskset without a 'split' field holds out every N-th task", Allowed.at_least(2)
    )


@section("Warmup")
class WarmupSettings:
    steps: int = setting(
        300,
        "SFT steps before RL (0: RL from the initial or pretrained weights)",
        Allowed.at_least(0),
    )
    from_workdir: str | None = setting(
        None, "another workdir whose sft/ checkpoint this run starts from"
    )
    batch_size: int = setting(64, "examples per SFT step", Allowed.at_least(1))
    learning_rate: float = setting(3e-3, "the warm-up's peak learning rate", Allowed.above(0))
    lr_warmup_steps: int = setting(
        10, "linear warmup, then cosine decay to 10% at `steps`", Allowed.at_least(0)
    )
    checkpoint_every: int = setting(
        50, "warm-up checkpoints (and one on SIGTERM): resume mid-way", Allowed.at_least(1)
    )
    demonstrations: tuple[tuple[str, float], ...] = setting(
        (),
        "a mixed-quality warm-up: (behaviour, share) pairs the demonstrator uses instead of the "
        "reference answer for that share of examples (envs/demonstrator.py); (): always right",
    )


@section("Trainer")
class TrainerSettings:
    row_len: int = setting(
        256,
        "tokens a packed row holds: one or two bundled reverse-text samples",
        Allowed.at_least(2).because("targets are the tokens shifted by one"),
    )
    rows_per_batch: int | None = setting(
        None,
        "rows of every batch; None: one row per sample (the most a batch can need; padding "
        "chunks are skipped on device), more if a batch needs more: a fixed shape, compiled once",
        Allowed.at_least(1).or_none(),
    )
    chunk_rows: int = setting(8, "rows a gradient-accumulation chunk holds", Allowed.at_least(1))
    logprob_chunk: int = setting(
        0, "log-probs and loss in chunks of this many positions; 0: off", Allowed.at_least(0)
    )
    mesh: tuple[tuple[str, int], ...] = setting(
        (),
        "the trainer mesh as ((axis, size), ...); () with Engine.mesh (): the devices split evenly",
    )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    SECTION: ClassVar[str] = "TrainConfig"

    seed: int = setting(
        0, "every random choice of the run (init, data order, sampling) derives from it"
    )
    model: ModelSettings = dataclasses.field(default_factory=ModelSettings)
    data: DataSettings = dataclasses.field(default_factory=DataSettings)
    verifiers: VerifiersSettings = dataclasses.field(default_factory=VerifiersSettings)
    warmup: WarmupSettings = dataclasses.field(default_factory=WarmupSettings)
    rl: RLSettings = dataclasses.field(default_factory=RLSettings)
    harness_eval: HarnessEvalSettings = dataclasses.field(default_factory=HarnessEvalSettings)
    lora: LoraConfig = dataclasses.field(default_factory=Lora)
    trainer: TrainerSettings = dataclasses.field(default_factory=TrainerSettings)
    engine: EngineSettings = dataclasses.field(default_factory=EngineSettings)
    orchestrator: OrchestratorSettings = dataclasses.field(default_factory=OrchestratorSettings)
    processes: ProcessesSettings = dataclasses.field(default_factory=ProcessesSettings)
    outputs: OutputsSettings = dataclasses.field(default_factory=OutputsSettings)

    def __post_init__(self) -> None:
        """The checks that span two sections."""
        check_settings(self)
        rl = self.rl
        trainer = self.trainer
        require(
            rl.max_new_tokens < trainer.row_len,
            f"RL.max_new_tokens ({rl.max_new_tokens}) must be < Trainer.row_len "
            f"({trainer.row_len}): a rollout is its prompt plus up to max_new_tokens tokens",
        )
        require(
            not (self.processes.engine_replicas and rl.after_warmup == "sft"),
            "RL.after_warmup='sft' (the imitation control) runs in one process; set "
            f"Processes.engine_replicas = 0 (got {self.processes.engine_replicas})",
        )
        require(
            not (self.processes.engine_replicas and self.engine.serve_port is not None),
            f"Engine.serve_port ({self.engine.serve_port}) serves the engine in the trainer's "
            f"process; with Processes.engine_replicas = {self.processes.engine_replicas} every "
            "replica serves the same API at its own URL: set Engine.serve_port = None",
        )
        require(
            not (self.harness_eval.tasks and self.engine.serve_port is None),
            f"HarnessEval.tasks ({list(self.harness_eval.tasks)}) are scored against the live "
            "policy, and there is none: set Engine.serve_port too (0: any free port)",
        )
        self._check_verifiers()
        multiple = trainer.chunk_rows * rl.minibatches
        require(
            trainer.rows_per_batch is None or trainer.rows_per_batch % multiple == 0,
            f"Trainer.rows_per_batch ({trainer.rows_per_batch}) must be None or a multiple of "
            f"Trainer.chunk_rows * RL.minibatches = {multiple}: a step trains whole chunks",
        )
        _ = self.loop  # the loop's own checks: batch geometry and concurrency

    def _check_verifiers(self) -> None:
        data = self.data
        vf = self.verifiers
        if data.env != "verifiers":
            return
        require(
            vf.env is not None,
            "Data.env = 'verifiers' needs the environment: bind VERIFIERS_ENV (configs/"
            "verifiers.gin), e.g. VERIFIERS_ENV = {'taskset': {'id': 'jaxrl-reverse-text'}}",
        )
        require(
            data.instruction is None,
            f"Data.instruction ({data.instruction!r}) does not apply to a verifiers environment: "
            "its taskset writes the prompts; set Data.instruction = None",
        )

    @property
    def loop(self) -> OrchestratorConfig:
        """The orchestrator loop's own settings, from the RL and Orchestrator sections."""
        o = self.orchestrator
        return OrchestratorConfig(
            max_steps=self.rl.steps,
            batch_size=self.rl.batch_size,
            group_size=self.rl.group_size,
            max_staleness=o.max_staleness,
            max_concurrent=o.max_concurrent,
            age_policy=o.age_policy,
            eval_every=self.rl.eval_every,
            stall_timeout_s=o.stall_timeout_s,
            env_timeout_s=o.env_timeout_s,
            drain_timeout_s=o.drain_timeout_s,
            loop_block_warn_s=o.loop_block_warn_s,
            keep_pending=o.keep_pending,
            request_seed=self.seed,  # a run's samples do not depend on its replica count
        )


__all__ = ["Loss", "Lora", "TrainConfig"]
