"""Orchestrator overhead: is the host loop ever the bottleneck?

What it measures: the wall-clock cost per rollout of the real orchestrator path with an engine
and a trainer that take no time, against a bare asyncio baseline timed in the same process,
interleaved, best of ``--repeats`` each (the machine is shared and noisy, so only the ratio
means anything). Target: ratio <= 3.

Orchestrator side: ``simulate.run_scenario`` on a real asyncio event loop (not the virtual
clock) with S=1, ``--batch-size`` rollouts per step (64) in groups of ``--group-size`` (8), 2B
rollouts allowed in flight, latency ``fixed:0`` and train time 0. Every rollout goes through:
gate capacity and admission (resume-burst check included) -> dispatcher (group opening and
pinning, episode ids, the env coroutine, gate finish accounting, restamping, ``out_q``) ->
simulated env + engine (a ``Completion`` of 8 tokens after a 4-token prompt, a ``Rollout``,
a random reward) -> main loop (landed-version stamp, routing) -> train sink (grouping,
conversion of the traces to ``Sample`` arrays, GRPO advantages, dynamic-sampling filter, batch
assembly and batch metrics) -> version hold, off-policy stamping, step metrics -> simulated
trainer (submit, publish a version) -> weight watcher (reload hook, policy version bump) ->
gate version update. Timed: the whole ``asyncio.run`` of a ``--steps`` step run, setup and
teardown included, divided by ``steps * batch_size``.

Baseline: per item, one ``asyncio.create_task`` whose coroutine does one ``Queue.put``, and one
``Queue.get`` by the consumer: the least any asyncio pipeline with a task per item pays.

Reported: ``per_rollout_us`` / ``baseline_us`` / ``ratio`` by wall clock (the headline: idle
waits, e.g. a worker-thread hop, count), and the same by this process's CPU time
(``cpu_*``), which other processes on a shared machine cannot inflate. Here nothing waits, so
the two agree on an idle machine; when they differ, the machine was busy.

Note on what makes the orchestrator cheap here: the instant engine answers without suspending,
so the dispatcher's eager start finishes each rollout in its first step and no Task is created
for it (Python 3.12's eager tasks do the same). A real engine suspends, so its rollouts get a
Task each; the engine's own latency then dwarfs that cost.

    python benchmarks/orchestrator_overhead.py --json [--steps 40]
    python benchmarks/orchestrator_overhead.py --breakdown   # where the time goes (cProfile)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import time

from jaxrl_orch.tools.simulate import Scenario, run_scenario


async def _baseline(n: int) -> tuple[float, float]:
    q: asyncio.Queue = asyncio.Queue()

    async def item(i: int) -> None:
        await q.put(i)

    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        asyncio.create_task(item(i))
        await q.get()
    return time.perf_counter() - t0, time.process_time() - c0


def _scenario(steps: int, batch: int, group: int) -> Scenario:
    return Scenario(
        max_staleness=1,
        batch_size=batch,
        group_size=group,
        max_concurrent=2 * batch,
        latency="fixed:0",
        train_time=0.0,
        steps=steps,
    )


def measure(steps: int, batch: int, group: int, repeats: int) -> dict[str, float]:
    sc = _scenario(steps, batch, group)
    n = steps * batch
    orch, base = [], []
    for _ in range(repeats):  # interleaved so both see the same machine state
        # Each side starts with no garbage left by the other (its own collections still count).
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        result = asyncio.run(run_scenario(sc))
        orch.append((time.perf_counter() - t0, time.process_time() - c0))
        assert result["steps"] == steps, result
        gc.collect()
        base.append(asyncio.run(_baseline(n)))
    per, base_us = (min(x[0] for x in orch) / n * 1e6, min(x[0] for x in base) / n * 1e6)
    cpu, cpu_base = (min(x[1] for x in orch) / n * 1e6, min(x[1] for x in base) / n * 1e6)
    return {
        "per_rollout_us": per,
        "baseline_us": base_us,
        "ratio": per / base_us,
        "cpu_per_rollout_us": cpu,
        "cpu_baseline_us": cpu_base,
        "cpu_ratio": cpu / cpu_base,
        "rollouts": n,
    }


# Stage -> the function whose cumulative time it is (cProfile names: file suffix, function).
_STAGES = {
    "env + simulated engine": ("simulate.py", "run"),
    "dispatcher (incl. env)": ("dispatch.py", "_fill"),
    "sink: traces -> samples": ("train_sink.py", "_tokenize"),
    "sink: score, filter": ("train_sink.py", "_process_group"),
    "sink: add (incl. the two above)": ("train_sink.py", "add"),
    "ship: batch, stamps, metrics": ("shipping.py", "try_ship"),
}


def breakdown(steps: int, batch: int, group: int) -> dict[str, float]:
    """Cumulative time per stage from one profiled run, in us per rollout. cProfile inflates
    every Python call, so compare shares, not absolute values, with ``measure``."""
    sc = _scenario(steps, batch, group)
    asyncio.run(run_scenario(sc))  # warm imports and caches
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(asyncio.run, run_scenario(sc))
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    n = steps * batch
    out = {"total (profiled)": total / n * 1e6}
    for stage, (suffix, func) in _STAGES.items():
        ct = sum(v[3] for k, v in stats.items() if k[0].endswith(suffix) and k[2] == func)
        out[stage] = ct / n * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--breakdown", action="store_true", help="profile one run; print stages")
    a = p.parse_args()
    if a.breakdown:
        b = breakdown(a.steps, a.batch_size, a.group_size)
        if a.json:
            print(json.dumps(b))
        else:
            for stage, us in b.items():
                print(f"{us:7.2f} us/rollout  {stage}")
        return
    r = measure(a.steps, a.batch_size, a.group_size, a.repeats)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['per_rollout_us']:.1f} us/rollout through the orchestrator vs "
            f"{r['baseline_us']:.1f} us bare asyncio: ratio {r['ratio']:.2f} "
            f"(CPU time: {r['cpu_per_rollout_us']:.1f} vs {r['cpu_baseline_us']:.1f} us, "
            f"ratio {r['cpu_ratio']:.2f})"
        )


if __name__ == "__main__":
    main()
