"""Tunix's side of ``benchmarks/peer_tunix.py`` (its child process with ``--side tunix``):
Tunix 0.1.7's ``GRPOLearner`` over an ``RLCluster`` on the shared workload; what it measures
and how is in ``peer_tunix.py``'s docstring."""

from __future__ import annotations

import argparse
import statistics
import time

from peer_tunix import GROUP_SIZE, KV_CACHE, LEARNING_RATE, PROMPTS_PER_STEP, WARMUP_LR_STEPS


class TunixByteTokenizer:
    """Our ``ByteTokenizer`` behind Tunix's tokenizer interface (``encode``, ``decode``,
    ``bos_id()``, ``eos_id()``, ``pad_id()``). No BOS (raw prompts, as on our side); EOS and pad
    are ``NEVER_SAMPLED``, which no sample produces and, with equal prompt lengths, no prompt
    is padded with."""

    def __init__(self) -> None:
        from jaxrl_orch.models.tokenizer import ByteTokenizer

        self._tok = ByteTokenizer()

    def encode(self, text, **_: object) -> list[int]:
        return self._tok.encode(str(text))  # Tunix passes NumPy strings

    def decode(self, ids, **_: object) -> str:
        from peer_env import NEVER_SAMPLED

        return self._tok.decode([int(i) for i in ids if int(i) != NEVER_SAMPLED])

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        from peer_env import NEVER_SAMPLED

        return NEVER_SAMPLED

    pad_id = eos_id


def run_tunix(a: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import peer_env
    from flax import nnx
    from jax import monitoring
    from jax.sharding import Mesh
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jaxrl_orch.data.sources import make_source
    from jaxrl_orch.models.configs import get_config

    mc = get_config("small-byte")
    cfg = qwen3.ModelConfig(
        num_layers=mc.n_layers,
        vocab_size=mc.vocab_size,
        embed_dim=mc.d_model,
        hidden_dim=mc.d_ff,
        num_heads=mc.n_heads,
        head_dim=mc.head_dim,
        num_kv_heads=mc.n_kv_heads,
        rope_theta=int(mc.rope_theta),
        norm_eps=mc.norm_eps,
        use_tied_embedding=mc.tie_embeddings,
        dtype=jnp.dtype(a.compute_dtype),  # activations and matmuls; master weights float32
    )
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    devices = jax.devices()[: a.devices]
    mesh = lambda ds: Mesh(np.array(ds).reshape(len(ds), 1), ("fsdp", "tp"))  # noqa: E731
    actor = mesh(devices[:1])
    rollout = actor if a.devices == 1 else mesh(devices[1:2])
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(0.0, LEARNING_RATE, WARMUP_LR_STEPS),
            optax.constant_schedule(LEARNING_RATE),
        ],
        [WARMUP_LR_STEPS],
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    total = a.warmup + a.steps
    cluster_config = rlc.ClusterConfig(
        role_to_mesh={rlc.Role.ACTOR: actor, rlc.Role.REFERENCE: actor, rlc.Role.ROLLOUT: rollout},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rlc.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=total + 1,  # the iterator ends the run (peer_tunix.py's docstring)
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=a.max_new_tokens,
            max_prompt_length=peer_env.PROMPT_BYTES,
            kv_cache_size=KV_CACHE,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            eos_tokens=[peer_env.NEVER_SAMPLED],
        ),
    )
    tokenizer = TunixByteTokenizer()
    cluster = rlc.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer, cluster_config=cluster_config
    )
    lengths: dict[int, float] = {}  # step -> mean completion tokens, from Tunix's metrics

    def on_metrics(buf) -> None:
        if "completions/mean_length" in buf.metrics:
            values, _ = buf.metrics["completions/mean_length"]
            lengths[buf.global_steps] = float(np.mean(values))

    cluster.with_external_metrics_logger(on_metrics)
    scored: list[int] = []  # completions per reward call: the samples Tunix really ran
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=GROUP_SIZE, num_iterations=1, beta=0.0),
        reward_fns=lambda prompts, completions, **_: (
            scored.append(len(completions)) or [peer_env.lowercase_share(c) for c in completions]
        ),
    )

    phases: dict[str, list[float]] = {"generate": [], "update": []}

    def timed(name, fn, block=None):
        # Tunix's two big phases, each until its results exist (its own perf tracers are off).
        def wrapper(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            jax.block_until_ready(out if block is None else block())
            phases[name].append(time.perf_counter() - t)
            return out

        return wrapper

    cluster.generate = timed("generate", cluster.generate)
    cluster.update_actor = timed(
        "update", cluster.update_actor, lambda: nnx.state(cluster.actor_trainer.model)
    )

    def device_ids(m) -> list[int]:
        return sorted({d.id for x in jax.tree.leaves(nnx.state(m)) for d in x.devices()})

    placement = {
        "actor_devices": device_ids(cluster.actor_trainer.model),
        "rollout_devices": device_ids(cluster.rollout.model()),
        "syncs_weights": bool(learner.should_sync_weights),
    }
    source = make_source(f"text:{a.prompts}", split="train", seed=0)
    stamps: list[float] = []
    prompt_lens: list[int] = []

    def batches():
        for _ in range(total):
            stamps.append(time.perf_counter())
            batch = [source.next_example()["text"] for _ in range(PROMPTS_PER_STEP)]
            prompt_lens.extend(len(tokenizer.encode(p)) for p in batch)
            # An array, as a grain dataset yields: Tunix repeats each prompt G times with
            # np.repeat over the batch tree, which would treat a list's strings as leaves.
            yield {"prompts": np.array(batch)}
        stamps.append(time.perf_counter())

    compiles: list[float] = []  # end times of XLA backend compilations, as rl_step counts them

    def on_event(name: str, secs: float, **_: object) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(time.perf_counter())

    monitoring.register_event_duration_secs_listener(on_event)
    t0 = time.perf_counter()
    learner.train(batches())
    wall = time.perf_counter() - t0
    measured = [stamps[k + 1] - stamps[k] for k in range(a.warmup, total)]
    samples = PROMPTS_PER_STEP * GROUP_SIZE
    if set(scored) != {samples}:  # e.g. a list batch Tunix would not repeat per generation
        raise RuntimeError(f"Tunix scored {sorted(set(scored))} completions a step, not {samples}")
    tokens = [lengths[k] * samples for k in range(a.warmup, total)]
    med = statistics.median(measured)
    return {
        "side": "tunix",
        "step_s": med,
        "step_s_all": measured,
        "generated_tokens_per_step": statistics.median(tokens),
        "generated_tokens_per_s": statistics.median(tokens) / med,
        "mean_prompt_tokens": statistics.fmean(prompt_lens[a.warmup * PROMPTS_PER_STEP :]),
        "compiles_after_warmup": sum(stamps[a.warmup] < t <= stamps[total] for t in compiles),
        "param_count": int(n_params),
        "placement": placement,
        # one generate / update call a step (checked): medians over the timed steps
        "phases": {
            k: statistics.median(v[a.warmup : total]) if len(v) == total else None
            for k, v in phases.items()
        },
        "wall_s": wall,
    }
