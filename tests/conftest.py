"""Test-wide setup: 8 fake CPU devices for every mesh test, no LLVM backend optimisation.

XLA reads the flag once, when jax initialises its backends, so it must be set before any
test module imports jax. conftest.py is imported by pytest before test collection.
"""

import atexit
import os
import shutil
import tempfile

import gin  # none of these imports jax: the flags below still come first
import pytest
from support.checkout import xla_flags

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 fake devices, and no LLVM backend optimisation (why: ``support.checkout.BACKEND_FLAGS``).
for _flag in xla_flags(8).split():
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# One XLA compilation cache for the session, started empty: a program compiled again (a resumed
# run, a second engine of the same shape, a subprocess of the same model) loads instead of
# compiling. Subprocesses inherit it through the environment, and every run's default
# ``Processes.compile_cache = 'auto'`` takes it from there (``compose.compile_cache``): no test
# run writes into the user's own cache. jit's in-memory caches, which the tests that count
# compiles read, are unaffected.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxrl-orch-tests-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")


def pytest_collection_finish(session):
    """Start the TPU configs' deviceless compiles in the background right after collection when
    ``test_aot.py::test_tpu_configs_fit`` will run, so they overlap the rest of the session."""
    for item in session.items:
        if item.nodeid.endswith(
            (
                "test_aot.py::test_tpu_configs_fit",
                "test_aot.py::test_the_8b_lora_config_fits_and_every_weight_does_not",
                "test_aot.py::test_an_int8_base_shrinks_the_8b_train_step_and_leaves_the_engine_as_it_was",
            )
        ):
            item.module.start_background()
            return


@pytest.fixture(autouse=True)
def _no_gin_bindings_between_tests():
    """Bindings a test parsed apply to every later ``TrainConfig()``: each test starts clean."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def gcs():
    """A local GCS emulator (``support.gcs_emulator``) this process's gs:// clients point at, for
    one test module; its ``BUCKET`` is there."""
    from support.gcs_emulator import Emulator

    emulator = Emulator()
    emulator.point_here()
    yield emulator
    emulator.stop()
