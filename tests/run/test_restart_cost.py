"""End-to-end: what a start costs, as ``python -m jaxrl_orch.train`` reports it.

The tiny scenario of ``support.train_cmd`` twice on one compilation cache: the first start
compiles every program (cold) and keeps the engine's and the train step whole, the second loads
them (warm); both say so on the console, in
``summary.json`` and in the report. A run with the cache off writes no entry anywhere, not even
where JAX's own variable points. The seconds themselves are the machine's: only their order is
checked.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support.train_cmd import train_cmd, train_env

pytestmark = pytest.mark.slow

QUICK = ("RL.steps = 1", "Outputs.export_hf = False")


def _run(workdir, env_extra, *params):
    env = train_env(1)
    # A run's own floors (none), not the suite's: every program is written.
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    res = subprocess.run(
        train_cmd(workdir, *QUICK, *params),
        env={**env, **env_extra},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads((workdir / "summary.json").read_text())


def test_a_second_start_on_the_same_cache_loads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "xla"
    setting = f"Processes.compile_cache = '{cache}'"
    cold_res, cold = _run(tmp_path / "a", {}, setting)
    warm_res, warm = _run(tmp_path / "b", {}, setting)

    assert cold["compile_cache"]["dir"] == str(cache)
    assert cold["compile_cache"]["misses"] > 0 and cold["restart"]["cold"] is True
    assert warm["compile_cache"]["hits"] > 0 and warm["restart"]["cold"] is False
    assert warm["compile_cache"]["hits"] > warm["compile_cache"]["misses"]
    # The engine's programs and the train step, compiled and kept whole by the first start,
    # loaded whole by the second: none traced or compiled again.
    kept, loaded = cold["compile_cache"]["executables"], warm["compile_cache"]["executables"]
    print("executables", kept, loaded)
    assert kept["compiled"] >= kept["stored"] > 0 and kept["failed"] == 0
    # What the cold start did not keep (a program its cache had served: the same one built
    # twice) is compiled again, from the cache; everything it kept is loaded.
    assert loaded["loaded"] >= kept["stored"] and loaded["stored"] == loaded["failed"] == 0
    assert loaded["compiled"] == kept["compiled"] - kept["stored"]
    for summary in (cold, warm):
        restart = summary["restart"]
        assert 0 < restart["first_rollout_s"] <= restart["first_step_s"]
    for res, kind in ((cold_res, "cold"), (warm_res, "warm")):
        lines = [line for line in res.stdout.splitlines() if line.startswith("== restart:")]
        assert len(lines) == 1 and lines[0].startswith(f"== restart: {kind} start: first rollout")
        assert f"compile cache {cache}: " in lines[0]
    report = (tmp_path / "b" / "report.md").read_text()
    assert "- warm start: first rollout " in report and f"compile cache {cache}: " in report


def test_the_cache_off_writes_no_entry(tmp_path):
    jax_dir = tmp_path / "jax"  # where 'auto' would have put it
    env = {"JAX_COMPILATION_CACHE_DIR": str(jax_dir)}
    res, summary = _run(tmp_path / "run", env, "Processes.compile_cache = None")
    assert not jax_dir.exists()
    assert summary["compile_cache"] == {"dir": None, "hits": 0, "misses": 0, "executables": None}
    assert summary["restart"]["cold"] is True
    assert "compile cache off" in res.stdout
