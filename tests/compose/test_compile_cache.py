"""compose.compile_cache: where ``Processes.compile_cache`` points JAX's persistent cache, and
the hits and misses a run counts.

The compiles here are real (a small program, new per test, on this process's CPU backend); the
cache's directory is each test's own, and the suite's cache is put back afterwards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_orch.compose import compile_cache
from jaxrl_orch.compose.compile_cache import cache_dir, use_compile_cache
from jaxrl_orch.config.load import SECTION_BY_NAME

Processes = SECTION_BY_NAME["Processes"]
_FLAGS = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@pytest.fixture(autouse=True)
def _suite_cache_back():
    saved = {f: getattr(jax.config, f) for f in _FLAGS}
    yield
    for flag, value in saved.items():
        jax.config.update(flag, value)
    compilation_cache.reset_cache()


def _compile(salt: float) -> None:
    """One program, compiled from a new ``jit`` (jit's in-memory cache never answers it): its
    constant makes it this test's own."""
    jax.jit(lambda x: jnp.sin(x) * salt + 1.0)(jnp.ones(4)).block_until_ready()


def test_auto_is_jaxs_variable_else_the_xdg_cache_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert cache_dir("auto") == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("auto") == tmp_path / "xdg" / "jaxrl_orch" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("auto") == tmp_path / "home" / ".cache" / "jaxrl_orch" / "xla"
    assert cache_dir("~/programs") == tmp_path / "home" / "programs"
    assert cache_dir(None) is None and cache_dir("") is None


def test_a_url_is_refused_as_the_setting_and_through_jaxs_variable(monkeypatch):
    with pytest.raises(ValueError, match=r"Processes.compile_cache = 'gs://b/xla' is a URL"):
        Processes(compile_cache="gs://b/xla")
    assert Processes(compile_cache=None).compile_cache is None
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "gs://b/xla")
    with pytest.raises(ValueError, match=r"\$JAX_COMPILATION_CACHE_DIR.*'gs://b/xla'"):
        cache_dir("auto")


def test_a_second_run_loads_what_the_first_compiled(tmp_path, monkeypatch):
    # The suite's floor (conftest.py) would leave this small program out; a run's has none.
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    first = use_compile_cache(str(tmp_path))
    _compile(3.25)
    hits, misses = first.counts()
    assert hits == 0 and misses >= 1
    assert any(tmp_path.iterdir())  # the entry was written, small as it is
    second = use_compile_cache(str(tmp_path))
    _compile(3.25)
    assert second.counts() == (1, 0)  # counted from its own start
    assert second.gauges() == {"compile_cache/hits": 1.0, "compile_cache/misses": 0.0}
    assert second.summary() == {
        "dir": str(tmp_path),
        "hits": 1,
        "misses": 0,
        "executables": None,  # not asked for
    }


def test_off_writes_no_entry_and_counts_nothing(tmp_path, monkeypatch):
    jax_dir = tmp_path / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(jax_dir))  # what 'auto' would take
    off = use_compile_cache(None)
    _compile(7.5)
    assert off.counts() == (0, 0)
    assert not jax_dir.exists()
    assert off.summary() == {"dir": None, "hits": 0, "misses": 0, "executables": None}


def test_a_directory_that_cannot_be_made_turns_the_cache_off(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = use_compile_cache(str(blocker / "xla"))
    _compile(9.0)
    assert cache.directory is None and cache.counts() == (0, 0)
    assert f"== compile cache: off: cannot make {blocker / 'xla'}" in capsys.readouterr().out


def test_a_directory_it_may_not_write_turns_the_cache_off(tmp_path, capsys, monkeypatch):
    # Root may write anywhere, so the refusal the kernel would give another user is stood in
    # for at the one check the module makes.
    monkeypatch.setattr(compile_cache.os, "access", lambda path, mode: False)
    cache = use_compile_cache(str(tmp_path / "ro"))
    _compile(10.0)
    assert cache.directory is None and cache.counts() == (0, 0)
    out = capsys.readouterr().out
    assert f"== compile cache: off: cannot write {tmp_path / 'ro'} (permission denied)" in out


def test_a_nearly_full_disk_turns_the_cache_off(tmp_path, capsys, monkeypatch):
    usage = compile_cache.shutil.disk_usage(tmp_path)._replace(free=10 << 20)
    monkeypatch.setattr(compile_cache.shutil, "disk_usage", lambda path: usage)
    cache = use_compile_cache(str(tmp_path / "full"))
    _compile(11.0)
    assert cache.directory is None and not list((tmp_path / "full").iterdir())
    assert f"== compile cache: off: {tmp_path / 'full'} has 10 MB free, under 268 MB" in (
        capsys.readouterr().out
    )


def test_executables_are_kept_beside_the_cache_and_only_with_it(tmp_path):
    kept = use_compile_cache(str(tmp_path / "xla"), keep_executables=True)
    try:
        assert kept.executables.directory == tmp_path / "xla" / "executables"
        assert kept.summary()["executables"] == {
            "loaded": 0,
            "stored": 0,
            "compiled": 0,
            "failed": 0,
        }
        kept.executables.loaded = 3  # programs loaded whole count as reused
        assert kept.reused() == (3, 0)
        assert use_compile_cache(None, keep_executables=True).executables is None
    finally:
        use_compile_cache(None)
