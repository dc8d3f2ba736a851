"""Helpers shared by the tests (fakes, tiny checkpoints and tokenizers, workers run as
subprocesses). ``pyproject.toml`` puts ``tests/`` on the import path (``pythonpath``), so a test
imports ``from support.runs import prepare``."""
