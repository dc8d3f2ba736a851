"""``OffLoop(writer)``: a metrics writer whose writes run on a thread of its own, in order.

Why: the step ledger and the periodic logger write on the event loop. A W&B ``log`` talks to
W&B's service process and a TensorBoard flush writes a file; on a loaded host either took
more than half a second, and every rollout, the capacity gate and the trainer's feed wait for
the loop meanwhile. Wrapped, ``write`` only validates the row and queues a copy; one thread
hands the rows to the writer in the order they came.

What it keeps: ``close()`` waits for every queued row to be written, then closes the writer,
so a finished run's files are complete when the run returns. A row the writer refused (it
raised) is not lost silently: the error is raised by the next ``write`` or by ``close``.
What stays on the loop: ``metrics.jsonl`` (its rows are durable when ``write`` returns, which
resume relies on) and the console.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from jaxrl_orch.orchestrator.metrics.writers import clean_metrics
from jaxrl_orch.types import MetricsWriter

_CLOSE = object()


class OffLoop:
    """``writer``: the writer, or a function that builds it, called first on the thread (a
    writer slow to build: tensorboardX's import pulls in google-cloud-storage where it is
    installed, 0.15 s that the run's start would otherwise wait for)."""

    def __init__(self, writer: MetricsWriter | Callable[[], MetricsWriter], name: str) -> None:
        self._build = None if hasattr(writer, "write") else writer
        self.writer: MetricsWriter | None = None if self._build is not None else writer
        self._name = name
        self._rows: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name=f"writer-{name}", daemon=True)
        self._thread.start()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._raise_error()
        if self._closed:
            raise RuntimeError(f"{type(self.writer).__name__} is closed; write before close()")
        clean_metrics(metrics)  # a bad value raises here, naming the key, as it would inline
        self._rows.put((int(step), dict(metrics)))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._rows.put(_CLOSE)
            self._thread.join()
            if self.writer is not None:
                self.writer.close()
        self._raise_error()

    def _drain(self) -> None:
        unbuilt: BaseException | None = None
        if self._build is not None:
            try:
                self.writer = self._build()
            except Exception as e:  # noqa: BLE001  (raised by the loop's next write or close)
                unbuilt = self._error = e
        while (row := self._rows.get()) is not _CLOSE:
            if self._error is not None:
                continue  # rows queued behind a failure, until it is raised, are dropped
            if unbuilt is not None:  # every row fails as the writer did
                self._error = unbuilt
                continue
            try:
                self.writer.write(*row)
            except Exception as e:  # noqa: BLE001  (handed to the loop's next write or close)
                self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            what = type(self.writer).__name__ if self.writer is not None else self._name
            raise RuntimeError(f"{what} failed to write a row: {error}") from error
