"""Helpers shared by the tests: fakes, tiny checkpoints, tokenizers and configs, the train command
as a subprocess, and workers run as subprocesses. ``pyproject.toml`` puts ``tests/`` on the
import path (``pythonpath``), so a test imports ``from support.runs import prepare``; a
subprocess gets it from ``support.checkout.subprocess_env`` and runs a worker as
``python -m support.<name>`` (``support.checkout.helper_cmd``)."""
