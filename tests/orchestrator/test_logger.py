"""PeriodicLogger, LagMonitor and the writers."""

from __future__ import annotations

import asyncio
import glob
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxrl_orch.orchestrator.logger import LagMonitor, PeriodicLogger
from jaxrl_orch.orchestrator.metrics.writers import (
    ConsoleWriter,
    JsonlWriter,
    ProgressWriter,
    TensorBoardWriter,
)


class ListWriter:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, step, metrics):
        self.rows.append((step, dict(metrics)))

    def close(self):
        self.closed = True


class Component:
    def __init__(self):
        self.n = 0

    def gauges(self):
        self.n += 1
        return {"comp/polls": self.n, "comp/depth": np.int64(3)}


async def until(cond, limit_s=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


def test_lag_monitor_detects_a_blocking_call():
    async def main():
        mon = LagMonitor(probe_s=0.01)
        task = asyncio.create_task(mon.run())
        await until(lambda: mon.probes >= 2)
        time.sleep(0.3)  # the blocking call: nothing else on the loop can run meanwhile
        await until(lambda: mon.probes >= 4)
        task.cancel()
        return mon

    mon = asyncio.run(main())
    assert mon.gauges()["loop/lag_max_s"] >= 0.2
    assert mon.max_s >= mon.last_s >= 0


def test_periodic_logger_pulls_sources_and_writes_step_metrics():
    async def main():
        comp, writer = Component(), ListWriter()
        step = {"v": 41}
        log = PeriodicLogger(
            [comp, lambda: {"other/x": 1.5}],
            [writer],
            interval_s=0.005,
            step_fn=lambda: step["v"],
            lag_probe_s=0.002,
        )
        task = asyncio.create_task(log.start())
        await until(lambda: len(writer.rows) >= 3)
        log.write_step(7, {"train/loss": 0.25})
        await log.stop()
        await task
        return comp, writer, log

    comp, writer, log = asyncio.run(main())
    gauge_rows = [m for s, m in writer.rows if s == 41]
    assert len(gauge_rows) >= 4  # three periodic ticks plus the final snapshot at stop()
    assert all(
        {"comp/polls", "comp/depth", "other/x", "loop/lag_s", "loop/lag_max_s"} <= set(m)
        for m in gauge_rows
    )
    assert [m["comp/polls"] for m in gauge_rows] == list(range(1, len(gauge_rows) + 1))
    assert (7, {"train/loss": 0.25}) in writer.rows
    assert writer.closed and log.gauges()["logger/writes_total"] == len(writer.rows)


def test_duplicate_gauge_keys_and_bad_values_fail_loudly():
    log = PeriodicLogger([lambda: {"a/x": 1}, lambda: {"a/x": 2}], [ListWriter()], lag_probe_s=None)
    with pytest.raises(ValueError, match="'a/x' reported by two sources"):
        log.collect()
    log = PeriodicLogger([], [ListWriter()])
    with pytest.raises(ValueError, match="'m/s' must be a real number.*str"):
        log.write_step(1, {"m/s": "fast"})
    with pytest.raises(TypeError, match="no gauges"):
        PeriodicLogger([object()], [])
    with pytest.raises(TypeError, match="write"):
        PeriodicLogger([], [object()])


def test_a_failing_source_kills_the_logger_visibly():
    def broken():
        raise RuntimeError("gauge source exploded")

    async def main():
        log = PeriodicLogger([broken], [ListWriter()], interval_s=0.001, lag_probe_s=None)
        with pytest.raises(RuntimeError, match="exploded"):
            await log.start()
        with pytest.raises(RuntimeError, match="exploded"):
            log.check()

    asyncio.run(main())


def test_jsonl_writer_one_object_per_line(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    w = JsonlWriter(path, clock=lambda: 123.0)
    w.write(1, {"train/loss": 0.5, "train/n": 3})
    w.write(2, {"train/loss": float("nan"), "flag/on": True})
    w.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "time": 123.0, "train/loss": 0.5, "train/n": 3.0},
        {"step": 2, "time": 123.0, "train/loss": None, "flag/on": 1.0},
    ]


def test_console_writer_one_compact_line():
    buf = io.StringIO()
    w = ConsoleWriter(stream=buf)
    w.write(12, {"b/y": 2.0, "a/x": 0.123456})
    w.write(13, {"a/x": 1})
    assert buf.getvalue() == "step 12 | a/x=0.1235 b/y=2\nstep 13 | a/x=1\n"


def test_console_writer_keys_keep_order_and_expand_patterns():
    buf = io.StringIO()
    w = ConsoleWriter(stream=buf, keys=["train/r", "eval/*/reward_mean", "orch/age_max"])
    w.write(3, {"orch/age_max": 1, "train/r": 0.5, "eval/b/reward_mean": 0.2, "eval/a/x": 9})
    w.write(4, {"eval/a/reward_mean": 0.7, "eval/b/reward_mean": 0.1, "other": 5})
    w.write(5, {"other": 5})  # nothing chosen: no line at all
    assert buf.getvalue().splitlines() == [
        "step 3 | train/r=0.5 eval/b/reward_mean=0.2 orch/age_max=1",
        "step 4 | eval/a/reward_mean=0.7 eval/b/reward_mean=0.1",
    ]


