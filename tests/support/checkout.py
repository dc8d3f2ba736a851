"""Where the checkout is, and how a subprocess imports these helpers.

``ROOT`` is the repository (``configs/``, ``tpu_scripts/``, ``pyproject.toml``); ``TESTS`` is
``tests/``. pytest puts ``tests/`` on this process's import path (``pythonpath`` in
``pyproject.toml``); a subprocess gets it from ``PYTHONPATH`` (``subprocess_env``), so it can run
a helper as a module (``helper_cmd("replica_main")``: ``python -m support.replica_main``) or
name one in a setting (``Data.env = 'support.dense_env:make'``) in every process of a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

# The tests compile hundreds of small programs and run each a few times: LLVM's backend
# optimisations cost more compile time than they save in run time (the trainer tests took 54 s
# instead of 88 s without them). HLO-level fusion and buffer assignment, which the tests check,
# do not depend on it. Every test process compiles with it (``conftest.py``, ``xla_flags``); the
# TPU AOT compiles do not.
BACKEND_FLAGS = {"--xla_backend_optimization_level": "0"}


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` of a test process with ``devices`` fake CPU devices."""
    flags = {"--xla_force_host_platform_device_count": str(devices), **BACKEND_FLAGS}
    return " ".join(f"{k}={v}" for k, v in flags.items())


def subprocess_env(base: Mapping[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``tests/`` first on ``PYTHONPATH``,
    then ``overrides`` (e.g. ``JAX_PLATFORMS="cpu"``)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(overrides)
    return env


def helper_cmd(module: str, *args: str) -> list[str]:
    """The command line that runs ``support/<module>.py`` as a script (with ``subprocess_env``)."""
    return [sys.executable, "-m", f"support.{module}", *args]
