"""The sections that say how and where a run executes: ``Engine`` (the decoding engine),
``Orchestrator`` (staleness, concurrency and timeouts of the loop), ``Processes`` (a
multi-process layout, its network timeouts and the compilation cache its processes share) and
``Outputs`` (checkpoints, logging, export).

Each field declares its default, range and meaning once (``jaxrl_orch.settings``); the
``Orchestrator`` section's fields are the loop's own (``config.orchestrator.loop_setting``).
Read by ``compose.engines`` and ``compose.sides`` (Engine), ``TrainConfig.loop`` (Orchestrator),
``distributed`` and the composition root (Processes; ``compose.compile_cache`` the cache),
``run`` (Outputs). Pure: no JAX.
"""

from __future__ import annotations

from jaxrl_orch.config.orchestrator import loop_setting
from jaxrl_orch.config.section import section
from jaxrl_orch.paths import is_url
from jaxrl_orch.settings import Allowed, check_settings, require, setting

DTYPES = ("float32", "bfloat16")
WEIGHT_TRANSPORTS = ("http", "jax")
_MESH_MEANING = "the mesh as ((axis, size), ...); (): the devices split evenly"


@section("Engine")
class EngineSettings:
    kind: str = setting(
        "builtin", "'builtin', or 'package.module:factory' for a JetStream-shaped engine"
    )
    slots: int = setting(32, "concurrent decodes (continuous batching)", Allowed.at_least(1))
    max_target_length: int = setting(
        256,
        "KV cache positions: prompt plus completion",
        Allowed.at_least(2).because("a prompt token and a generated one"),
    )
    steps_per_call: int = setting(8, "decode steps per engine call", Allowed.at_least(1))
    warmup: bool = setting(
        True,
        "run every prompt bucket's prefill and every decode width once before the first "
        "rollout, so nothing compiles mid-run (JetStream's model warm-up)",
    )
    mesh: tuple[tuple[str, int], ...] = setting((), _MESH_MEANING)
    param_dtype: str | None = setting(
        None,
        "the engine's copy of the weights; None: its compute dtype",
        Allowed.one_of(None, *DTYPES),
    )
    compute_dtype: str | None = setting(
        None, "the engine's matmuls; None: Model.compute_dtype", Allowed.one_of(None, *DTYPES)
    )
    overlap: str = setting(
        "auto",
        "S >= 1, engine in this process: 'overlapped' (generate while training), 'sliced' (the "
        "engine pauses during train steps) or 'auto' (where they share cores: measure, keep the "
        "faster)",
        Allowed.one_of("auto", "overlapped", "sliced"),
    )
    serve_port: int | None = setting(
        None,
        "serve the policy being trained on http://127.0.0.1:PORT (vLLM's RL API and OpenAI's, "
        "each response naming its policy version) for evals and agents; None: off, 0: any free "
        "port",
        Allowed.between(0, 65535).or_none(),
    )
    serve_control: bool = setting(
        False,
        "hand the live server's control routes (POST /pause, /resume, /update_weights) out to "
        "its callers; a caller's pause is then reported on the console, in the gauges and in a "
        "stall error. False: they are refused (403) to every caller, key or not: the engine's "
        "state is the run's",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        require(
            not (self.serve_control and self.serve_port is None),
            "Engine.serve_control = True hands out the control routes of the live server, and "
            "there is none: set Engine.serve_port too (0: any free port)",
        )


@section("Orchestrator")
class OrchestratorSettings:
    max_staleness: int = loop_setting("max_staleness")
    age_policy: str = loop_setting("age_policy")
    max_concurrent: int | None = loop_setting("max_concurrent")
    stall_timeout_s: float | None = loop_setting("stall_timeout_s")
    env_timeout_s: float | None = loop_setting("env_timeout_s")
    drain_timeout_s: float = loop_setting("drain_timeout_s")
    loop_block_warn_s: float | None = loop_setting("loop_block_warn_s")
    keep_pending: bool = loop_setting("keep_pending")

    @property
    def synchronous(self) -> bool:
        """S = 0: every batch trains on the version that generated it; generation and training
        never overlap (the baseline that tells an algorithm bug from an asynchrony bug)."""
        return self.max_staleness == 0


@section("Processes")
class ProcessesSettings:
    trainer_processes: int = setting(
        1,
        "a trainer group of this many jax.distributed processes (SPMD over one mesh spanning "
        "them; process 0 also runs the orchestrator)",
        Allowed.at_least(1),
    )
    engine_replicas: int = setting(
        0,
        "engine replicas, each its own process serving the HTTP API; 0: the engine lives in "
        "the trainer's process (jaxrl-launch-local starts both)",
        Allowed.at_least(0),
    )
    colocated: bool | None = setting(
        None, "engine and trainer on one set of devices; None: iff there is 1 device"
    )
    weight_transport: str = setting(
        "http",
        "how weights move from trainer process 0 to the replicas. 'http': its weight server "
        "(--weight_source) serves each version once over HTTP to holders of the run's API key, "
        "refuses malformed requests and listens nowhere else; replicas only dial it. 'jax': "
        "jax.experimental.transfer, device to device, but its port has no authentication and "
        "aborts the process on malformed bytes (and each replica listens too): only on a "
        "network no one else can reach",
        Allowed.one_of(*WEIGHT_TRANSPORTS),
    )
    weight_pull_timeout_s: float = setting(
        120.0, "a replica's pull of a new version longer: it fails", Allowed.above(0)
    )
    weight_load_extra_s: float = setting(
        30.0,
        "a weight update's request (and its offer) outlives the pull's deadline by this, for "
        "the swap; a replica silent past both is lost",
        Allowed.above(0),
    )
    replica_warmup_s: float = setting(
        900.0,
        "the same for a replica's first update: it compiles its engine first",
        Allowed.above(0),
    )
    replica_start_timeout_s: float = setting(
        600.0, "a replica silent this long at the start: the run fails", Allowed.above(0)
    )
    replica_probe_timeout_s: float = setting(
        5.0, "a start-up health probe unanswered this long is sent again", Allowed.above(0)
    )
    replica_request_timeout_s: float = setting(
        600.0, "one generate request to a replica longer: an error", Allowed.above(0)
    )
    replica_health_timeout_s: float = setting(
        20.0,
        "a live replica that answers no health probe for this long (stopped, wedged) is lost "
        "like a dead one: its groups move to the other replicas, and it rejoins once it answers",
        Allowed.at_least(1).because("replicas are probed each second"),
    )
    tpu_topology: str | None = setting(
        None,
        "the slice this config is sized for, e.g. 'v5e:2x4'; with engine replicas, the trainer "
        "group's slice (python -m jaxrl_orch.tools.aot)",
    )
    replica_topology: str | None = setting(
        None,
        "each engine replica's own slice, e.g. 'v5e:2x2' (a v5e-4 VM): where python -m "
        "jaxrl_orch.tools.aot compiles the engine's programs; None: Processes.tpu_topology",
    )
    compile_cache: str | None = setting(
        "auto",
        "the local directory where every process of the run (the trainer, its peers, engine "
        "replicas) keeps its compiled XLA programs, so a restart loads them instead of "
        "compiling ('~' expanded; shared by the runs of one machine). 'auto': JAX's own "
        "$JAX_COMPILATION_CACHE_DIR when set, else $XDG_CACHE_HOME/jaxrl_orch/xla (default "
        "~/.cache/jaxrl_orch/xla). None or '': off. A URL (gs://) is refused: such a cache was "
        "seen not to hit (docs/faults.md, 'A restart's cost'). A Processes setting, not an "
        "Outputs one: it belongs to the machine, outlives the workdir and is never under a "
        "gs:// workdir",
    )
    keep_executables: bool = setting(
        True,
        "also keep the engine's programs and the train step whole in <compile_cache>/executables "
        "(compose/executables.py), so a restart loads them without tracing or lowering them; "
        "one process only, and only with a compile_cache",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        require(
            not (self.compile_cache and is_url(self.compile_cache)),
            f"Processes.compile_cache = {self.compile_cache!r} is a URL: a compilation cache in "
            "object storage was seen not to hit (docs/faults.md, 'A restart's cost'); give a "
            "local directory (a mounted bucket's path is one), 'auto', or None for none",
        )

    @property
    def max_pull_s(self) -> float:
        """The longest pull one weight update may ask a replica for: the pull's deadline plus
        the update's extra. A longer one is refused, so no request holds a replica's load lock
        past it."""
        return self.weight_pull_timeout_s + self.weight_load_extra_s


@section("Outputs")
class OutputsSettings:
    checkpoint_every: int = setting(
        10, "RL steps between two checkpoints (and one at the end)", Allowed.at_least(1)
    )
    max_to_keep: int = setting(2, "RL checkpoints kept", Allowed.at_least(1))
    log_interval_s: float = setting(
        30.0, "seconds between two gauge rows (gauges.jsonl, TensorBoard)", Allowed.above(0)
    )
    wandb_project: str | None = setting(
        None, "Weights & Biases project (pip install 'jaxrl-orch[wandb]'); None: off"
    )
    wandb_run_name: str | None = setting(None, "the W&B run's name; None: the workdir's name")
    wandb_mode: str | None = setting(
        None,
        "'online', 'offline' or 'disabled'; None: W&B's own (WANDB_MODE)",
        Allowed.one_of(None, "online", "offline", "disabled"),
    )
    export_hf: bool = setting(True, "write the final policy as an HF checkpoint to WORKDIR/export")
