"""compose.executables: a program compiled once is loaded whole by a later start, without being
traced; anything that makes it another program (its group, its arguments) compiles anew; an
unreadable entry is said, removed and compiled again; a compile the persistent cache served is
not kept; a kept engine's programs give the same tokens as freshly compiled ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_orch.compose.compile_cache import use_compile_cache
from jaxrl_orch.compose.executables import ExecutableStore


@pytest.fixture
def no_cache():
    """The persistent cache off: a compile here is this process's own (a cache entry from any
    earlier run on the machine would make it a hit, which the store does not keep)."""
    use_compile_cache(None)
    yield
    use_compile_cache(None)


class Traced:
    """The same code each start, a new function object each time (JAX keeps traces per
    function object within a process), counting the times JAX traces it."""

    def __init__(self) -> None:
        self.traces = 0

    def fresh(self):
        def f(x, y):
            self.traces += 1
            return {"sum": x * 2.0 + y, "first": y[0]}

        return f


def _jitted(fn):
    return jax.jit(fn.fresh(), donate_argnums=(0,))


def test_a_second_start_loads_the_program_whole_without_tracing_it(tmp_path, no_cache):
    fn = Traced()
    first = ExecutableStore(tmp_path).program("g", "f", _jitted(fn))
    want = first(jnp.arange(4.0), jnp.ones(4))
    assert fn.traces == 1 and len(list(tmp_path.iterdir())) == 1
    store = ExecutableStore(tmp_path)  # a later start: a new store, a new jit of the same code
    second = store.program("g", "f", _jitted(fn))
    x = jnp.arange(4.0)
    got = second(x, jnp.ones(4))
    assert fn.traces == 1  # never traced again
    assert store.summary() == {"loaded": 1, "stored": 0, "compiled": 0, "failed": 0}
    np.testing.assert_array_equal(got["sum"], want["sum"])
    assert x.is_deleted()  # the donation is the executable's own
    again = second(jnp.arange(4.0), jnp.ones(4))  # the fast path: the same executable
    np.testing.assert_array_equal(again["sum"], want["sum"])
    assert fn.traces == 1


def test_another_group_or_argument_shape_is_another_program(tmp_path, no_cache):
    fn = Traced()
    ExecutableStore(tmp_path).program("g", "f", _jitted(fn))(jnp.arange(4.0), jnp.ones(4))
    store = ExecutableStore(tmp_path)
    other_group = store.program("g2", "f", _jitted(fn))
    other_group(jnp.arange(4.0), jnp.ones(4))
    assert fn.traces == 2
    same = store.program("g", "f", _jitted(fn))
    out = same(jnp.arange(8.0), jnp.ones(8))  # a shape it was not kept for: compiled, kept
    assert fn.traces == 3 and out["sum"].shape == (8,)
    assert store.summary()["compiled"] == 2 and store.summary()["stored"] == 2
    assert len(list(tmp_path.iterdir())) == 3


def test_inside_another_program_it_is_traced_as_part_of_it(tmp_path, no_cache):
    fn = Traced()
    kept = ExecutableStore(tmp_path).program("g", "f", jax.jit(fn.fresh()))
    kept(jnp.arange(4.0), jnp.ones(4))
    outer = jax.jit(lambda x: kept(x, x)["sum"].sum())
    assert float(outer(jnp.ones(4))) == 12.0


def test_an_unreadable_entry_is_said_removed_and_compiled_again(tmp_path, no_cache, capsys):
    fn = Traced()
    ExecutableStore(tmp_path).program("g", "f", _jitted(fn))(jnp.arange(4.0), jnp.ones(4))
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(entry.read_bytes()[:100])  # a torn write from a crashed start
    store = ExecutableStore(tmp_path)
    out = store.program("g", "f", _jitted(fn))(jnp.arange(4.0), jnp.ones(4))
    np.testing.assert_array_equal(out["sum"], np.arange(4.0) * 2 + 1)
    assert store.summary() == {"loaded": 0, "stored": 1, "compiled": 1, "failed": 1}
    assert f"== executables: {entry.name} could not be loaded" in capsys.readouterr().out
    assert (
        ExecutableStore(tmp_path)
        .program("g", "f", _jitted(fn))
        .prepare(jnp.arange(4.0), jnp.ones(4))
    )  # the entry written again loads


def test_a_compile_the_persistent_cache_served_is_not_kept(tmp_path, monkeypatch):
    """An executable the cache loaded does not run once serialized again (CPU): not kept."""
    # The suite's floor (conftest.py) would leave this small program out of the cache.
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    (tmp_path / "prog.py").write_text(
        "import jax.numpy as jnp\ndef f(x):\n    return jnp.sin(x) * 3\n"
    )
    code = """
        import jax, jax.numpy as jnp, prog
        from jaxrl_orch.compose.compile_cache import use_compile_cache
        use_compile_cache({cache!r})
        jax.jit(prog.f)(jnp.ones(16))
    """
    cache = str(tmp_path / "xla")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = [sys.executable, "-c", textwrap.dedent(code.format(cache=cache))]
    subprocess.run(run, check=True, env=env)
    monkeypatch.syspath_prepend(str(tmp_path))
    import prog

    use_compile_cache(cache)
    try:
        (tmp_path / "kept").mkdir()
        store = ExecutableStore(tmp_path / "kept")
        out = store.program("g", "sin", jax.jit(prog.f))(jnp.ones(16))
        np.testing.assert_allclose(out, np.sin(np.ones(16)) * 3.0, rtol=1e-6)
        assert store.summary() == {"loaded": 0, "stored": 0, "compiled": 1, "failed": 0}
    finally:
        use_compile_cache(None)


def test_an_engine_on_kept_programs_samples_the_same_tokens(tmp_path, no_cache):
    from jaxrl_orch.compose.model import model_config
    from jaxrl_orch.inference.engine import DecodeEngine
    from jaxrl_orch.inference.limits import EngineLimits
    from jaxrl_orch.inference.narrow import warm_up
    from jaxrl_orch.models.tokenizer import load_tokenizer

    limits = EngineLimits(
        max_concurrent_decodes=4, max_target_length=64, max_prefill_length=32, steps_per_call=4
    )
    config = model_config("tiny-byte", load_tokenizer("byte"))

    def start():
        store = ExecutableStore(tmp_path)
        engine = DecodeEngine(config, limits=limits, programs=store.program)
        params = engine.load_params(seed=0)
        warm_up(engine, params, 0, engine.decode_widths)
        prefix, _ = engine.prefill(
            params=params, padded_tokens=np.arange(1, 17, dtype=np.int32), true_length=16
        )
        state = engine.insert(prefix, engine.init_decode_state(), 0)
        state, result = engine.generate(params, state)
        return store.summary(), np.asarray(result.convert_to_numpy().data)

    cold, want = start()
    warm, got = start()
    assert cold["compiled"] == cold["stored"] > 0 and cold["loaded"] == 0
    assert warm == {"loaded": cold["stored"], "stored": 0, "compiled": 0, "failed": 0}
    np.testing.assert_array_equal(got, want)
