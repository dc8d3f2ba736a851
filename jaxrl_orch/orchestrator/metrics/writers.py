"""Metric writers: where step rows, eval rows and gauge snapshots go.

What it owns: the ``types.MetricsWriter`` implementations (``write(step, metrics)``,
``close()``): ``ConsoleWriter`` one compact line per write (chosen keys, ``*`` patterns
allowed); ``ProgressWriter`` a tqdm bar over a stage's steps (on a terminal only; console lines
go through ``tqdm.write`` so they never tear it); ``JsonlWriter`` one JSON object per line with
``step`` and ``time`` (non-finite values become ``null``); ``TensorBoardWriter`` scalars via
tensorboardX. ``stage(title, detail)`` prints a stage header (data, warm-up, RL, final eval,
export) the same way. Values must be real numbers; anything else raises naming the key
(``clean_metrics``).

Who writes through them: the orchestrator's step ledger (one row per step) and eval rows, the
periodic logger (gauges), the warm-up and the imitation control. A helper, not a component: it
never reads a component, and never affects training.
"""

from __future__ import annotations

import fnmatch
import importlib.abc
import math
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from tqdm import tqdm

from jaxrl_orch.paths import JsonlAppender


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"metric keys must be str, got {key!r}")
        if not isinstance(value, numbers.Real):
            raise ValueError(
                f"metric {key!r} must be a real number (int, float, bool, numpy scalar), "
                f"got {type(value).__name__}: {value!r}"
            )
        out[key] = float(value)
    return out


def stage(title: str, detail: str) -> None:
    """A stage header on the console (through tqdm, so it never tears a progress bar)."""
    tqdm.write(f"== {title}: {detail}")


class ConsoleWriter:
    """One compact line per write: ``step 12 | a/b=0.5 c/d=3``.

    ``keys``: which metrics, in order; a key with ``*`` is a pattern (``"eval/*/reward_mean"``)
    matching any metric of the write, sorted. ``None`` prints every metric.
    """

    def __init__(self, stream: TextIO | None = None, keys: Sequence[str] | None = None) -> None:
        self.stream = stream
        self.keys = list(keys) if keys is not None else None

    def _chosen(self, m: dict[str, float]) -> list[str]:
        if self.keys is None:
            return sorted(m)
        out: list[str] = []
        for key in self.keys:
            if "*" in key:
                out += [k for k in sorted(m) if fnmatch.fnmatchcase(k, key) and k not in out]
            elif key in m and key not in out:
                out.append(key)
        return out

    def write(self, step: int, metrics: dict[str, float]) -> None:
        m = clean_metrics(metrics)
        body = " ".join(f"{k}={m[k]:.4g}" for k in self._chosen(m))
        if not body:
            return  # none of the chosen keys: no empty line
        stream = self.stream or sys.stdout
        tqdm.write(f"step {step} | {body}", file=stream)  # clears and redraws any live bar
        stream.flush()

    def close(self) -> None:
        pass


class ProgressWriter:
    """A progress bar over ``total`` steps, advanced to each write's step (never backwards:
    eval rows repeat a step). ``postfix_keys`` are shown next to it when a write has them.

    ``disable=None`` shows the bar only when ``stream`` is a terminal, so logs and captured
    output get the console lines without carriage-return noise.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "rl",
        postfix_keys: Sequence[str] = (),
        stream: TextIO | None = None,
        disable: bool | None = None,
    ) -> None:
        if total < 0 or not 0 <= initial <= total:
            raise ValueError(f"need 0 <= initial <= total, got initial={initial} total={total}")
        self.postfix_keys = list(postfix_keys)
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=stream or sys.stderr,
            disable=disable,
            dynamic_ncols=True,
        )

    @property
    def position(self) -> int:
        return int(self.bar.n)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        m = clean_metrics(metrics)
        shown = {k.rsplit("/", 1)[-1]: f"{m[k]:.3g}" for k in self.postfix_keys if k in m}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)
        elif shown:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class JsonlWriter:
    """Appends one JSON object per write, durable when it returns (``paths.JsonlAppender``:
    a local file or a ``gs://`` object), so a crash loses nothing. The file is opened at the
    first write, so a resume may trim it after the writer exists."""

    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.time) -> None:
        self._out = JsonlAppender(path)
        self.path = os.fspath(self._out.path)
        self.clock = clock

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row: dict[str, Any] = {"step": int(step), "time": self.clock()}
        for k, v in clean_metrics(metrics).items():
            row[k] = v if math.isfinite(v) else None  # strict JSON has no NaN/inf
        self._out.append(row)

    def close(self) -> None:
        self._out.close()


class TensorBoardWriter:
    """Scalars to a TensorBoard event file under ``logdir`` (tensorboardX, no TensorFlow)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        self.logdir = os.fspath(logdir)
        # One at a time: the run builds its two writers at once, on threads of their own
        # (``OffLoop``), and tensorboardX makes a missing logdir with a plain ``os.makedirs``
        # after an existence check, so the writer of ``tb`` failed when the one of ``tb/steps``
        # made ``tb`` between the two.
        with _TENSORBOARD_BUILD:
            self._w = _summary_writer()(self.logdir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in clean_metrics(metrics).items():
            self._w.add_scalar(k, v, int(step))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class _NoTorchOnThisThread(importlib.abc.MetaPathFinder):
    """Fails ``import torch`` on the one thread importing tensorboardX, while it does; any other
    thread (an environment's reward model, say) imports torch as usual meanwhile. Put first on
    ``sys.meta_path`` once and left there, idle: taking it out again would shift the list under
    another thread's import as it walks it, which could then skip a finder."""

    def __init__(self) -> None:
        self.thread: int | None = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if self.thread == threading.get_ident() and name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r} (left out)", name=name)
        return None


_TENSORBOARD_BUILD = threading.Lock()
_NO_TORCH = _NoTorchOnThisThread()


def _summary_writer() -> Any:
    """tensorboardX's ``SummaryWriter``, imported here (it pulls in protobuf) and without torch:
    tensorboardX imports torch wherever it is installed (about a second of every run's start),
    only to accept torch tensors, and this writer hands it floats. A finder first on
    ``sys.meta_path`` fails that optional import as if torch were absent, on this thread and for
    the length of this import only: the run builds its TensorBoard writers on threads of their
    own (``OffLoop``), beside the rollouts. A process that imported torch already keeps it.
    Called under ``_TENSORBOARD_BUILD``."""
    if _NO_TORCH not in sys.meta_path:
        sys.meta_path.insert(0, _NO_TORCH)
    _NO_TORCH.thread = threading.get_ident()
    try:
        from tensorboardX import SummaryWriter
    finally:
        _NO_TORCH.thread = None
    return SummaryWriter
