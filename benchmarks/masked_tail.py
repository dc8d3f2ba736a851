"""What a "masked tail" bound would keep: admit's speed, minus every token older than S.

    python benchmarks/masked_tail.py --json           # the long-tail scenario, S = 2, seeds 0-2

The idea measured here: run the ``admit`` policy (full speed: nothing waits for a straggler),
but take every token whose version is more than S behind the step that trains it out of the
loss, so that no *trained token* is older than S. A rollout all of whose tokens are too old
keeps nothing: it is lost as surely as under ``drop``. Per-token versions come from the
simulated engine (first half of a rollout stamped at its start, second half at its end, as
weights swap mid-rollout in the real engine), so a straggler's tail is fresh; what the
measurement shows is what happens to its group's siblings, which landed early and waited in
the sink for it: their tokens are as old as the group's head.

For each latency tail and seed, from one ``admit`` run of the real orchestrator on the virtual
clock: steps/s (the masked tail's, which never waits), rollouts with no token left, the share of
tokens masked, and the oldest trained token. ``docs/staleness.md`` quotes the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np

from jaxrl_orch.orchestrator.vclock import run_virtual
from jaxrl_orch.tools.simulate import Scenario, SimTrainer, build_scenario


def _recording_trainer(record: list[tuple[int, np.ndarray]]) -> type[SimTrainer]:
    class Recording(SimTrainer):
        """Keeps, per trained rollout, the step and the versions of its model tokens."""

        def submit(self, batch):
            for r in batch.trained:
                versions = [v for v, m in zip(r.versions, r.loss_mask, strict=True) if m]
                record.append((batch.step, np.asarray(versions)))
            super().submit(batch)

    return Recording


async def _run(sc: Scenario, record: list[tuple[int, np.ndarray]]) -> float:
    orch, _, trainer = build_scenario(sc, _recording_trainer(record))
    try:
        history = await orch.run()
    finally:
        trainer.close()
    return len(history) / asyncio.get_running_loop().time()


def measure(sc: Scenario) -> dict[str, float]:
    """The masked tail's figures for one ``admit`` scenario."""
    record: list[tuple[int, np.ndarray]] = []
    steps_per_s, _ = run_virtual(lambda: _run(sc, record))
    emptied = masked = tokens = 0
    oldest = 0
    for step, versions in record:
        keep = versions >= step - 1 - sc.max_staleness
        masked += int((~keep).sum())
        tokens += versions.size
        if keep.any():
            oldest = max(oldest, int(step - 1 - versions[keep].min()))
        else:
            emptied += 1
    return {
        "steps_per_second": steps_per_s,
        "rollouts": len(record),
        "rollouts_emptied": emptied,
        "emptied_share": emptied / len(record),
        "tokens_masked_share": masked / tokens,
        "trained_token_age_max": oldest,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency", nargs="*", default=["lognormal:0:0.9", "lognormal:0:0.6"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for latency in args.latency:
        for seed in range(args.seeds):
            sc = Scenario(
                max_staleness=args.max_staleness,
                batch_size=16,
                group_size=4,
                max_concurrent=128,
                latency=latency,
                train_time=1.0,
                steps=args.steps,
                policy="admit",
                seed=seed,
            )
            rows.append({"latency": latency, "seed": seed, **measure(sc)})
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(
                f"{row['latency']} seed {row['seed']}: {row['steps_per_second']:.3f} steps/s, "
                f"{row['rollouts_emptied']} of {row['rollouts']} rollouts emptied "
                f"({row['emptied_share']:.1%}), {row['tokens_masked_share']:.1%} of tokens "
                f"masked, oldest trained token {row['trained_token_age_max']}"
            )


if __name__ == "__main__":
    main()
