"""TrainConfig: every setting of ``python -m jaxrl_orch.train``, in sections, bound by gin.

Each section is a frozen dataclass that gin configures by its own name, read by the code it
names: ``Model`` (the network, its precision and kernels: ``compose.precision``), ``Data`` (the task
and its examples: ``compose.data``), ``Verifiers`` (a verifiers environment: ``compose.parts``),
``Warmup`` (the SFT stage: ``run.warmup``), ``RL`` (the
algorithm, its loss and corrections, optimizer, sampling and evals, in ``config.rl``: ``run.rl``,
``compose.precision``), ``Lora`` (the RL stage's adapters: ``compose.parts``), ``Trainer`` (rows and
the trainer mesh), ``Engine`` (the decoding engine: ``compose.engines``, ``compose.sides``),
``Orchestrator`` (staleness, concurrency and timeouts of the loop: ``TrainConfig.loop``),
``Processes`` (a multi-process layout: ``distributed``, ``compose.replica``) and ``Outputs``
(checkpoints, logging, export). A gin file binds ``RL.steps = 40``; ``TrainConfig`` itself
holds the seed and builds each section from its bindings. An unknown binding fails at parse
time naming it; every value
is checked here, before any work, naming the setting and what is allowed. How a config is made
(gin files and bindings, or settings in code) is ``config.load``.

The defaults are the embedded CPU scenario (tiny byte-level model, bundled reverse-text task);
``configs/*.gin`` override them. Pure: no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import gin

from jaxrl_orch.config.checks import Allowed, check_allowed, require
from jaxrl_orch.config.orchestrator import AGE_POLICIES, OrchestratorConfig
from jaxrl_orch.config.rl import RL

DTYPES = ("float32", "bfloat16")
ATTENTION = ("auto", "einsum", "xla", "chunked", "splash")
REMAT = ("none", "full", "dots", "dots_no_batch")
# The projections an adapter may sit on (models/lora.py's TARGETS; a test keeps them equal).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Model:
    name: str = "tiny-byte"  # a preset name, or an HF checkpoint directory (config.json)
    tokenizer: str = "byte"  # "byte", or a tokenizer.json path / directory holding one
    # accelerator path: precision and kernels (python -m jaxrl_orch.tools.aot checks the fit)
    compute_dtype: str = "auto"  # matmuls, activations; "auto": bfloat16 on TPU/GPU, else float32
    param_dtype: str = "float32"  # the trainer's master weights and Adam moments (or "bfloat16")
    attention: str = "auto"  # auto: splash on TPU, xla on GPU, chunked on CPU; einsum: reference
    remat: str = "none"  # per-block rematerialisation: none, full, dots, dots_no_batch
    scan_layers: bool = False  # trainer forward as one lax.scan over layers (fast TPU compile)

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "compute_dtype": Allowed.one_of("auto", *DTYPES),
        "param_dtype": Allowed.one_of(*DTYPES),
        "attention": Allowed.one_of(*ATTENTION),
        "remat": Allowed.one_of(*REMAT),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Data:
    env: str = "reverse_text"
    instruction: str | None = None  # None: the env's default instruction
    dataset: str = "jaxrl_reverse_text"  # bundled, a prepared tfds name, or text:PATH / *.txt
    eval_dataset: str | None = None  # None: the held-out split of `dataset`
    data_dir: str | None = None
    rl_prompt_pool: int | None = None  # RL prompts from only the first N train examples (a probe)

    ALLOWED: ClassVar[dict[str, Allowed]] = {"rl_prompt_pool": Allowed.at_least(1).or_none()}

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Verifiers:
    """With ``Data.env = 'verifiers'``: the verifiers environment the run trains on (``envs.vf``);
    its taskset supplies the prompts and the held-out split."""

    env: dict | None = None  # the SingleAgentEnvConfig dict (configs/verifiers.gin: VERIFIERS_ENV)
    renderer: str = "default"  # the renderers config for chat turns -> ids (e.g. "qwen3")
    holdout_every: int = 10  # a taskset without a 'split' field holds out every N-th task

    ALLOWED: ClassVar[dict[str, Allowed]] = {"holdout_every": Allowed.at_least(2)}

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Warmup:
    steps: int = 300  # SFT steps before RL (0: RL from the initial or pretrained weights)
    from_workdir: str | None = None  # another workdir whose sft/ checkpoint this run starts from
    batch_size: int = 64
    learning_rate: float = 3e-3
    lr_warmup_steps: int = 10  # linear warmup, then cosine decay to 10% at `steps`
    checkpoint_every: int = 50  # warm-up checkpoints (and one on SIGTERM): resume mid-way
    # Mixed-quality warm-up: (behaviour, share) pairs the demonstrator uses instead of the
    # reference answer for that share of examples (envs/demonstrator.py); () = always right.
    demonstrations: tuple[tuple[str, float], ...] = ()

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "steps": Allowed.at_least(0),
        "batch_size": Allowed.at_least(1),
        "learning_rate": Allowed.above(0),
        "lr_warmup_steps": Allowed.at_least(0),
        "checkpoint_every": Allowed.at_least(1),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Lora:
    """The RL stage trains LoRA adapters of ``rank`` on ``targets``, scaled by ``alpha / rank``,
    over frozen weights (the warm-up's or the imported checkpoint's), held quantized when
    ``quantize`` names a type (QLoRA); rank 0: every weight."""

    rank: int = 0  # adapter rank; 0: the RL stage trains every weight
    alpha: float = 32.0  # an adapter's output is scaled by alpha / rank
    targets: tuple[str, ...] = LORA_TARGETS  # attention q, k, v, o and MLP gate, up, down
    quantize: str = "none"  # QLoRA: the frozen base held as int8 or int4 (models/qlora.py)

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "rank": Allowed.at_least(0).because("0 trains every weight"),
        "alpha": Allowed.above(0),
        "targets": Allowed.some_of(*LORA_TARGETS),
        "quantize": Allowed.one_of("none", "int8", "int4"),
    }

    def __post_init__(self) -> None:
        check_allowed(self)
        object.__setattr__(self, "targets", tuple(self.targets))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Trainer:
    row_len: int = 256  # tokens a packed row holds: one or two bundled reverse-text samples
    # None: one row per sample (the most a batch can need; padding chunks are skipped on
    # device), more if a batch needs more: a fixed shape, compiled once
    rows_per_batch: int | None = None
    chunk_rows: int = 8
    logprob_chunk: int = 0  # log-probs and loss in chunks of this many positions; 0: off
    mesh: tuple[tuple[str, int], ...] = ()  # () with Engine.mesh (): the devices split evenly

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "row_len": Allowed.at_least(2).because("targets are the tokens shifted by one"),
        "rows_per_batch": Allowed.at_least(1).or_none(),
        "chunk_rows": Allowed.at_least(1),
        "logprob_chunk": Allowed.at_least(0),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Engine:
    kind: str = "builtin"  # "builtin", or "package.module:factory" for a JetStream-shaped engine
    slots: int = 32  # concurrent decodes (continuous batching)
    max_target_length: int = 256  # KV cache positions: prompt plus completion
    steps_per_call: int = 8
    # run every prompt bucket's prefill and every decode width once before the first rollout,
    # so nothing compiles mid-run (JetStream's model warm-up)
    warmup: bool = True
    mesh: tuple[tuple[str, int], ...] = ()
    param_dtype: str | None = None  # the engine's copy of the weights; None: its compute dtype
    compute_dtype: str | None = None  # the engine's matmuls; None: Model.compute_dtype
    # S >= 1, engine in this process: "overlapped" (generate while training), "sliced" (the
    # engine pauses during train steps) or "auto" (where they share cores: measure, keep faster)
    overlap: str = "auto"
    # serve the policy being trained on http://127.0.0.1:PORT (vLLM's RL API and OpenAI's, each
    # response naming its policy version) for evals and agents; None: off, 0: any free port
    serve_port: int | None = None

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "slots": Allowed.at_least(1),
        "max_target_length": Allowed.at_least(2).because("a prompt token and a generated one"),
        "steps_per_call": Allowed.at_least(1),
        "param_dtype": Allowed.one_of(None, *DTYPES),
        "compute_dtype": Allowed.one_of(None, *DTYPES),
        "overlap": Allowed.one_of("auto", "overlapped", "sliced"),
        "serve_port": Allowed.between(0, 65535).or_none(),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


# The loop's own defaults and checks (config/orchestrator.py) are the only ones: the section
# takes its defaults from there and TrainConfig checks it by building the loop's settings.
_LOOP = {f.name: f.default for f in dataclasses.fields(OrchestratorConfig)}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Orchestrator:
    max_staleness: int = _LOOP["max_staleness"]  # S: trained rollouts at most S versions old
    age_policy: str = _LOOP["age_policy"]  # admit, drop or pace (DESIGN.md section 4)
    max_concurrent: int | None = _LOOP["max_concurrent"]  # rollouts in flight; None: (S+1) * batch
    stall_timeout_s: float = _LOOP["stall_timeout_s"]  # nothing landed, shipped or trained: fail
    env_timeout_s: float = _LOOP["env_timeout_s"]  # one rollout (generation + env) longer: cancel
    drain_timeout_s: float = _LOOP["drain_timeout_s"]  # SIGTERM: in-flight work past it cancelled
    loop_block_warn_s: float = _LOOP["loop_block_warn_s"]  # the event loop blocked longer: named

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "max_staleness": Allowed.at_least(0),
        "age_policy": Allowed.one_of(*AGE_POLICIES),
        "max_concurrent": Allowed.at_least(1).or_none(),
        "stall_timeout_s": Allowed.above(0).or_none(),
        "env_timeout_s": Allowed.above(0).or_none(),
        "drain_timeout_s": Allowed.above(0),
        "loop_block_warn_s": Allowed.above(0).or_none(),
    }

    def __post_init__(self) -> None:
        check_allowed(self)

    @property
    def synchronous(self) -> bool:
        """S = 0: every batch trains on the version that generated it; generation and training
        never overlap (the baseline that tells an algorithm bug from an asynchrony bug)."""
        return self.max_staleness == 0


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Processes:
    # a trainer group of this many jax.distributed processes (SPMD over one mesh spanning them;
    # process 0 also runs the orchestrator) ...
    trainer_processes: int = 1
    # ... and this many engine replicas, each its own process serving the HTTP API; 0: the
    # engine lives in the trainer's process (jaxrl-launch-local starts both)
    engine_replicas: int = 0
    colocated: bool | None = None  # engine and trainer on one set of devices; None: iff 1 device
    weight_pull_timeout_s: float = 120.0  # a replica's pull of a new version longer: it fails
    # a weight update's request (and its offer) outlives the pull's deadline by this, for the
    # swap; a replica silent past both is lost
    weight_load_extra_s: float = 30.0
    replica_warmup_s: float = 900.0  # the same for a replica's first update: it compiles its engine
    replica_start_timeout_s: float = 600.0  # a replica silent this long at the start: the run fails
    replica_probe_timeout_s: float = 5.0  # a start-up health probe unanswered this long: sent again
    replica_request_timeout_s: float = 600.0  # one generate request to a replica longer: an error
    # a live replica that answers no health probe for this long (stopped, wedged) is lost like a
    # dead one: its groups move to the other replicas, and it rejoins once it answers; >= 1, as
    # the probes run once a second
    replica_health_timeout_s: float = 20.0
    tpu_topology: str | None = None  # the slice this config is sized for, e.g. "v5e:2x4" (aot)

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "trainer_processes": Allowed.at_least(1),
        "engine_replicas": Allowed.at_least(0),
        "weight_pull_timeout_s": Allowed.above(0),
        "weight_load_extra_s": Allowed.above(0),
        "replica_warmup_s": Allowed.above(0),
        "replica_start_timeout_s": Allowed.above(0),
        "replica_probe_timeout_s": Allowed.above(0),
        "replica_request_timeout_s": Allowed.above(0),
        "replica_health_timeout_s": Allowed.at_least(1).because("replicas are probed each second"),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Outputs:
    checkpoint_every: int = 10  # RL steps between two checkpoints (and one at the end)
    max_to_keep: int = 2  # RL checkpoints kept
    log_interval_s: float = 30.0  # component gauges to gauges.jsonl and TensorBoard
    # Weights & Biases (pip install 'jaxrl-orch[wandb]'): off while wandb_project is None
    wandb_project: str | None = None
    wandb_run_name: str | None = None  # None: the workdir's name
    wandb_mode: str | None = None  # "online", "offline", "disabled"; None: W&B's own (WANDB_MODE)
    export_hf: bool = True  # write the final policy as an HF checkpoint to WORKDIR/export

    ALLOWED: ClassVar[dict[str, Allowed]] = {
        "checkpoint_every": Allowed.at_least(1),
        "max_to_keep": Allowed.at_least(1),
        "log_interval_s": Allowed.above(0),
        "wandb_mode": Allowed.one_of(None, "online", "offline", "disabled"),
    }

    def __post_init__(self) -> None:
        check_allowed(self)


SECTIONS = (
    Model,
    Data,
    Verifiers,
    Warmup,
    RL,
    Lora,
    Trainer,
    Engine,
    Orchestrator,
    Processes,
    Outputs,
)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0  # every random choice of the run (init, data order, sampling) derives from it
    model: Model = dataclasses.field(default_factory=Model)
    data: Data = dataclasses.field(default_factory=Data)
    verifiers: Verifiers = dataclasses.field(default_factory=Verifiers)
    warmup: Warmup = dataclasses.field(default_factory=Warmup)
    rl: RL = dataclasses.field(default_factory=RL)
    lora: Lora = dataclasses.field(default_factory=Lora)
    trainer: Trainer = dataclasses.field(default_factory=Trainer)
    engine: Engine = dataclasses.field(default_factory=Engine)
    orchestrator: Orchestrator = dataclasses.field(default_factory=Orchestrator)
    processes: Processes = dataclasses.field(default_factory=Processes)
    outputs: Outputs = dataclasses.field(default_factory=Outputs)

    def __post_init__(self) -> None:
        """The checks that span two sections."""
        rl, trainer = self.rl, self.trainer
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
            self.lora.quantize == "none" or self.lora.rank > 0,
            f"Lora.quantize = {self.lora.quantize!r} quantizes a LoRA run's frozen base; set "
            f"Lora.rank > 0 (got {self.lora.rank}) or Lora.quantize = 'none'",
        )
        self._check_verifiers()
        multiple = trainer.chunk_rows * rl.minibatches
        require(
            trainer.rows_per_batch is None or trainer.rows_per_batch % multiple == 0,
            f"Trainer.rows_per_batch ({trainer.rows_per_batch}) must be None or a multiple of "
            f"Trainer.chunk_rows * RL.minibatches = {multiple}: a step trains whole chunks",
        )
        _ = self.loop  # the loop's own checks: age policy, staleness, concurrency, timeouts

    def _check_verifiers(self) -> None:
        data, vf = self.data, self.verifiers
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
            request_seed=self.seed,  # a run's samples do not depend on its replica count
        )
