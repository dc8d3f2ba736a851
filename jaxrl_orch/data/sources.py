"""Prompt sources (``types.Source``): random-access datasets walked in a seeded, resumable order.

What this module owns
- ``EpochCursor``: the position ``(epoch, index)`` in an endless walk over ``size`` items. Each
  epoch visits every item once, in the order of a permutation seeded by ``(seed, epoch)``
  (identity when ``shuffle=False``). The cursor is the whole state: no buffer, no RNG object,
  so a checkpoint is three integers and resuming is exact.
- ``DatasetSource``: a cursor over any random-access data source (``len`` + ``__getitem__``,
  e.g. tfds' ``ArrayRecordDataSource``), turning each record into a plain ``dict`` example
  (bytes -> str, NumPy scalars -> Python numbers) with an optional field mapping
  ``{example_key: record_key}`` and optional constant ``extra`` keys (e.g. ``{"env":
  "arithmetic"}`` so one shared source can route examples to several envs).
- ``make_source(name, ...)``: a bundled dataset (``reverse_text``, ``arithmetic``; built on
  first use by ``builders.prepare``), a user text file (``text:PATH``, or any name ending in
  ``.txt``), or any prepared tfds dataset by name + ``data_dir``.
- ``TextFileSource(path, split=...)``: one example per non-empty line of a user text file.
  ``split="train"``/``"eval"`` divide the distinct lines by a hash of their text (about one in
  ``TEXT_EVAL_BUCKETS`` goes to eval), so the two splits are disjoint by construction, a
  repeated line lands on one side only, and adding lines never moves an existing one.

Invariants
- ``restore(state())`` in a fresh source over the same data yields exactly the examples the
  original would have yielded next (tested). ``restore`` refuses a state whose ``size``,
  ``seed`` or ``shuffle`` differ from this source's: resuming over different data would
  silently change the prompt stream.
- Per-epoch permutations come from ``np.random.default_rng([seed, epoch])``; they are
  reproducible for a given NumPy version (Generator streams may change across major NumPy
  releases, which would change the order, not the coverage).

Driven by the dispatcher (``next_example``) and the checkpointer (``state``/``restore``). A
source never touches the network or the model; it is not thread-safe (one dispatcher owns it).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_orch.data.builders import BUILDERS, load_split


class EpochCursor:
    """Seeded per-epoch permutation walk over ``range(size)``; state = ``(epoch, index)``."""

    def __init__(self, size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError(f"cannot walk an empty dataset (size={size})")
        self.size = int(size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.index = 0
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            else:
                self._order = np.arange(self.size)
            self._order_epoch = epoch
        assert self._order is not None
        return self._order

    def next_index(self) -> int:
        if self.index >= self.size:
            self.epoch += 1
            self.index = 0
        i = int(self._permutation(self.epoch)[self.index])
        self.index += 1
        return i

    def state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "size": self.size,
            "shuffle": self.shuffle,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        missing = {"epoch", "index", "seed", "size", "shuffle"} - set(state)
        if missing:
            raise ValueError(f"source state is missing keys {sorted(missing)}: {dict(state)!r}")
        mine = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle}
        theirs = {k: state[k] for k in mine}
        if theirs != mine:
            raise ValueError(
                f"source state was saved for {theirs} but this source has {mine}; "
                "restore it into a source over the same data with the same seed and shuffle"
            )
        epoch = int(state["epoch"])
        index = int(state["index"])
        if epoch < 0 or not 0 <= index <= self.size:
            raise ValueError(f"bad cursor in source state: epoch={epoch}, index={index}")
        self.epoch = epoch
        self.index = index


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


class DatasetSource:
    """A ``types.Source`` over a random-access data source of dict records."""

    def __init__(
        self,
        data: Sequence[Mapping[str, Any]],
        *,
        fields: Mapping[str, str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        extra: Mapping[str, Any] | None = None,
        name: str = "dataset",
    ) -> None:
        self.data = data
        self.name = name
        self.extra = dict(extra or {})
        self.cursor = EpochCursor(len(data), seed=seed, shuffle=shuffle)
        self.fields = dict(fields) if fields is not None else None
        if self.fields is not None:
            available = sorted(data[0].keys())
            missing = sorted(set(self.fields.values()) - set(available))
            if missing:
                raise ValueError(
                    f"field mapping {self.fields} names fields {missing} that {name!r} lacks; "
                    f"available fields: {available}"
                )

    def __len__(self) -> int:
        return self.cursor.size

    def where(self, i: int) -> str:
        """Where example ``i`` comes from, for error messages."""
        return f"example {i} of {self.name}"

    def example_at(self, i: int) -> dict[str, Any]:
        record = self.data[i]
        if self.fields is None:
            example = {k: _plain(v) for k, v in record.items()}
        else:
            example = {dst: _plain(record[src]) for dst, src in self.fields.items()}
        return {**example, **self.extra}

    def next_example(self) -> dict[str, Any]:
        return self.example_at(self.cursor.next_index())

    def state(self) -> dict[str, Any]:
        return self.cursor.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.cursor.restore(state)


def make_source(
    name: str,
    *,
    split: str = "train",
    data_dir: str | Path | None = None,
    config: Any = None,
    fields: Mapping[str, str] | None = None,
    seed: int = 0,
    shuffle: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> DatasetSource:
    """A source over bundled dataset ``name`` (built on first use) or a prepared tfds dataset.

    For a non-bundled tfds dataset, ``name`` is its tfds name (``"mnist"``,
    ``"my_set/config:1.0.0"``) and ``data_dir`` the directory it was prepared into; nothing is
    downloaded or built.
    """
    text_path = text_file_path(name)
    if text_path is not None:
        # data_dir is for tfds datasets and does not apply here (a run may name both kinds).
        if config is not None or fields is not None:
            raise ValueError(
                f"a text file dataset ({name!r}) takes no config or fields; each non-empty "
                "line becomes one example {'text': line}"
            )
        return TextFileSource(text_path, split=split, seed=seed, shuffle=shuffle, extra=extra)
    bundled = {short for short in BUILDERS} | {cls.name for cls in BUILDERS.values()}
    if name in bundled:
        data = load_split(name, split, data_dir, config)
    else:
        if config is not None:
            raise ValueError(
                f"config= applies to bundled datasets {sorted(BUILDERS)}, "
                f"not {name!r}; put the config in the name ('{name}/<config>')"
            )
        try:
            data = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        # Unknown name -> DatasetNotFoundError (a ValueError); known but not prepared as
        # array_record -> NotImplementedError; missing files -> OSError.
        except (ValueError, NotImplementedError, OSError) as exc:
            raise ValueError(
                f"cannot open tfds dataset {name!r} split {split!r} in data_dir "
                f"{str(data_dir)!r} ({type(exc).__name__}: {exc}); bundled datasets: "
                f"{sorted(BUILDERS)}"
            ) from exc
    return DatasetSource(
        data, fields=fields, seed=seed, shuffle=shuffle, extra=extra, name=f"{name}:{split}"
    )


TEXT_PREFIX = "text:"
TEXT_SPLITS = ("train", "eval", "all")
TEXT_EVAL_BUCKETS = 10


def text_file_path(name: str) -> Path | None:
    """The path a dataset name refers to when it names a text file, else None."""
    if name.startswith(TEXT_PREFIX):
        return Path(name[len(TEXT_PREFIX) :])
    return Path(name) if name.endswith(".txt") else None


def text_split_of(line: str) -> str:
    """``"eval"`` for about one line in ``TEXT_EVAL_BUCKETS`` (by CRC-32 of its text), else
    ``"train"``; stable across runs, machines and Python versions."""
    return "eval" if zlib.crc32(line.encode("utf-8")) % TEXT_EVAL_BUCKETS == 0 else "train"


class TextFileSource(DatasetSource):
    """One example ``{field: line}`` per non-empty line (stripped) of a UTF-8 text file.

    ``split``: ``"all"`` keeps every line; ``"train"``/``"eval"`` keep the distinct lines that
    ``text_split_of`` assigns to that side (see the module docstring).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        split: str = "all",
        field: str = "text",
        seed: int = 0,
        shuffle: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if split not in TEXT_SPLITS:
            raise ValueError(f"text file split must be one of {TEXT_SPLITS}, got {split!r}")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"text file source {str(path)!r} does not exist")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise ValueError(
                f"text file source {str(path)!r} is not UTF-8 text: byte {exc.start} (line "
                f"{line}) is {raw[exc.start : exc.start + 1]!r}; give one UTF-8 example per line"
            ) from None
        numbered = [(n, s.strip()) for n, s in enumerate(text.splitlines(), 1) if s.strip()]
        if not numbered:
            raise ValueError(f"text file source {str(path)!r} has no non-empty lines")
        if split != "all":
            first = {}
            for n, s in numbered:
                first.setdefault(s, n)
            numbered = [(n, s) for s, n in first.items() if text_split_of(s) == split]
            if not numbered:
                raise ValueError(
                    f"text file source {str(path)!r} has no line in its {split!r} split (about "
                    f"1 in {TEXT_EVAL_BUCKETS} distinct lines goes to 'eval'); add lines, or "
                    "name a separate eval file with Data.eval_dataset"
                )
        self.path = path
        self.line_numbers = [n for n, _ in numbered]
        records = [{field: s} for _, s in numbered]
        super().__init__(records, seed=seed, shuffle=shuffle, extra=extra, name=f"{path}:{split}")

    def where(self, i: int) -> str:
        return f"{self.path} line {self.line_numbers[i]}"
