"""RolloutJournal: every finished train rollout on disk as it lands, so a restart loses none.

What it owns: the files under ``<workdir>/rollouts/journal/``, one per start of the run
(``epoch_<n>.jsonl``), and the four kinds of line the loop appends to the newest:

- ``open``: a train group was drawn from the data: its ordinal in the data order (the
  ``train_groups`` counter a checkpoint saves), its env and its example (JSON), so a restart
  can send the same prompt again;
- ``done``: a train rollout finished (its trace, as the store writes it, plus what the sink reads:
  reward, errors, finish, turns, metrics) with its slot, ``(ordinal, index in the group)``;
- ``scored``: the sink scored group ``ordinal`` whole; these members of it went to the ready
  list (the others were filtered or failed): once those ship, the group is settled;
- ``ship``: batch ``step`` was shipped with these slots trained, and these dropped by the
  ``drop`` policy.

Each file starts with the line ``{"epoch": n, "version": v}``: the trainer version the start
restored. Versions after ``v`` of the earlier starts were lost with them (the weights that made
them are gone), so reading the files in order (``replay``) forgets, at each epoch line, every
``done`` whose tokens came from a version after ``v`` and every ``ship`` of a step after ``v``
(never trained). What is left is the truth the restart plans from (``recovery.plan``).

Durable against kill -9: a local journal is appended and flushed per call (the kernel has the
bytes when ``landed`` returns; ``sync`` fsyncs them, at each checkpoint and at the end). On
``gs://``, objects cannot be appended: lines are buffered and written as a numbered part object
at each ``sync``, so a kill -9 there loses what landed since the last checkpoint (a SIGTERM
does not: the drain ends with a sync).

Bad input, counted (``problems``; the first bad line named), never fatal: a torn last line
(the kill), a line that is not JSON or not a record, a ``done`` from a version an epoch line
says was lost (``future``).

Who drives it: the loop (``landed`` per train episode; ``sync`` in ``checkpoint_state`` and at
shutdown), the shipper (``shipped``), the dispatcher's admission (``opened``, through a callable),
``loop.Orchestrator.start`` (``begin``: replay, then a new epoch file holding the live records).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from jaxrl_orch.paths import as_path, is_url
from jaxrl_orch.types import Rollout

_EPOCH_FILE = re.compile(r"^epoch_(\d{6,})(?:\.part(\d+))?\.jsonl$")
Slot = tuple[int, int]
_TRACE = ("token_ids", "loss_mask", "logprobs", "versions")
_DONE = (*_TRACE, "env", "slot", "reward", "errors", "trainable", "num_turns", "metrics")


def digest(example: Any) -> str:
    """A short hash of an example: a restart checks the data order still draws it."""
    text = json.dumps(example, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def stopped_by_run(r: Rollout) -> bool:
    """Cut short by the run's own stop (the drain's deadline, shutdown), not by its fate: a
    restart runs it again, so it is not journaled. The ``drop`` policy's cancellations are a
    decision of the run's and are kept ("group started at version ...")."""
    return any(e.startswith("Cancelled: ") and "started at version" not in e for e in r.errors)


def _trace(path: Any) -> dict[str, Any]:
    # As the rollout holds them: orjson writes numpy scalars and arrays, and a non-finite
    # log-prob (an engine that reported none) as null.
    return {k: getattr(path, k) for k in _TRACE}


def done_record(r: Rollout) -> dict[str, Any]:
    errors = list(r.errors)
    rec: dict[str, Any] = {"env": r.env, **dict.fromkeys(_TRACE, [])}
    if not errors:
        try:
            r.validate_trace()
            rec = {"env": r.env, **_trace(r), "live_policy": bool(r.live_policy)}
            if r.branches:
                rec["branches"] = [_trace(b) for b in r.branches]
        except ValueError as exc:  # a misaligned trace: the sink makes it an error rollout
            errors.append(f"{type(exc).__name__}: {exc}")
    return {
        "kind": "done",
        "slot": list(r.slot),
        **rec,
        "reward": r.reward if isinstance(r.reward, int | float) else None,
        "errors": errors,
        "trainable": bool(r.trainable) and not errors,
        "cut": r.cut,
        "num_turns": int(r.num_turns),
        "metrics": {k: float(v) for k, v in r.metrics.items() if not k.startswith("orch/")},
        "temperature": float(r.temperature),
    }


