"""What a restart keeps of the journal, what it sends again, and what it cannot trust.

What it owns: ``plan`` (a ``journal.Replay`` -> ``Recovery``) and ``Recovery``, which the
dispatcher consumes while it admits (``take``, ``reissue``) and the train sink reads
(``trained_before``).

The rule, for the run restarting from trainer version ``v`` with the data cursor at ordinal
``T`` (the checkpoint's ``train_groups``: groups ``< T`` were drawn before it was saved):

- a group the sink scored whose every ready rollout was shipped by step ``v`` is settled:
  forgotten;
- otherwise its finished rollouts are kept (their versions are their true ones), except those
  that could not be trained within the bound at step ``v + 1`` (a head version below
  ``v - S``: ``expired``), which run again;
- rollouts already trained by step ``v`` of an unsettled group come back with it
  (``trained_before``): the sink scores the group whole, as before, and trains only the rest;
- members without a finished rollout run again with the same seeds (``reissued``): for
  ``o < T`` from the journal's copy of the example (the data cursor is past it), for
  ``o >= T`` when the data order draws the ordinal again (its example must hash the same, or
  the kept rollouts are not used: ``mismatched``);
- a group that cannot complete (no copy of its example to send again: ``unsendable``) is
  dropped whole and counted; a ``done`` from a lost version is forgotten and counted
  (``future``, by the replay's purge), and its member runs again.

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from jaxrl_orch.orchestrator.journal import Replay, Slot, digest
from jaxrl_orch.types import Branch, Rollout


@dataclasses.dataclass
class Recovery:
    """See the module docstring. ``live``: the records the new epoch file starts with."""

    reissue: collections.deque = dataclasses.field(default_factory=collections.deque)
    kept: dict[int, dict[int, Rollout]] = dataclasses.field(default_factory=dict)
    expect: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    trained_before: set[Slot] = dataclasses.field(default_factory=set)
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    live: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    named: list[str] = dataclasses.field(default_factory=list)

    def take(self, ordinal: int, env: str, example: Any) -> dict[int, Rollout]:
        """The kept rollouts of group ``ordinal`` now opening (index -> rollout)."""
        kept = self.kept.pop(ordinal, {})
        want = self.expect.pop(ordinal, None)
        if kept and want is not None and want != (env, digest(example)):
            self.counts["mismatched"] += len(kept)
            return {}
        return kept

    def summary(self) -> dict[str, int]:
        keys = ("kept", "trained_before", "reissued", "expired", "future", "unsendable")
        return {k: int(self.counts[k]) for k in (*keys, "mismatched", "torn_line", "bad_line")}


def rollout_from(rec: dict[str, Any], example: Any) -> Rollout:
    """A ``done`` record back as the rollout it was (ids are restamped when it is emitted)."""
    nan = float("nan")
    r = Rollout(
        rec["env"],
        0,
        0,
        example,
        token_ids=list(rec["token_ids"]),
        loss_mask=list(rec["loss_mask"]),
        logprobs=[nan if x is None else float(x) for x in rec.get("logprobs", [])],
        versions=list(rec.get("versions", [])),
        reward=nan if rec["reward"] is None else rec["reward"],
        metrics=dict(rec["metrics"]),
        errors=list(rec["errors"]),
        num_turns=int(rec["num_turns"]),
        temperature=float(rec["temperature"]),
        trainable=bool(rec["trainable"]),
        cut=rec["cut"],
        live_policy=bool(rec.get("live_policy", True)),
    )
    for b in rec.get("branches", ()):
        lp = [nan if x is None else float(x) for x in b["logprobs"]]
        r.branches.append(Branch(b["token_ids"], b["loss_mask"], lp, b["versions"]))
    return r


def _head(rec: dict[str, Any]) -> int | None:
    vs = [v for v, m in zip(rec["versions"], rec["loss_mask"], strict=False) if m and v >= 0]
    return min(vs) if vs else None


def plan(
    replay: Replay, *, version: int, max_staleness: int, next_ordinal: int, group_size: int
) -> Recovery:
    """The restart's ``Recovery`` (the module docstring has the rule)."""
    replay.purge(version)  # this start's own epoch line: what came after ``version`` is lost
    rec = Recovery()
    rec.counts.update(replay.problems)
    rec.named.extend(replay.named)
    members: dict[int, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
    for (o, i), r in replay.done.items():
        members[o][i] = r
    consumed = {**replay.shipped, **replay.dropped}
    for o in sorted(set(members) | set(replay.opens)):
        _plan_group(
            rec,
            replay,
            o,
            members.get(o, {}),
            consumed,
            version - max_staleness,
            next_ordinal,
            group_size,
        )
    return rec


def _settled(replay: Replay, o: int, done: dict, consumed: dict) -> bool:
    scored = replay.scored.get(o)
    if scored is None or len(done) < len(scored["members"]):
        return False
    return all((o, i) in consumed for i in scored["ready"])


def _plan_group(
    rec: Recovery,
    replay: Replay,
    o: int,
    done: dict[int, dict[str, Any]],
    consumed: dict[Slot, int],
    oldest: int,
    next_ordinal: int,
    group_size: int,
) -> None:
    if _settled(replay, o, done, consumed):
        return
    opened = replay.opens.get(o)
    kept: dict[int, dict[str, Any]] = {}
    for i, r in done.items():
        head = _head(r)
        fresh = (o, i) in consumed or r["errors"] or head is None or head >= oldest
        if fresh:
            kept[i] = r
        else:
            rec.counts["expired"] += 1
    missing = group_size - len(kept)
    example = None if opened is None else opened.get("example")
    if opened is None or (o < next_ordinal and example is None):
        rec.counts["unsendable"] += group_size
        return
    env = opened["env"]
    rec.kept[o] = {i: rollout_from(r, example) for i, r in kept.items()}
    for i in kept:
        if (o, i) in consumed:
            rec.trained_before.add((o, i))
    rec.counts["trained_before"] += sum((o, i) in consumed for i in kept)
    rec.counts["kept"] += sum(
        (o, i) not in consumed and not r["errors"] and r["trainable"] for i, r in kept.items()
    )
    rec.counts["reissued"] += missing
    if o < next_ordinal:
        rec.reissue.append((env, o, example))
    else:
        rec.expect[o] = (env, opened["digest"])
    rec.live.append(opened)
    rec.live.extend(kept.values())
    ship = [[o, i] for i in kept if (o, i) in consumed]
    if ship:
        rec.live.append({"kind": "ship", "step": 0, "trained": ship, "dropped": []})
