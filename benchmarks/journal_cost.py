"""Benchmark: what the rollout journal costs the event loop per finished rollout.

What it measures, in one process on the same rollouts: ``RolloutJournal.landed`` (encode one
``done`` line per rollout, append, flush: what the loop pays as each train episode lands) against
the rollout store's encoding of the same rollouts (``store.rollout_record`` + ``json.dumps``,
what the shipper already paid per trained rollout before the journal existed, on a worker
thread). Rollouts are shaped like the main job's (``configs/reverse_text.gin``): a 48-token
prompt and a 64-token completion, one version per token. Best of ``--reps`` passes over
``--n`` rollouts each, into a temporary directory on this machine's disk.

How to run
    python benchmarks/journal_cost.py
    python benchmarks/journal_cost.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_orch.orchestrator.journal import RolloutJournal  # noqa: E402
from jaxrl_orch.orchestrator.store import rollout_record  # noqa: E402
from jaxrl_orch.types import Rollout  # noqa: E402

PROMPT, COMPLETION = 48, 64


def _rollouts(n: int) -> list[Rollout]:
    out = []
    for k in range(n):
        r = Rollout("reverse_text", k // 16, k, {"text": "the mill built its statue"})
        r.token_ids = list(range(PROMPT + COMPLETION))
        r.loss_mask = [False] * PROMPT + [True] * COMPLETION
        r.logprobs = [0.0] * PROMPT + [-0.7] * COMPLETION
        r.versions = [-1] * PROMPT + [3] * COMPLETION
        r.reward, r.num_turns, r.slot = 0.5, 1, (k // 16, k % 16)
        r.metrics = {"reward/full": 1.0}
        out.append(r)
    return out


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rollouts = _rollouts(args.n)
    with tempfile.TemporaryDirectory() as d:
        journal = RolloutJournal(os.path.join(d, "journal"))
        journal.begin(0, [])
        landed = _best(lambda: [journal.landed([r]) for r in rollouts], args.reps)
        journal.close()
    store = _best(lambda: [json.dumps(rollout_record(r)) for r in rollouts], args.reps)
    out = {
        "journal_us_per_rollout": round(landed / args.n * 1e6, 1),
        "store_encode_us_per_rollout": round(store / args.n * 1e6, 1),
        "ratio": round(landed / store, 2),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"journal: {out['journal_us_per_rollout']} us per rollout on the event loop; the "
        f"store's encoding of the same: {out['store_encode_us_per_rollout']} us "
        f"({out['ratio']}x)"
    )


if __name__ == "__main__":
    main()
