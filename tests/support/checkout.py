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
