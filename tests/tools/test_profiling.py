"""The profile summary of ``benchmarks/profiling.py``: self times and categories.

``benchmarks/`` is on the tests' import path (``pythonpath`` in ``pyproject.toml``)."""

from __future__ import annotations

from types import SimpleNamespace as Ev

from profiling import _category, _self_times


def test_self_times_subtract_children_so_nothing_counts_twice():
    # run [0, 10) holds pack [1, 3) and wait [4, 9), which holds get [5, 8)
    events = [
        Ev(name="run", start_ns=0, duration_ns=10e9),
        Ev(name="wait", start_ns=4e9, duration_ns=5e9),
        Ev(name="pack", start_ns=1e9, duration_ns=2e9),
        Ev(name="get", start_ns=5e9, duration_ns=3e9),
    ]
    got = dict(_self_times(events))
    assert got == {"run": 3.0, "pack": 2.0, "wait": 2.0, "get": 3.0}
    assert sum(got.values()) == 10.0  # the thread's wall time, once


def test_categories():
    assert _category("tf_XLAPjRtCpuClient/1", "ynn_fusion.3") == "device compute"
    assert _category("tf_PjRtCompilerThreadPool/2", "CpuCompiler::RunBackend") == "compile"
    assert _category("python", "$array.py:615 _value") == "transfers"
    assert _category("python", "$threading.py:320 wait") == "waits"
    assert _category("python", "$<unknown> get") == "waits"
    assert _category("python", "$train_sink.py:200 _tokenize") == "host python"
    assert _category("tf_XLAEigen/3", "end: ynn_fusion") is None
