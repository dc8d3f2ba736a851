"""A writer off the event loop: write returns at once, rows arrive in order, close waits for
all of them, and a failure of the writer is raised, not swallowed."""

from __future__ import annotations

import threading

import pytest

from jaxrl_orch.orchestrator.metrics.offloop import OffLoop


class Slow:
    """Holds every write until released; records rows and which thread wrote them."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.release = threading.Event()
        self.rows: list[tuple[int, dict]] = []
        self.threads: set[str] = set()
        self.closed = False
        self.fail_at = fail_at

    def write(self, step, metrics):
        self.release.wait()
        if step == self.fail_at:
            raise OSError("disk full")
        self.rows.append((step, metrics))
        self.threads.add(threading.current_thread().name)

    def close(self):
        self.closed = True


def test_writes_return_before_the_writer_and_close_waits_for_every_row_in_order():
    inner = Slow()
    w = OffLoop(inner, "slow")
    metrics = {"a": 1.0}
    for step in range(1, 6):
        w.write(step, metrics)
    metrics["a"] = 99.0  # the caller's dict, changed after the write: the row keeps its value
    assert inner.rows == []  # nothing written yet: the writer is still held
    inner.release.set()
    w.close()
    assert [s for s, _ in inner.rows] == [1, 2, 3, 4, 5]
    assert inner.rows[0][1] == {"a": 1.0}
    assert inner.threads == {"writer-slow"} and inner.closed
    with pytest.raises(RuntimeError, match="closed"):
        w.write(6, {"a": 1.0})


def test_a_bad_value_is_refused_at_write_naming_the_key():
    w = OffLoop(Slow(), "slow")
    with pytest.raises(ValueError, match="'loss'"):
        w.write(1, {"loss": "nan please"})
    w.writer.release.set()
    w.close()


def test_a_failed_write_is_raised_by_close_with_the_writers_error():
    inner = Slow(fail_at=2)
    inner.release.set()
    w = OffLoop(inner, "slow")
    for step in (1, 2, 3):
        w.write(step, {"a": 1.0})
    with pytest.raises(RuntimeError, match="Slow failed to write a row: disk full"):
        w.close()
    assert [s for s, _ in inner.rows] == [1] and inner.closed


def test_a_writer_built_on_the_thread_gets_every_row_and_its_failure_is_raised():
    inner = Slow()
    inner.release.set()
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return inner

    w = OffLoop(build, "built")
    for step in (1, 2):
        w.write(step, {"a": 1.0})
    w.close()
    assert built_on == ["writer-built"] and [s for s, _ in inner.rows] == [1, 2] and inner.closed

    def unbuildable():
        raise OSError("tb dir is read-only")

    w = OffLoop(unbuildable, "tb")
    for step in (1, 2):
        try:
            w.write(step, {"a": 1.0})
        except RuntimeError as e:
            assert "tb failed to write a row: tb dir is read-only" in str(e)
    with pytest.raises(RuntimeError, match="tb failed to write a row: tb dir is read-only"):
        w.close()
