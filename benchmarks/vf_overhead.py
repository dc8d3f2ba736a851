"""What the reverse-text task through verifiers costs the orchestrator, against the bundled env.

    python benchmarks/vf_overhead.py --json                                # CPU per rollout
    python benchmarks/vf_overhead.py --json --warmup_from=runs/reverse_text --rl_steps=12

Same prompts, same process, interleaved rounds:
- ``cpu_ms_per_rollout``: process CPU time (every thread: verifiers renders on worker threads)
  per rollout, ``--concurrency`` rollouts at once as a train step runs them, of
  ``envs.reverse_text.ReverseTextEnv`` and of ``envs.vf.VerifiersEnv`` on the
  ``jaxrl-reverse-text`` taskset, against an engine that answers at once with a fixed reply, so
  the figure is the orchestrator's and the environment's work alone. Median of ``--rounds``.
- ``where``: the verifiers rollouts' CPU ms per rollout in each stage of an episode (cProfile
  with a CPU clock, one round; profiling inflates them, compare them with each other): the
  answer to where the difference goes.
- with ``--warmup_from``: both envs' RL stage from that warm-up for ``--rl_steps`` steps, in
  subprocesses one after the other, as ``rl_seconds / steps`` (the engine and the trainer
  included): the step time a user sees.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxrl_orch.envs.reverse_text import ReverseTextEnv
from jaxrl_orch.envs.vf.env import VerifiersEnv, tokenizer_dir_for
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.types import Completion, SamplingParams

INSTRUCTION = "Reverse:"
VF_SPEC = {"taskset": {"id": "jaxrl-reverse-text", "instruction": INSTRUCTION}}


class InstantEngine:
    """Answers every request at once with the same 32-token reply (ids, log-probs, versions)."""

    def __init__(self, tokenizer) -> None:
        ids = tokenizer.encode("<answer>.ecnetnes a fo lasrever ehT</answer>") + [tokenizer.eos_id]
        self.reply = Completion(ids, [-0.5] * len(ids), [1] * len(ids), "stop")

    async def generate(self, prompt_ids, sampling) -> Completion:
        await asyncio.sleep(0)  # one loop turn, as an engine's future resolves
        return self.reply


def _round(env, engine, examples) -> float:
    """Process CPU seconds for one batch of concurrent rollouts."""
    sampling = SamplingParams(temperature=1.0, max_tokens=64)

    async def main():
        try:
            return await asyncio.gather(
                *(
                    env.run(engine, ex, group_id=0, episode_id=i, sampling=sampling)
                    for i, ex in enumerate(examples)
                )
            )
        finally:
            if hasattr(env, "aclose"):
                await env.aclose()

    t0 = time.process_time()
    rollouts = asyncio.run(main())
    assert all(not r.errors and r.num_model_tokens for r in rollouts)
    return time.process_time() - t0


# Where a verifiers rollout's CPU goes: cumulative CPU of these calls (nested ones are parts of
# the ones above them), per rollout.
STAGES = (
    ("episode (verifiers' run_slot, all of it)", "env.py", "run_slot"),
    ("  harness -> interception: the chat call's client side", "vf_chat.py", "_chat"),
    ("  interception server: one model call", "server.py", "handle_request"),
    ("    TrainClient: render, then POST to the bridge", "train.py", "get_response"),
    ("      bridge: parse, engine, reply (jaxrl_orch)", "bridge.py", "_generate"),
    ("  the runtime: open and close the subprocess box", "rollout.py", "open"),
    ("trace -> rollout check (jaxrl_orch)", "traces.py", "episode_rollout"),
)


def _where(env, engine, examples) -> dict[str, float]:
    """CPU ms per rollout in each of ``STAGES`` (one profiled round)."""
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    _round(env, engine, examples)
    prof.disable()
    cum: collections.Counter[tuple[str, str]] = collections.Counter()
    for (path, _, name), (_, _, _, cum_s, _) in pstats.Stats(prof).stats.items():
        cum[(Path(path).name, name)] += cum_s
    n = len(examples)
    return {label: round(1e3 * cum[(f, fn)] / n, 2) for label, f, fn in STAGES}


def cpu_per_rollout(concurrency: int, rounds: int) -> dict:
    tokenizer = load_tokenizer("byte")
    tok_dir = tokenizer_dir_for("byte", Path(tempfile.mkdtemp()))
    bundled = ReverseTextEnv(tokenizer, instruction=INSTRUCTION)
    vf = VerifiersEnv(tokenizer, env=VF_SPEC, tokenizer_dir=tok_dir)
    engine = InstantEngine(tokenizer)
    texts = [vf.task(ex).data.text for ex in vf.examples("eval")[:concurrency]]
    same = {"bundled": [{"text": t} for t in texts], "verifiers": vf.examples("eval")[:concurrency]}
    envs = {"bundled": bundled, "verifiers": vf}
    _round(vf, engine, same["verifiers"])  # verifiers' first opening builds its renderer
    times: dict[str, list[float]] = {k: [] for k in envs}
    for _ in range(rounds):
        for name, env in envs.items():
            times[name].append(_round(env, engine, same[name]) / concurrency)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {
        "cpu_ms_per_rollout": {k: round(v, 3) for k, v in ms.items()},
        "ratio_verifiers_over_bundled": round(ms["verifiers"] / ms["bundled"], 1),
        "where": _where(vf, engine, same["verifiers"]),
    }


def step_times(warmup_from: str, steps: int) -> dict:
    base = [
        sys.executable,
        "-m",
        "jaxrl_orch.train",
        f"--gin_param=Warmup.from_workdir = '{warmup_from}'",
        f"--gin_param=RL.steps = {steps}",
        "--gin_param=RL.eval_every = 1000",
    ]
    runs = {
        "bundled": ["--gin_file=configs/reverse_text.gin"],
        "verifiers": ["--gin_file=configs/verifiers.gin", f"--gin_param=VERIFIERS_ENV = {VF_SPEC}"],
    }
    out = {}
    for name, args in runs.items():
        wd = tempfile.mkdtemp(prefix=f"vf_overhead_{name}_")
        subprocess.run([*base, *args, f"--workdir={wd}"], check=True, capture_output=True)
        summary = json.loads((Path(wd) / "summary.json").read_text())
        out[name] = round(summary["rl_seconds"] / summary["rl_steps"], 2)
    return {"rl_step_s": out, "step_ratio": round(out["verifiers"] / out["bundled"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warmup_from", default=None, help="a workdir whose warm-up both runs start from"
    )
    p.add_argument("--rl_steps", type=int, default=12)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = cpu_per_rollout(args.concurrency, args.rounds)
    if args.warmup_from:
        result.update(step_times(args.warmup_from, args.rl_steps))
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
