"""TrainConfig: every setting of ``python -m jaxrl_orch.train``, in sections, bound by gin.

Each section is a frozen dataclass that gin configures by its own name, read by the code it
names: ``Model`` (the network, its precision and kernels: ``build.accel``), ``Data`` (the task
and its examples: ``build.parts``), ``Warmup`` (the SFT stage: ``run.warmup``), ``RL`` (the
algorithm, its optimizer, sampling and evals: ``run.rl``, ``build.accel``), ``Trainer`` (rows
and the trainer mesh), ``Engine`` (the decoding engine: ``build.engines``, ``build.sides``),
``Orchestrator`` (staleness, concurrency and timeouts of the loop: ``TrainConfig.loop``),
``Processes`` (a multi-process layout: ``distributed``, ``build.roles``) and ``Outputs``
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

import gin

from jaxrl_orch.config.checks import at_least, one_of, positive, require
from jaxrl_orch.config.orchestrator import OrchestratorConfig

DTYPES = ("float32", "bfloat16")


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

    def __post_init__(self) -> None:
        one_of(self, "compute_dtype", ("auto", *DTYPES))
        one_of(self, "param_dtype", DTYPES)
        one_of(self, "attention", ("auto", "einsum", "xla", "chunked", "splash"))
        one_of(self, "remat", ("none", "full", "dots", "dots_no_batch"))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Data:
    env: str = "reverse_text"
    instruction: str | None = None  # None: the env's default instruction
    dataset: str = "jaxrl_reverse_text"  # bundled, a prepared tfds name, or text:PATH / *.txt
    eval_dataset: str | None = None  # None: the held-out split of `dataset`
    data_dir: str | None = None
    rl_prompt_pool: int | None = None  # RL prompts from only the first N train examples (a probe)

    def __post_init__(self) -> None:
        pool = self.rl_prompt_pool
        require(pool is None or pool >= 1, f"Data.rl_prompt_pool must be >= 1 or None, got {pool}")


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

    def __post_init__(self) -> None:
        at_least(self, 1, "batch_size", "checkpoint_every")
        at_least(self, 0, "steps", "lr_warmup_steps")
        positive(self, "learning_rate")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RL:
    """The RL stage. The off-policy corrections (docs/losses.md; combinable):

    - ``policy_loss``: "ppo" (clipped token surrogate), "gspo" / "gspo_token" (sequence ratio
      clipped to [1 - eps_low, 1 + eps_high]; the paper's eps are 3e-4 / 4e-4) or "cispo".
    - ``eps_low_is`` / ``eps_high_is``: CISPO's weight band [1 - eps_low_is, 1 + eps_high_is].
    - ``icepop``: (a, b) or None: drop tokens whose trainer/engine ratio leaves [a, b].
    - ``mis``: None, "token" or "sequence": rejection sampling on that ratio (or its product).
    - ``mis_bounds``: (low, high), the band of ``mis`` (set exactly when ``mis`` is).
    - ``geo_mask``: (low, high) or None: drop sequences whose geometric-mean ratio leaves it.
    """

    # "rl", or the imitation control "sft": the RL stage's optimizer updates spent on more SFT
    # of the demonstrations instead, evaluated alike (run/control.py)
    after_warmup: str = "rl"
    steps: int = 60
    prompts_per_step: int = 8
    group_size: int = 16
    algorithm: str = "grpo"  # mean-centred GRPO; "permuted:grpo" = its noise-only control
    dynamic_sampling: bool = True  # drop flat groups and wait for groups with signal (DAPO)
    learning_rate: float = 1e-4
    lr_warmup_steps: int = 10  # linear LR warmup (fresh Adam moments on noisy policy gradients)
    temperature: float = 1.0
    max_new_tokens: int = 68
    eps_low: float = 0.2
    eps_high: float = 0.28
    # None: the algorithm's own ("constant" over max_new_tokens for dr_grpo, else "token")
    loss_norm: str | None = None
    # Truncated importance sampling: recompute the trainer's old log-probs before the update
    # and weight each token by min(pi_old / pi_behaviour, tis_cap) (None: no TIS weight).
    # None: only when the engine reports no behaviour log-probs (upstream JetStream's do not).
    recompute_old_logprobs: bool | None = None
    tis_cap: float | None = 2.0
    minibatches: int = 1  # optimizer steps per RL batch (the batch split into this many parts)
    ppo_epochs: int = 1  # passes over the batch per RL step
    kl_beta: float = 0.0
    # The policy term: "ppo" (the clipped token surrogate), "gspo", "gspo_token" or "cispo"
    policy_loss: str = "ppo"
    eps_low_is: float = 1.0  # CISPO weight clipped below at 1 - eps_low_is (1: no lower bound)
    eps_high_is: float = 0.28  # CISPO weight clipped above at 1 + eps_high_is
    # Masks on rho = pi_trainer / pi_behaviour (trainer: the recomputed old log-probs when
    # recompute_old_logprobs, else the current policy); a dropped token's policy term is 0.
    icepop: tuple[float, float] | None = None  # IcePop: drop tokens with rho outside (a, b)
    mis: str | None = None  # rejection sampling (MIS): "token" (rho) or "sequence" (prod rho)
    mis_bounds: tuple[float, float] | None = None  # the (low, high) band of mis
    geo_mask: tuple[float, float] | None = None  # drop sequences: exp(mean log rho) outside
    eval_every: int = 10  # RL steps between two evals of the held-out set (0: first and last)
    eval_examples: int = 128  # held-out examples each eval decodes (greedy, and sampled)

    def __post_init__(self) -> None:
        from jaxrl_orch.algorithms.advantages import get_algorithm

        algorithm = get_algorithm(self.algorithm)  # an unknown name fails, naming the known
        one_of(self, "after_warmup", ("rl", "sft"))
        one_of(self, "loss_norm", (None, "token", "sequence", "constant"))
        token_sum = getattr(algorithm, "token_sum_normalization", False)
        require(
            not token_sum or self.loss_norm in (None, "constant"),
            f"algorithm {self.algorithm!r} normalises the loss by a constant (Dr. GRPO); "
            f"loss_norm {self.loss_norm!r} contradicts it: leave loss_norm unset",
        )
        require(
            self.group_size >= 2,
            f"RL.group_size must be >= 2, got {self.group_size}: group-relative advantages "
            "compare the rollouts of one prompt, so a group of one has none",
        )
        at_least(self, 1, "steps", "prompts_per_step", "minibatches", "ppo_epochs")
        at_least(self, 1, "max_new_tokens", "eval_examples")
        at_least(self, 0, "lr_warmup_steps", "eval_every")
        positive(self, "learning_rate", "temperature")  # T = 0: every sample of a group alike
        self._check_corrections()

    def _check_corrections(self) -> None:
        from jaxrl_orch.algorithms.correction_settings import check_settings

        check_settings(self, prefix="RL.")

    @property
    def batch_size(self) -> int:
        """Rollouts per training batch."""
        return self.prompts_per_step * self.group_size

    @property
    def resolved_loss_norm(self) -> str:
        """``loss_norm``, or the algorithm's own when unset (see the field's comment)."""
        from jaxrl_orch.algorithms.advantages import get_algorithm

        if self.loss_norm is not None:
            return self.loss_norm
        token_sum = getattr(get_algorithm(self.algorithm), "token_sum_normalization", False)
        return "constant" if token_sum else "token"


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

    def __post_init__(self) -> None:
        at_least(self, 0, "logprob_chunk")
        at_least(self, 1, "chunk_rows")
        at_least(self, 2, "row_len")  # targets are the tokens shifted by one
        if self.rows_per_batch is not None:
            at_least(self, 1, "rows_per_batch")


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

    def __post_init__(self) -> None:
        if self.serve_port is not None and not 0 <= self.serve_port <= 65535:
            raise ValueError(f"Engine.serve_port must be None or 0..65535, got {self.serve_port!r}")
        one_of(self, "param_dtype", (None, *DTYPES))
        one_of(self, "compute_dtype", (None, *DTYPES))
        one_of(self, "overlap", ("auto", "overlapped", "sliced"))
        at_least(self, 1, "slots", "steps_per_call")
        at_least(self, 2, "max_target_length")  # a prompt token and a generated one


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
    replica_request_timeout_s: float = 600.0  # one generate request to a replica longer: an error
    # a live replica that answers no health probe for this long (stopped, wedged) is lost like a
    # dead one: its groups move to the other replicas, and it rejoins once it answers; >= 1, as
    # the probes run once a second
    replica_health_timeout_s: float = 20.0
    tpu_topology: str | None = None  # the slice this config is sized for, e.g. "v5e:2x4" (aot)

    def __post_init__(self) -> None:
        at_least(self, 1, "trainer_processes")
        at_least(self, 0, "engine_replicas")
        for name in ("weight_pull_timeout_s", "replica_request_timeout_s"):
            value = getattr(self, name)
            require(value > 0, f"Processes.{name} must be > 0 seconds, got {value}")
        require(
            self.replica_health_timeout_s >= 1,
            "Processes.replica_health_timeout_s must be >= 1 second (replicas are probed once a "
            f"second), got {self.replica_health_timeout_s}",
        )


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

    def __post_init__(self) -> None:
        one_of(self, "wandb_mode", (None, "online", "offline", "disabled"))
        at_least(self, 1, "checkpoint_every", "max_to_keep")
        positive(self, "log_interval_s")


SECTIONS = (Model, Data, Warmup, RL, Trainer, Engine, Orchestrator, Processes, Outputs)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0  # every random choice of the run (init, data order, sampling) derives from it
    model: Model = dataclasses.field(default_factory=Model)
    data: Data = dataclasses.field(default_factory=Data)
    warmup: Warmup = dataclasses.field(default_factory=Warmup)
    rl: RL = dataclasses.field(default_factory=RL)
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
        multiple = trainer.chunk_rows * rl.minibatches
        require(
            trainer.rows_per_batch is None or trainer.rows_per_batch % multiple == 0,
            f"Trainer.rows_per_batch ({trainer.rows_per_batch}) must be None or a multiple of "
            f"Trainer.chunk_rows * RL.minibatches = {multiple}: a step trains whole chunks",
        )
        _ = self.loop  # the loop's own checks: age policy, staleness, concurrency, timeouts

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
