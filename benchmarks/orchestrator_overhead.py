"""Orchestrator overhead: is the host loop ever the bottleneck?

Pushes rollouts through the real path (gate -> dispatcher -> environment -> out_q -> main loop
-> train sink (tokenize, group, advantages) -> batch -> trainer) with an engine and a trainer
that take no time, on a real asyncio loop, and compares the cost per rollout with a bare asyncio
baseline measured in the same run: one task plus one queue round trip per item, the least any
asyncio pipeline pays. Goal: ratio <= 3.

    python benchmarks/orchestrator_overhead.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from jaxrl_orch.simulate import Scenario, run_scenario


async def _baseline(n: int) -> float:
    q: asyncio.Queue = asyncio.Queue()

    async def item(i: int) -> None:
        await q.put(i)

    t0 = time.perf_counter()
    for i in range(n):
        asyncio.create_task(item(i))
        await q.get()
    return time.perf_counter() - t0


def measure(steps: int, batch: int, group: int, repeats: int) -> dict[str, float]:
    sc = Scenario(
        max_staleness=1,
        batch_size=batch,
        group_size=group,
        max_concurrent=2 * batch,
        latency="fixed:0",
        train_time=0.0,
        steps=steps,
    )
    n = steps * batch
    orch_s, base_s = [], []
    for _ in range(repeats):  # interleaved so both see the same machine state
        t0 = time.perf_counter()
        result = asyncio.run(run_scenario(sc))
        orch_s.append(time.perf_counter() - t0)
        assert result["steps"] == steps, result
        base_s.append(asyncio.run(_baseline(n)))
    per = min(orch_s) / n * 1e6
    base = min(base_s) / n * 1e6
    return {"per_rollout_us": per, "baseline_us": base, "ratio": per / base, "rollouts": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = measure(a.steps, a.batch_size, a.group_size, a.repeats)
    if a.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['per_rollout_us']:.1f} us/rollout through the orchestrator vs "
            f"{r['baseline_us']:.1f} us bare asyncio: ratio {r['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
