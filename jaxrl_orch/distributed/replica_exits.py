"""A replica that exits the same way twice in a row: the run stops, with its error on the console.

What it owns: ``ExitWatch``, which the launcher tells when it starts a replica (where this
start's output begins in the replica's log) and when the replica exits (its exit status).
``exited`` returns the replica's last line when this exit repeats its previous one: the same
status, above 0 (the process ended on an error of its own: 1 for an exception, 2 for a refused
setting), and the same last line written since its start. A restart cannot mend such a failure
(a setting only a replica reads, a port it cannot bind); without this, the launcher restarted it
up to ``--max_restarts`` times while the error showed only in the replica's own log.

An exit by a signal (kill -9, the OOM killer) is never the replica's own error: it breaks the
run of repeats and the replica is restarted. Reads the logs only; never writes.
"""

from __future__ import annotations

import os
from pathlib import Path

TAIL_BYTES = 64 * 1024  # the end of a start's output holds its last line
LINE_CHARS = 500


def last_line(log: Path, offset: int) -> str:
    """The last non-blank line written to ``log`` past byte ``offset`` ('' for none)."""
    try:
        with open(log, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:LINE_CHARS] if lines else ""


class ExitWatch:
    """See the module docstring."""

    def __init__(self) -> None:
        self._starts: dict[int, tuple[Path, int]] = {}
        self._last: dict[int, tuple[int, str] | None] = {}

    def started(self, k: int, log: Path) -> None:
        self._starts[k] = (log, log.stat().st_size if log.exists() else 0)

    def exited(self, k: int, code: int) -> str | None:
        """Record process ``k``'s exit with ``code``; its last line when the exit repeats the
        previous one, else None."""
        log, offset = self._starts[k]
        this = (code, last_line(log, offset)) if code > 0 else None
        repeated = this is not None and this == self._last.get(k)
        self._last[k] = this
        return this[1] if repeated and this is not None else None
