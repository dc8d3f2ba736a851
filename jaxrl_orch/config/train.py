"""TrainConfig: every setting of ``python -m jaxrl_orch.train``, bound by gin.

It sits below the orchestrator: it imports only ``settings`` (the orchestrator's own settings
dataclass, which ``TrainConfig.orchestrator`` composes from the flat fields) and the
algorithm registry (to fail on an unknown name at parse time).

One frozen dataclass, so the whole run is described by one gin file; an unknown binding fails
at parse time naming the parameter. The defaults are the embedded CPU scenario (tiny byte-level
model, bundled reverse-text task); ``configs/*.gin`` override them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gin

from jaxrl_orch.config.orchestrator import AGE_POLICIES, OrchestratorConfig

DTYPES = ("float32", "bfloat16")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "tiny-byte"  # a preset name, or an HF checkpoint directory (config.json)
    tokenizer: str = "byte"  # "byte", or a tokenizer.json path / directory holding one
    env: str = "reverse_text"
    instruction: str | None = None  # None: the env's default instruction
    dataset: str = "jaxrl_reverse_text"  # bundled, a prepared tfds name, or text:PATH / *.txt
    eval_dataset: str | None = None  # None: the held-out split of `dataset`
    data_dir: str | None = None
    seed: int = 0
    # SFT warm-up
    sft_steps: int = 300
    warmup_from: str | None = None  # another workdir whose sft/ checkpoint this run starts from
    sft_batch_size: int = 64
    sft_learning_rate: float = 3e-3
    sft_warmup_steps: int = 10  # linear warmup, then cosine decay to 10% at sft_steps
    sft_checkpoint_every: int = 50  # warm-up checkpoints (and one on SIGTERM): resume mid-way
    # Mixed-quality warm-up: (behaviour, share) pairs the demonstrator uses instead of the
    # reference answer for that share of examples (envs/demonstrator.py); () = always right.
    demonstrations: tuple[tuple[str, float], ...] = ()
    # RL, or its imitation control: "sft" spends the RL stage's optimizer updates on more SFT
    # of the demonstrations instead, evaluated alike (control.py)
    after_warmup: str = "rl"
    rl_steps: int = 60
    prompts_per_step: int = 8
    rl_prompt_pool: int | None = None  # RL prompts from only the first N train examples (a probe)
    group_size: int = 16
    max_staleness: int = 1
    age_policy: str = "admit"
    max_concurrent: int | None = None  # default: (max_staleness + 1) * batch
    algorithm: str = "grpo"  # mean-centred (seed 003); "permuted:grpo" = its noise-only control
    dynamic_sampling: bool = True  # drop flat groups and wait for groups with signal (DAPO)
    rl_learning_rate: float = 1e-4
    rl_warmup_steps: int = 10  # linear LR warmup (fresh Adam moments on noisy policy gradients)
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
    # packing / shapes
    row_len: int = 256  # one or two bundled reverse-text samples a row
    # None: one row per sample (the most a batch can need; padding chunks are skipped on
    # device), more if a batch needs more: a fixed shape, compiled once
    rows_per_batch: int | None = None
    chunk_rows: int = 8
    # engine: "builtin", or "package.module:factory" for a JetStream-shaped engine
    engine: str = "builtin"
    decode_slots: int = 32
    max_target_length: int = 256
    steps_per_call: int = 8
    # run every prompt bucket's prefill and every decode width once before the first rollout,
    # so nothing compiles mid-run (JetStream's model warm-up)
    engine_warmup: bool = True
    # placement: {} means all devices split evenly; colocated shares one set of devices
    trainer_mesh: tuple[tuple[str, int], ...] = ()
    decode_mesh: tuple[tuple[str, int], ...] = ()
    colocated: bool | None = None  # None: colocated iff there is one device
    # S >= 1, engine in this process: "overlapped" (generate while training), "sliced" (the
    # engine pauses during train steps) or "auto" (where they share cores: measure, keep faster)
    overlap: str = "auto"
    # processes (DESIGN.md section 8): a trainer group of this many jax.distributed processes
    # (SPMD over one mesh spanning them; process 0 also runs the orchestrator) ...
    trainer_processes: int = 1
    # ... and this many engine replicas, each its own process serving over gRPC; 0: the
    # engine lives in the trainer's process (jaxrl-launch-local starts both)
    engine_replicas: int = 0
    weight_pull_timeout_s: float = 120.0  # a replica's pull of a new version longer: it fails
    replica_request_timeout_s: float = 600.0  # one generate request to a replica longer: an error
    # accelerator path: precision, kernels, memory (python -m jaxrl_orch.tools.aot checks the fit)
    compute_dtype: str = "auto"  # matmuls, activations; "auto": bfloat16 on TPU/GPU, else float32
    param_dtype: str = "float32"  # the trainer's master weights and Adam moments (or "bfloat16")
    engine_param_dtype: str | None = None  # the engine's copy of the weights; None: its compute
    engine_compute_dtype: str | None = None  # the engine's matmuls; None: compute_dtype
    attention: str = "auto"  # auto: splash on TPU, xla on GPU, chunked on CPU; einsum: reference
    remat: str = "none"  # per-block rematerialisation: none, full, dots, dots_no_batch
    logprob_chunk: int = 0  # trainer log-probs and loss in chunks of this many positions; 0: off
    scan_layers: bool = False  # trainer forward as one lax.scan over layers (fast TPU compile)
    tpu_topology: str | None = None  # the slice this config is sized for, e.g. "v5e:2x4" (aot)
    # evaluation / checkpoints / logging
    eval_every: int = 10
    eval_examples: int = 128
    checkpoint_every: int = 10
    max_to_keep: int = 2
    stall_timeout_s: float = 600.0  # no rollout landed, no step shipped or trained: fail
    env_timeout_s: float = 600.0  # one rollout (generation + environment) longer: cancelled
    drain_timeout_s: float = 60.0  # SIGTERM / Ctrl-C: in-flight work past it is cancelled
    loop_block_warn_s: float = 2.0  # code blocking the event loop longer is named
    log_interval_s: float = 30.0
    # Weights & Biases (pip install 'jaxrl-orch[wandb]'): off while wandb_project is None
    wandb_project: str | None = None
    wandb_run_name: str | None = None  # None: the workdir's name
    wandb_mode: str | None = None  # "online", "offline", "disabled"; None: W&B's own (WANDB_MODE)
    export_hf: bool = True  # write the final policy as an HF checkpoint to WORKDIR/export

    def __post_init__(self) -> None:
        from jaxrl_orch.algorithms.advantages import get_algorithm

        get_algorithm(self.algorithm)  # an unknown name fails here, naming the known ones
        if self.rl_prompt_pool is not None and self.rl_prompt_pool < 1:
            raise ValueError(
                f"TrainConfig.rl_prompt_pool must be >= 1 or None (all), got {self.rl_prompt_pool}"
            )

        token_sum = getattr(get_algorithm(self.algorithm), "token_sum_normalization", False)
        if token_sum and self.loss_norm not in (None, "constant"):
            raise ValueError(
                f"algorithm {self.algorithm!r} normalises the loss by a constant (Dr. GRPO); "
                f"loss_norm {self.loss_norm!r} contradicts it: leave loss_norm unset"
            )
        if self.loss_norm not in (None, "token", "sequence", "constant"):
            raise ValueError(
                f"TrainConfig.loss_norm must be None, 'token', 'sequence' or 'constant', got "
                f"{self.loss_norm!r}"
            )
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ValueError(
                f"TrainConfig.wandb_mode must be None, 'online', 'offline' or 'disabled', got "
                f"{self.wandb_mode!r}"
            )
        if self.after_warmup not in ("rl", "sft"):
            raise ValueError(
                f"TrainConfig.after_warmup must be 'rl' or 'sft' (the imitation control), got "
                f"{self.after_warmup!r}"
            )
        if self.age_policy not in AGE_POLICIES:
            raise ValueError(f"age_policy must be one of {AGE_POLICIES}, got {self.age_policy!r}")
        if self.group_size < 2:
            raise ValueError(
                f"TrainConfig.group_size must be >= 2, got {self.group_size}: group-relative "
                "advantages compare the rollouts of one prompt, so a group of one has none"
            )
        for name in (
            "rl_steps",
            "prompts_per_step",
            "sft_batch_size",
            "minibatches",
            "ppo_epochs",
            "sft_checkpoint_every",
            "trainer_processes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens >= self.row_len:
            raise ValueError(
                f"TrainConfig.max_new_tokens ({self.max_new_tokens}) must be < row_len "
                f"({self.row_len}): a rollout is its prompt plus up to max_new_tokens tokens"
            )
        for name, value, allowed in (
            ("compute_dtype", self.compute_dtype, ("auto", *DTYPES)),
            ("param_dtype", self.param_dtype, DTYPES),
            ("engine_param_dtype", self.engine_param_dtype, (None, *DTYPES)),
            ("engine_compute_dtype", self.engine_compute_dtype, (None, *DTYPES)),
            ("attention", self.attention, ("auto", "einsum", "xla", "chunked", "splash")),
            ("remat", self.remat, ("none", "full", "dots", "dots_no_batch")),
            ("overlap", self.overlap, ("auto", "overlapped", "sliced")),
        ):
            if value not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, got {value!r}")
        if self.logprob_chunk < 0:
            raise ValueError(
                f"TrainConfig.logprob_chunk must be >= 0 (0: off), got {self.logprob_chunk}"
            )
        if self.engine_replicas and self.after_warmup == "sft":
            raise ValueError(
                "TrainConfig.after_warmup='sft' (the imitation control) runs in one process; "
                f"set engine_replicas = 0 (got {self.engine_replicas})"
            )
        for name in ("weight_pull_timeout_s", "replica_request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"TrainConfig.{name} must be > 0 seconds, got {getattr(self, name)}"
                )
        names = ("sft_steps", "max_staleness", "rl_warmup_steps", "sft_warmup_steps")
        for name in (*names, "engine_replicas"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def orchestrator(self) -> OrchestratorConfig:
        """The loop's own settings, composed from the flat fields users bind."""
        return OrchestratorConfig(
            max_steps=self.rl_steps,
            batch_size=self.batch_size,
            group_size=self.group_size,
            max_staleness=self.max_staleness,
            max_concurrent=self.max_concurrent or (self.max_staleness + 1) * self.batch_size,
            age_policy=self.age_policy,
            eval_every=self.eval_every,
            stall_timeout_s=self.stall_timeout_s,
            env_timeout_s=self.env_timeout_s,
            drain_timeout_s=self.drain_timeout_s,
            loop_block_warn_s=self.loop_block_warn_s,
            request_seed=self.seed,  # a run's samples do not depend on its replica count
        )

    @property
    def resolved_loss_norm(self) -> str:
        """``loss_norm``, or the algorithm's own when unset (see the field's comment)."""
        from jaxrl_orch.algorithms.advantages import get_algorithm

        if self.loss_norm is not None:
            return self.loss_norm
        token_sum = getattr(get_algorithm(self.algorithm), "token_sum_normalization", False)
        return "constant" if token_sum else "token"

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size


def load_config(gin_files: list[str], gin_params: list[str]) -> TrainConfig:
    """Parse gin and build the config; every error names the bad file/binding/value."""
    for f in gin_files:
        if not Path(f).is_file():
            raise ValueError(f"gin file {f!r} does not exist")
    gin.clear_config()
    try:
        gin.parse_config_files_and_bindings(gin_files, gin_params)
    except (ValueError, KeyError, SyntaxError) as exc:
        gin.clear_config()
        raise ValueError(f"bad gin config: {exc}") from exc
    try:
        return TrainConfig()
    except ValueError:
        gin.clear_config()  # a refused config must not linger for the next TrainConfig()
        raise
