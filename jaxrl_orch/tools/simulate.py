"""``jaxrl-simulate``: the real orchestrator against a simulated engine and trainer.

The planning tool: pick the staleness bound, concurrency and age policy before spending
accelerator hours. Everything that decides what data gets trained on is the real code (the
gate, the dispatcher, both sinks, the weight watcher, the main loop with its hold and age
policies); only the engine (a per-rollout latency) and the trainer (a per-step time) are
simulated. It runs on ``VirtualTimeLoop``, so a 1,000-step scenario takes seconds of real time
and is deterministic for a seed.

Simulated engine: each rollout takes one latency draw (``fixed:X``, ``uniform:A:B`` or
``lognormal:MU:SIGMA`` seconds); its tokens carry the policy version of the moment they were
"decoded" (first half at the start, second half at the end, so weights swapped mid-rollout
show up per token as in the real engine). A zero latency (``fixed:0``) is an instant engine: it
answers without suspending, so the rollout finishes in the dispatcher's eager first step (the
overhead benchmark runs this way). Rewards are random draws, so groups carry signal.
Simulated trainer: steps run one at a time, ``--train-time`` seconds each, then publish the
new version to the in-process weight publisher; ``--transfer-time`` is the engine reload.

Reported (``--json``): steps, virtual seconds, steps/s, trainer and engine idle fractions
(engine idle = no train rollout in flight), observed head-age max/p50/p95/p99, rollouts dropped
by the ``drop`` policy, admissions per step.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_orch.compose.orchestrator import Backend, Telemetry, Workload, build_orchestrator
from jaxrl_orch.config.orchestrator import AGE_POLICIES, OrchestratorConfig
from jaxrl_orch.orchestrator.vclock import run_virtual
from jaxrl_orch.orchestrator.watcher import InProcessPublisher
from jaxrl_orch.types import (
    Completion,
    PolicyHandle,
    Rollout,
    SamplingParams,
    TrainBatch,
)


def parse_latency(spec: str) -> tuple[str, tuple[float, ...]]:
    """``fixed:X`` | ``uniform:A:B`` | ``lognormal:MU:SIGMA`` (seconds; MU/SIGMA of log-seconds)."""
    kind, _, rest = spec.partition(":")
    arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
    try:
        params = tuple(float(x) for x in rest.split(":")) if rest else ()
    except ValueError:
        params = ()
    if kind not in arity or len(params) != arity[kind]:
        raise ValueError(
            f"bad latency {spec!r}: expected fixed:X, uniform:A:B or lognormal:MU:SIGMA"
        )
    if kind == "uniform" and not 0 <= params[0] <= params[1]:
        raise ValueError(f"bad latency {spec!r}: uniform needs 0 <= A <= B")
    if kind == "fixed" and params[0] < 0:
        raise ValueError(f"bad latency {spec!r}: fixed latency must be >= 0")
    return kind, params


class SimEngine:
    """A latency model standing in for the decoding engine; also the inference pool."""

    def __init__(self, latency: str, policy: PolicyHandle, rng: np.random.Generator):
        self.kind, self.params = parse_latency(latency)
        self.policy = policy
        self.rng = rng
        self.active = 0
        self.idle_s = 0.0
        self._idle_since = 0.0

    def draw(self) -> float:
        if self.kind == "fixed":
            return self.params[0]
        if self.kind == "uniform":
            return float(self.rng.uniform(*self.params))
        return float(self.rng.lognormal(*self.params))

    def close_idle_interval(self, now: float) -> None:
        """Count the idle stretch still open at the end of the run."""
        if self.active == 0:
            self.idle_s += now - self._idle_since
            self._idle_since = now

    def select(self) -> SimEngine:
        return self

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Completion:
        n = sampling.max_tokens
        policy = self.policy
        first = policy.version
        last = first
        latency = self.draw()
        if latency > 0:
            loop = asyncio.get_running_loop()
            if self.active == 0:
                self.idle_s += loop.time() - self._idle_since
            self.active += 1
            try:
                await asyncio.sleep(latency)
                last = policy.version
            finally:
                self.active -= 1
                if self.active == 0:
                    self._idle_since = loop.time()
        # else: an instant engine answers without a loop turn and occupies it for no time,
        # so the idle interval in progress is not interrupted.
        half = n // 2
        # Token values never matter to the orchestrator; only their count and versions do.
        return Completion(
            list(range(3, 3 + n)), [-1.0] * n, [first] * half + [last] * (n - half), "length"
        )


class SimEnv:
    name = "sim"

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    async def run(self, client, example, *, group_id, episode_id, sampling) -> Rollout:
        prompt = example["prompt_ids"]
        c = await client.generate(prompt, sampling)
        p = len(prompt)
        n = len(c.token_ids)
        return Rollout(
            env=self.name,
            group_id=group_id,
            episode_id=episode_id,
            example=example,
            token_ids=[*prompt, *c.token_ids],
            loss_mask=[False] * p + [True] * n,
            logprobs=[0.0] * p + c.logprobs,
            versions=[-1] * p + c.versions,
            reward=self.rng.random(),
            num_turns=1,
            temperature=sampling.temperature,
        )


class SimSource:
    def __init__(self) -> None:
        self.cursor = 0

    def next_example(self) -> dict[str, Any]:
        self.cursor += 1
        return {"id": self.cursor, "prompt_ids": [1, 2, 3, 4]}

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def restore(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])


class SimTrainer:
    """Takes one step per batch, ``train_time`` seconds each, strictly in order."""

    def __init__(self, publisher: InProcessPublisher, train_time: float) -> None:
        self.publisher = publisher
        self.train_time = train_time
        self.queue: asyncio.Queue[TrainBatch] = asyncio.Queue()
        self.busy_s = 0.0
        self.steps = 0
        self._task: asyncio.Task | None = None

    def submit(self, batch: TrainBatch) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._work(), name="sim-trainer")
        self.queue.put_nowait(batch)

    async def _work(self) -> None:
        while True:
            batch = await self.queue.get()
            await asyncio.sleep(self.train_time)
            self.busy_s += self.train_time
            self.steps += 1
            self.publisher.publish(batch.step, None)

    def gauges(self) -> dict[str, float]:
        return {"trainer/steps": float(self.steps), "trainer/queue": float(self.queue.qsize())}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


@dataclasses.dataclass
class Scenario:
    max_staleness: int = 1
    batch_size: int = 32
    group_size: int = 4
    max_concurrent: int = 64
    latency: str = "fixed:1.0"
    train_time: float = 1.0
    transfer_time: float = 0.0
    steps: int = 100
    policy: str = "admit"
    seed: int = 0
    start_step: int = 1
    recover_gate_on_resume: bool = True


def build_scenario(sc: Scenario, trainer_cls: type = SimTrainer) -> tuple[Any, Any, Any]:
    """``(orchestrator, engine, trainer)`` of a scenario, on the running (virtual) loop: the
    real orchestrator against the simulated engine and a ``trainer_cls`` trainer."""
    rng = np.random.default_rng(sc.seed)
    # Created here and shared: the simulated engine stamps the version the orchestrator reads.
    policy = PolicyHandle(sc.start_step - 1)
    engine = SimEngine(sc.latency, policy, rng)
    publisher = InProcessPublisher()
    trainer = trainer_cls(publisher, sc.train_time)

    async def reload(version: int, params: Any) -> None:
        if sc.transfer_time:
            await asyncio.sleep(sc.transfer_time)

    cfg = OrchestratorConfig(
        max_steps=sc.start_step - 1 + sc.steps,
        batch_size=sc.batch_size,
        group_size=sc.group_size,
        max_staleness=sc.max_staleness,
        max_concurrent=sc.max_concurrent,
        age_policy=sc.policy,
        eval_at_start=False,
        stall_timeout_s=None,
        # Virtual time: no wall-clock watchdogs (every timeout here would be virtual).
        env_timeout_s=None,
        loop_block_warn_s=None,
        recover_gate_on_resume=sc.recover_gate_on_resume,
    )
    orch = build_orchestrator(
        cfg,
        policy,
        backend=Backend(pool=engine, trainer=trainer, version_source=publisher, reload_fn=reload),
        workload=Workload(
            envs={"sim": SimEnv(rng)},
            source=SimSource(),
            sampling=SamplingParams(temperature=1.0, max_tokens=8),
        ),
        clock=asyncio.get_running_loop().time,
        telemetry=Telemetry(log_interval_s=1e9),
    )
    return orch, engine, trainer


async def run_scenario(sc: Scenario) -> dict[str, Any]:
    orch, engine, trainer = build_scenario(sc)
    loop = asyncio.get_running_loop()
    try:
        history = await orch.run()
    finally:
        trainer.close()
    total = loop.time()
    engine.close_idle_interval(total)
    hist = orch.age_histogram
    all_ages = np.repeat(np.array(list(hist), np.float64), list(hist.values()))
    if all_ages.size == 0:
        all_ages = np.zeros(1)
    steps = len(history)
    return {
        "steps": steps,
        "virtual_seconds": total,
        "steps_per_second": steps / total if total > 0 else 0.0,
        "trainer_idle_fraction": 1.0 - trainer.busy_s / total if total > 0 else 0.0,
        "engine_idle_fraction": engine.idle_s / total if total > 0 else 0.0,
        "age_max": float(all_ages.max()),
        "age_p50": float(np.percentile(all_ages, 50)),
        "age_p95": float(np.percentile(all_ages, 95)),
        "age_p99": float(np.percentile(all_ages, 99)),
        "dropped": orch.dropped_total,
        "admissions_per_step": [int(rec.metrics["orch/admitted"]) for rec in history],
        "config": dataclasses.asdict(sc),
    }


def simulate(sc: Scenario) -> dict[str, Any]:
    result, _ = run_virtual(lambda: run_scenario(sc))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.simulate",
        description="Run the real orchestrator against a simulated engine and trainer on a "
        "virtual clock, to choose max_staleness, concurrency and the age policy.",
    )
    d = Scenario()
    p.add_argument("--max-staleness", type=int, default=d.max_staleness)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rollouts per step")
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent)
    p.add_argument(
        "--latency", default=d.latency, help="fixed:X | uniform:A:B | lognormal:MU:SIGMA"
    )
    p.add_argument("--train-time", type=float, default=d.train_time, help="seconds per step")
    p.add_argument("--transfer-time", type=float, default=d.transfer_time)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--policy", choices=AGE_POLICIES, default=d.policy)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_latency(args.latency)
        sc = Scenario(
            max_staleness=args.max_staleness,
            batch_size=args.batch_size,
            group_size=args.group_size,
            max_concurrent=args.max_concurrent,
            latency=args.latency,
            train_time=args.train_time,
            transfer_time=args.transfer_time,
            steps=args.steps,
            policy=args.policy,
            seed=args.seed,
        )
        result = simulate(sc)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{result['steps']} steps in {result['virtual_seconds']:.1f} virtual s "
        f"({result['steps_per_second']:.3f} steps/s); trainer idle "
        f"{result['trainer_idle_fraction']:.0%}, engine idle {result['engine_idle_fraction']:.0%}"
    )
    print(
        f"observed head age: max {result['age_max']:.0f}, p50 {result['age_p50']:.0f}, "
        f"p95 {result['age_p95']:.0f}, p99 {result['age_p99']:.0f} (bound S={sc.max_staleness}, "
        f"policy {sc.policy}); dropped {result['dropped']}"
    )
    adm = result["admissions_per_step"]
    print(f"admissions per step: first {adm[:5]}, steady-state mean {np.mean(adm[5:] or adm):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