def test_progress_writer_follows_steps_and_console_lines_do_not_tear_it():
    bar_out, lines = io.StringIO(), io.StringIO()
    bar = ProgressWriter(
        5, initial=1, postfix_keys=["train/reward_mean"], stream=bar_out, disable=False
    )
    console = ConsoleWriter(stream=lines, keys=["train/reward_mean"])
    for step, metrics in [
        (2, {"train/reward_mean": 0.25}),
        (2, {"eval/x": 1.0}),
        (4, {"train/reward_mean": 0.5}),
    ]:
        bar.write(step, metrics)
        console.write(step, metrics)
    assert bar.position == 4  # an eval row at step 2 does not move it; resumed runs start at 1
    bar.write(3, {})  # never backwards
    assert bar.position == 4
    bar.close()
    text = bar_out.getvalue()
    assert "4/5" in text and "reward_mean=0.5" in text
    assert lines.getvalue() == "step 2 | train/reward_mean=0.25\nstep 4 | train/reward_mean=0.5\n"
    with pytest.raises(ValueError, match="initial=6 total=5"):
        ProgressWriter(5, initial=6)


def test_progress_writer_is_silent_off_a_terminal():
    out = io.StringIO()  # not a tty: disable=None turns the bar off
    bar = ProgressWriter(3, stream=out)
    bar.write(3, {"a": 1.0})
    bar.close()
    assert out.getvalue() == ""


def _read_tfrecords(path):
    """Minimal TFRecord reader: [len u64][crc u32][payload][crc u32] per record."""
    with open(path, "rb") as f:
        data = f.read()
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        out.append(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
    return out


def test_tensorboard_writer_writes_an_event_file(tmp_path):
    from tensorboardX.proto import event_pb2

    w = TensorBoardWriter(tmp_path / "tb")
    w.write(3, {"train/loss": 0.75})
    w.write(4, {"train/loss": 0.5})
    w.close()
    (path,) = glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
    scalars = []
    for rec in _read_tfrecords(path):
        ev = event_pb2.Event.FromString(rec)
        scalars += [(ev.step, v.tag, v.simple_value) for v in ev.summary.value]
    assert scalars == [(3, "train/loss", 0.75), (4, "train/loss", 0.5)]


def test_two_tensorboard_writers_built_at_once_on_nested_logdirs(tmp_path, monkeypatch):
    """The run builds ``tb`` and ``tb/steps`` at once on two threads. tensorboardX checks a
    logdir exists, then makes it with a plain ``os.makedirs``: here the parent's makedirs is
    held until the child has made both, the order that failed a run with FileExistsError."""
    TensorBoardWriter(tmp_path / "import_first").close()  # tensorboardX imported
    real = os.makedirs

    def makedirs(path, *args, **kwargs):  # os.makedirs makes a missing parent through itself
        if threading.current_thread().name == "parent":
            time.sleep(0.3)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    start, built, errors = threading.Barrier(2), [], []

    def build(logdir):
        start.wait()
        try:
            built.append(TensorBoardWriter(logdir))
        except OSError as e:
            errors.append(e)

    threads = [
        threading.Thread(target=build, args=(tmp_path / "tb" / "steps",), name="child"),
        threading.Thread(target=build, args=(tmp_path / "tb",), name="parent"),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(built) == 2
    for w in built:
        w.close()


def test_the_tensorboard_writer_does_not_import_torch(tmp_path):
    pytest.importorskip("torch")  # where torch is absent there is nothing to leave out
    script = f"""
import sys
from jaxrl_orch.orchestrator.metrics.writers import TensorBoardWriter
w = TensorBoardWriter({str(tmp_path / "tb")!r})
w.write(1, {{"train/loss": 0.5}})
w.close()
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch  # what a later part of the run may still import
print("ok", torch.__version__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
    assert glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))


def test_another_thread_imports_torch_while_the_tensorboard_writer_is_built(tmp_path):
    """The writers are built on threads of their own, beside the rollouts: leaving torch out of
    tensorboardX's import must not fail an environment's own ``import torch`` meanwhile."""
    pytest.importorskip("torch")
    script = f"""
import sys, threading
from jaxrl_orch.orchestrator.metrics import writers
started, imported = threading.Event(), []
real = writers._NoTorchOnThisThread.find_spec

def slow_find_spec(self, name, path, target=None):  # hold the writer's import open
    started.set()
    return real(self, name, path, target)

writers._NoTorchOnThisThread.find_spec = slow_find_spec
built = threading.Thread(target=writers.TensorBoardWriter, args=({str(tmp_path / "tb")!r},))
built.start()
started.wait()
import torch  # another thread, during the writer's import
built.join()
print("ok", torch.__version__, type(sys.modules["torch"]).__name__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
    assert glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
