"""Side-by-side RL step: Tunix's GRPO learner (google-tunix 0.1.7) vs ours, on one workload.

What is compared: the steady-state wall time of one RL step (generate a batch of rollouts,
score them, one optimizer update, hand the new weights to the sampler) and the generated
tokens per second of step time that follows, for
- Tunix: ``tunix.rl.grpo.grpo_learner.GRPOLearner`` over an ``RLCluster`` with its vanilla
  (non-vLLM) rollout, the actor a ``tunix.models.qwen3`` model from random init;
- ours: ``python -m jaxrl_orch.train``'s machinery through ``benchmarks/rl_step.py``'s
  ``run_once`` (engine, trainer, orchestrator), synchronous (max_staleness 0) and asynchronous
  (max_staleness 1).

How: the parent starts each side in its own fresh ``sys.executable`` subprocess (``--side
tunix|ours``, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set in the child's
environment, so before JAX is imported), alternating Tunix / ours ``--repeats`` times; each
child prints one JSON line, and the parent prints one JSON object: per side the best (min over
repeats) of the per-repeat median steady-state step time, tokens/s at that time, generated
tokens per step, mean prompt tokens, the ratios ours/Tunix, and every repeat's figures.

Step timing. Both sides skip the first ``--warmup`` steps (compilation) and take the median of
the next ``--steps``. Ours: ``orch/step_s`` as ``run_once`` reports it. Tunix:
``learner.train`` runs over an iterator of batches that stamps the wall time of each
``next()``; the learner draws batch k+1 only once step k is over (rollout, rewards, update,
weight sync, metric buffering), so step k lasts from draw k to draw k+1. Tunix's phases
(``tunix_phases_s``: its ``RLCluster.generate`` and ``update_actor``, each timed until its
results exist) and ours (``time/generate_s``, ``time/train_s``, ...) are the medians over the
timed steps. After the last timed step the iterator stamps once more and raises
``StopIteration``, which ends ``train`` without running another step. (Tunix's own span timings
come from its optional perf tracers, ``RLCluster(perf_config=...)``, off by default and left
off here so that they add nothing to the step.) Tunix's generated tokens per step are its
``completions/mean_length`` metric x 32, read from each step's metrics buffer
(``RLCluster.with_external_metrics_logger``); that 32 is checked, not assumed: the reward
function records how many completions each call scores, and a run where that is not 32 fails
(Tunix repeats each prompt G times with ``np.repeat`` over the batch tree, so the prompts go in
as an array; a list's strings would be leaves, and it would run 8 samples a step). XLA
compilations after the warm-up are counted on both sides as ``rl_step.py`` counts them. Our
asynchronous run is timed after its overlap probe (``jaxrl_orch/compose/overlap.py``).

Equal workload: one model shape, ``small-byte`` (``jaxrl_orch/models/configs.py``: vocab 512 =
``BYTE_VOCAB_SIZE``, d_model 256, 4 layers, 8 heads, 4 kv heads, head_dim 32, d_ff 768, rope
theta 1e4, tied embeddings; Tunix's Qwen3 adds its q/k RMSNorms, 256 parameters: both counts
are reported); float32 on CPU (``--compute-dtype bfloat16``: both sides' matmuls and
activations in bf16, master weights float32; ``--engine-compute-dtype`` sets our engine's
alone, since on a CPU with AMX a bf16 train step is faster and a bf16 decode step slower);
8 prompts x 4 samples per step, up to 128 new tokens, temperature
1 (no top-k / top-p), beta 0 (no reference model), one optimizer step per batch with the same
optimizer (clip 1.0, AdamW, linear warm-up over 10 steps to 1e-4), a 256-position KV cache. The
SAME prompt strings in the same order (``peer_env.write_prompts``: 18-byte reverse-text
instructions from the bundled corpus, walked by our seeded ``make_source``) and the SAME
tokenizer, our ``ByteTokenizer`` (behind Tunix's tokenizer interface on its side), raw text
without chat template or BOS on both sides, so every prompt is 18 tokens and neither side pads
one. The reward is ``peer_env.lowercase_share`` of the completion text on both sides. No stop
id can be sampled on either side (the only one is 512, past the last logit), so every sample
generates exactly ``--max-new-tokens`` tokens; the generated tokens per step are reported. The
trainers see the same positions: Tunix trains on prompt + completion (18 + 128 = 146 tokens a
sample), ours on one 146-token row a sample (``--row-len``, default prompt + max new tokens;
``rl_step.py``'s own scenario pads to 256). Everything else on our side is ``run_once``'s
scenario (32 decode slots, no eval between steps, dynamic sampling off).

    python benchmarks/peer_tunix.py --json [--devices 2] [--repeats 2]

``--devices 2``: Tunix's actor (trainer) on device 0 and its rollout on device 1 (its
disaggregated setup, which syncs weights each step); ours with its default placement (trainer
and engine split evenly, one device each). Needs ``pip install -e '.[peer]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The per-repeat figures in the parent's output.
COMMON_KEYS = ("step_s", "generated_tokens_per_s", "compiles_after_warmup", "wall_s")
TUNIX_KEYS = (*COMMON_KEYS, "step_s_all", "process_s", "phases")
OURS_KEYS = (*COMMON_KEYS, "breakdown")
# One step's shape and optimizer, the same on both sides.
PROMPTS_PER_STEP, GROUP_SIZE, LEARNING_RATE, WARMUP_LR_STEPS, KV_CACHE = 8, 4, 1e-4, 10, 256


# --------------------------------------------------------------------------- our side


def _prompt_tokens(workdir: Path, warmup: int) -> float:
    """Mean prompt length (the unmasked prefix) of the stored rollouts after the warm-up."""
    lens = []
    for path in sorted((workdir / "rollouts").glob("step_*.jsonl")):
        if int(path.stem.split("_")[1]) > warmup:
            for line in path.read_text().splitlines():
                mask = json.loads(line)["loss_mask"]
                lens.append(len(mask) - sum(mask))
    return statistics.fmean(lens)


def run_ours(a: argparse.Namespace) -> dict:
    import contextlib

    import peer_env
    from rl_step import run_once

    from jaxrl_orch.compose.overlap import probe_steps
    from jaxrl_orch.models.configs import get_config

    overrides = {
        "Data.env": "peer_env:make",
        "Data.dataset": f"text:{a.prompts}",
        "RL.max_new_tokens": a.max_new_tokens,
        "RL.learning_rate": LEARNING_RATE,
        "RL.lr_warmup_steps": WARMUP_LR_STEPS,
        "RL.temperature": 1.0,
        "Engine.max_target_length": KV_CACHE,
        "Engine.compute_dtype": a.engine_compute_dtype,
        "Trainer.row_len": a.row_len or peer_env.PROMPT_BYTES + a.max_new_tokens,
        "Outputs.export_hf": False,
        "Model.compute_dtype": a.compute_dtype,
    }
    out = {
        "side": "ours",
        "param_count": get_config("small-byte").num_params,
        "row_len": overrides["Trainer.row_len"],
    }
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for name, staleness in (("sync", 0), ("async", 1)):
            workdir = Path(tmp) / name
            t0 = time.perf_counter()
            # run_once's warm-up counts steps from 1 and times those after it: the same steps
            # Async: also past the overlap probe (jaxrl_orch/compose/overlap.py), which sets
            # its schedule.
            warm = max(a.warmup, probe_steps()) if staleness else a.warmup
            res = run_once(staleness, warm + a.steps, warm, workdir, overrides=overrides)
            res["wall_s"] = time.perf_counter() - t0
            res["generated_tokens_per_s"] = res["generated_tokens_per_step"] / res["step_s"]
            res["mean_prompt_tokens"] = _prompt_tokens(workdir, warm)
            out[name] = res
    return out


# --------------------------------------------------------------------------- parent


def _child(side: str, a: argparse.Namespace, prompts: Path) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={a.devices}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--prompts", str(prompts)]
    for flag in (
        "devices",
        "steps",
        "warmup",
        "max_new_tokens",
        "row_len",
        "compute_dtype",
        "engine_compute_dtype",
    ):
        if getattr(a, flag) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=a.timeout)
    if proc.returncode:
        sys.exit(f"the {side} child failed (exit {proc.returncode}); its stderr is above")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    print(f"[peer_tunix] {side}: {json.dumps(res)}", file=sys.stderr)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1, choices=(1, 2))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="steps skipped (compilation)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--row-len",
        type=int,
        default=0,
        help="our trainer's row length (0: prompt + max new tokens, Tunix's sequence length; "
        "rl_step.py uses 256)",
    )
    p.add_argument(
        "--compute-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="both sides' matmul / activation dtype (master weights stay float32)",
    )
    p.add_argument(
        "--engine-compute-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="ours only: the engine's matmul dtype (Engine.compute_dtype; "
        "default: --compute-dtype). Tunix's rollout runs its actor's model config.",
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds per child process")
    p.add_argument("--json", action="store_true", help="one line of JSON (else indented)")
    p.add_argument("--side", choices=("tunix", "ours"), help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        sys.path.insert(0, str(HERE))
        if a.side == "tunix":
            from peer_tunix_side import run_tunix

            print(json.dumps(run_tunix(a)), flush=True)
        else:
            print(json.dumps(run_ours(a)), flush=True)
        return
    if importlib.util.find_spec("tunix") is None:
        sys.exit("google-tunix is not importable: pip install -e '.[peer]'")
    sys.path.insert(0, str(HERE))
    from peer_env import write_prompts

    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"tunix": [], "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(Path(tmp) / "prompts.txt")
        for _ in range(a.repeats):
            for side in ("tunix", "ours"):
                runs[side].append(_child(side, a, prompts))
    tunix = min(runs["tunix"], key=lambda r: r["step_s"])
    modes = ("sync", "async")
    ours = {m: min((r[m] for r in runs["ours"]), key=lambda r: r["step_s"]) for m in modes}
    out = {
        "devices": a.devices,
        "repeats": a.repeats,
        "warmup_steps": a.warmup,
        "timed_steps": a.steps,
        "samples_per_step": PROMPTS_PER_STEP * GROUP_SIZE,
        "max_new_tokens": a.max_new_tokens,
        "tunix_step_s": tunix["step_s"],
        **{f"ours_{m}_step_s": ours[m]["step_s"] for m in ours},
        "tunix_generated_tokens_per_s": tunix["generated_tokens_per_s"],
        **{f"ours_{m}_generated_tokens_per_s": ours[m]["generated_tokens_per_s"] for m in ours},
        "tunix_generated_tokens_per_step": tunix["generated_tokens_per_step"],
        **{
            f"ours_{m}_generated_tokens_per_step": ours[m]["generated_tokens_per_step"]
            for m in modes
        },
        "compute_dtype": a.compute_dtype,
        "ours_engine_compute_dtype": a.engine_compute_dtype or a.compute_dtype,
        "tunix_phases_s": tunix["phases"],
        **{f"ours_{m}_breakdown_s": ours[m]["breakdown"] for m in modes},
        "tunix_mean_prompt_tokens": tunix["mean_prompt_tokens"],
        **{f"ours_{m}_mean_prompt_tokens": ours[m]["mean_prompt_tokens"] for m in ours},
        "step_s_ratio_ours_over_tunix": {m: ours[m]["step_s"] / tunix["step_s"] for m in ours},
        "tokens_per_s_ratio_ours_over_tunix": {
            m: ours[m]["generated_tokens_per_s"] / tunix["generated_tokens_per_s"] for m in ours
        },
        "param_count": {"tunix": tunix["param_count"], "ours": runs["ours"][0]["param_count"]},
        "tunix_placement": tunix["placement"],
        "ours_row_len": runs["ours"][0]["row_len"],
        "per_repeat": {
            "tunix": [{k: r[k] for k in TUNIX_KEYS} for r in runs["tunix"]],
            "ours": [
                {**{m: {k: r[m][k] for k in OURS_KEYS} for m in modes}, "process_s": r["process_s"]}
                for r in runs["ours"]
            ],
        },
        "wall_s": time.perf_counter() - t0,
        # the machine's 1-minute load average (other processes share the cores)
        "load_average_start_end": [load0, os.getloadavg()[0]],
    }
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
