"""Stopping a train command at chosen moments of its run, and what its workdir must hold after.

Shared by ``tests/run/test_kill_anywhere.py`` (kill -9) and ``test_term_anywhere.py``
(SIGTERM): ``interrupt`` starts the command and sends its signals once the moment is due;
``check_nothing_lost`` reads what the finished run left and asserts the journal's promise;
``journal_counts`` adds up what each start said it gave back.
"""

from __future__ import annotations

import collections
import json
import random
import re
import signal
import subprocess
import time
from pathlib import Path

from jaxrl_orch.orchestrator.journal import RolloutJournal
from support.train_cmd import all_rows, checkpoints, rl_rows, train_cmd, train_env

GROUP = 4  # train_cmd.TINY's group size
BATCH = 8  # its prompts per step x group size


def _rl_steps(wd: Path) -> list[int]:
    return [r["step"] for r in rl_rows(wd)] if (wd / "metrics.jsonl").exists() else []


def _evals(wd: Path) -> list[int]:
    rows = all_rows(wd) if (wd / "metrics.jsonl").exists() else []
    return [r["step"] for r in rows if any(k.startswith("eval/") for k in r)]


def _writing(wd: Path) -> bool:
    d = wd / "checkpoints"
    return d.exists() and any(not p.name.isdigit() for p in d.iterdir())


def _due(moment: str, wd: Path, start: dict) -> bool:
    """Whether the signal for ``moment`` is due, against the workdir as the start found it."""
    rows = _rl_steps(wd)
    if moment == "warmup":
        return (wd / "sft").exists() or bool(rows)
    if moment == "rl":
        return bool(rows) and max(rows) > start["rl"]
    if moment == "checkpoint":  # a write in progress, else the moment it committed
        return _writing(wd) or (checkpoints(wd) or [0])[-1] > start["ckpt"]
    if moment == "eval":
        return max(_evals(wd), default=-1) > start["eval"]
    if moment == "export":
        return (wd / "export").exists()
    return time.monotonic() > start["t"]  # "start": a random moment after the command began


def interrupt(
    wd: Path,
    moment: str,
    rng: random.Random,
    log: Path,
    params: list[str],
    signals: tuple[int, ...] = (signal.SIGKILL,),
) -> int | None:
    """One start of the command, sent ``signals`` at ``moment`` (a random 0-1 s later, and
    0-1 s between two signals); returns its exit code, or None if it ended first. A warm-up
    moment once the warm-up is done becomes a random one after the start."""
    start = {
        "rl": max(_rl_steps(wd), default=0),
        "ckpt": (checkpoints(wd) or [0])[-1],
        "eval": max(_evals(wd), default=-1),
        "t": time.monotonic() + rng.uniform(2.0, 15.0),
    }
    if moment == "warmup" and checkpoints(wd):
        moment = "start"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            train_cmd(wd, *params), env=train_env(1), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            while not _due(moment, wd, start):
                if proc.poll() is not None:
                    return None
                time.sleep(0.01)
            if moment not in ("checkpoint", "export"):  # those are short: at once
                time.sleep(rng.uniform(0.0, 1.0))
            for k, sig in enumerate(signals):
                if k:
                    time.sleep(rng.uniform(0.0, 1.0))
                proc.send_signal(sig)
            return proc.wait(timeout=180)
        finally:
            proc.kill()


def _trained(wd: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in sorted((wd / "rollouts").glob("step_*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def _owed(wd: Path) -> set[int]:
    """Groups the finished run's journal still holds unsettled (in flight at its last step)."""
    replay = RolloutJournal(wd / "rollouts" / "journal").replay()
    settled = {
        o for o, rec in replay.scored.items() if all((o, i) in replay.shipped for i in rec["ready"])
    }
    return set(replay.opens) - settled


def _prompt(rec: dict) -> tuple[int, ...]:
    return tuple(t for t, m in zip(rec["token_ids"], rec["loss_mask"], strict=True) if not m)


def check_nothing_lost(wd: Path, steps: int, *, journal: bool = True) -> tuple[int, int]:
    """The finished run's promise: every step's row once, no rollout trained twice, one prompt
    per group, and every group the data order handed out trained whole or still owed by the
    journal. Returns (groups not trained whole, groups handed out); without the journal the
    first is what the stops lost, and nothing is asserted of it."""
    assert _rl_steps(wd) == list(range(1, steps + 1))
    trained = _trained(wd)
    slots = collections.Counter(tuple(r["slot"]) for r in trained)
    assert max(slots.values()) == 1, [s for s, n in slots.items() if n > 1]
    assert len(trained) == steps * BATCH
    groups = collections.defaultdict(list)
    for r in trained:
        groups[r["slot"][0]].append(r)
    for o, members in groups.items():  # a group sent again after a stop: the same prompt
        assert len({_prompt(r)[:24] for r in members}) == 1, o
    whole = {o for o, g in groups.items() if len(g) == GROUP}
    skipped = set(range(max(groups) + 1)) - whole
    if journal:
        assert skipped <= _owed(wd), (sorted(skipped), sorted(_owed(wd)))
    return len(skipped), max(groups) + 1


def journal_counts(logs: list[Path]) -> collections.Counter:
    """What each start's ``== journal:`` line said it gave back, added up."""
    got: collections.Counter = collections.Counter()
    for log in logs:
        m = re.search(r"== journal: rollouts kept (\d+) .*sent again (\d+)", log.read_text())
        if m:
            got["kept"] += int(m.group(1))
            got["sent again"] += int(m.group(2))
    return got