@dataclasses.dataclass
class Replay:
    """What the journal's files say, epoch purges applied: the open groups by ordinal, the
    ``done`` records by slot (the newest wins: a slot run again), the slots trained or dropped
    in surviving ``ship`` lines, and the problems met (kind -> count; ``named``: one line each
    for the console)."""

    opens: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    done: dict[Slot, dict[str, Any]] = dataclasses.field(default_factory=dict)
    shipped: dict[Slot, int] = dataclasses.field(default_factory=dict)
    dropped: dict[Slot, int] = dataclasses.field(default_factory=dict)
    scored: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    problems: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    named: list[str] = dataclasses.field(default_factory=list)

    def purge(self, version: int) -> None:
        """An epoch line: the run restarted from ``version``; later ones never happened."""
        lost = [s for s, rec in self.done.items() if max(rec["versions"], default=-1) > version]
        for s in lost:
            del self.done[s]
        self.problems["future"] += len(lost)
        for table in (self.shipped, self.dropped):
            for s in [s for s, step in table.items() if step > version]:
                del table[s]

    def read(self, name: str, raw: bytes) -> None:
        """One file's records into ``replay``; a torn last line and bad lines are counted."""
        lines = raw.split(b"\n")
        if lines and lines[-1]:
            self.problems["torn_line"] += 1  # no newline after it: the write a kill cut
        for n, line in enumerate(lines[:-1], start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if "epoch" in rec:
                    self.purge(int(rec["version"]))
                else:
                    self.take(rec)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                self.problems["bad_line"] += 1
                if self.problems["bad_line"] == 1:
                    self.named.append(f"{name} line {n}: {type(exc).__name__}: {exc}")

    def take(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "open":
            self.opens[int(rec["ordinal"])] = rec
        elif kind == "done":
            missing = [k for k in _DONE if k not in rec]
            if missing or len({len(rec[k]) for k in _TRACE}) != 1:
                raise ValueError(f"a done record without {missing} or with a misaligned trace")
            self.done[(int(rec["slot"][0]), int(rec["slot"][1]))] = rec
        elif kind == "scored":
            self.scored[int(rec["ordinal"])] = rec
        elif kind == "ship":
            step = int(rec["step"])
            for o, i in rec["trained"]:
                self.shipped[(int(o), int(i))] = step
            for o, i in rec.get("dropped", ()):
                self.dropped[(int(o), int(i))] = step
        else:
            raise ValueError(f"unknown record kind {kind!r}")


class RolloutJournal:
    """See the module docstring."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = as_path(path)
        self.remote = is_url(self.path)
        self._epoch = 0
        self._part = 0
        self._f: Any = None
        self._buf: list[str] = []
        self.lines_written = 0
        self.bytes_written = 0

    def files(self) -> list[Any]:
        if not self.path.exists():
            return []
        found = [(_EPOCH_FILE.match(p.name), p) for p in self.path.iterdir()]
        key = lambda mp: (int(mp[0].group(1)), int(mp[0].group(2) or 0))  # noqa: E731
        return [p for m, p in sorted(((m, p) for m, p in found if m), key=key)]

    def replay(self) -> Replay:
        """Read every file in order (blocking: call it off the event loop)."""
        replay = Replay()
        for p in self.files():
            replay.read(p.name, p.read_bytes())
            m = _EPOCH_FILE.match(p.name)
            self._epoch = max(self._epoch, int(m.group(1)))
        return replay

    def begin(self, version: int, live: Iterable[dict[str, Any]]) -> None:
        """Start this run's epoch file: its epoch line, then the ``live`` records a restart
        still needs (so the older files can go); the older files are then deleted."""
        old = self.files()
        self._epoch += 1
        self._part = 0
        self.path.mkdir(parents=True, exist_ok=True)
        self._write([{"epoch": self._epoch, "version": int(version)}, *live])
        self.sync()
        for p in old:
            p.unlink()

    def opened(self, env: str, ordinal: int, example: Any) -> None:
        rec = {"kind": "open", "ordinal": int(ordinal), "env": env, "digest": digest(example)}
        try:
            json.dumps(example, allow_nan=False)
            rec["example"] = example
        except (TypeError, ValueError):
            rec["example"] = None  # a restart cannot send it again: counted there
        self._write([rec])

    def landed(self, episode: Sequence[Rollout]) -> None:
        recs = [done_record(r) for r in episode if r.slot is not None and not stopped_by_run(r)]
        if recs:
            self._write(recs)

    def scored(self, group: Sequence[Rollout], ready: Sequence[Rollout]) -> None:
        """The sink scored ``group``: once its ``ready`` members ship, it is settled."""
        slots = [r.slot for r in group if r.slot is not None]
        if not slots:
            return
        rec = {
            "kind": "scored",
            "ordinal": slots[0][0],
            "members": [i for _, i in slots],
            "ready": [r.slot[1] for r in ready if r.slot is not None],
        }
        self._write([rec])

    def shipped(self, step: int, trained: Sequence[Rollout], dropped: Sequence[Rollout]) -> None:
        slots = lambda rs: [list(r.slot) for r in rs if r.slot is not None]  # noqa: E731
        self._write(
            [
                {
                    "kind": "ship",
                    "step": int(step),
                    "trained": slots(trained),
                    "dropped": slots(dropped),
                }
            ]
        )

    def _write(self, recs: Sequence[dict[str, Any]]) -> None:
        # orjson: ~4x the standard encoder on a rollout's lists of ints (the loop pays it per
        # rollout); a non-finite float becomes null, which a replay reads back as NaN.
        opt = orjson.OPT_SERIALIZE_NUMPY
        text = "".join(orjson.dumps(r, default=repr, option=opt).decode() + "\n" for r in recs)
        self.lines_written += len(recs)
        self.bytes_written += len(text)
        if self.remote:
            self._buf.append(text)
            return
        if self._f is None:
            name = self.path / f"epoch_{self._epoch:06d}.jsonl"
            self._f = open(name, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._f.write(text)
        self._f.flush()

    def sync(self) -> None:
        """Durable past a machine crash: fsync (local) or the buffered part's object (gs://)."""
        if self._f is not None:
            os.fsync(self._f.fileno())
        elif self.remote and self._buf:
            part = self.path / f"epoch_{self._epoch:06d}.part{self._part}.jsonl"
            part.write_text("".join(self._buf))
            self._buf = []
            self._part += 1

    def close(self) -> None:
        self.sync()
        if self._f is not None:
            self._f.close()
            self._f = None

    def gauges(self) -> dict[str, float]:
        return {
            "journal/lines_written": float(self.lines_written),
            "journal/bytes_written": float(self.bytes_written),
        }
