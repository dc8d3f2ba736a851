"""Fixtures for env tests (the fakes themselves live in support/env_fakes.py)."""

import pytest
from support.env_fakes import FakeByteTokenizer, ScriptedClient


@pytest.fixture
def tok():
    return FakeByteTokenizer()


@pytest.fixture
def scripted(tok):
    """``scripted(*turns, tokenizer=tok)``: a turn is a text or (text, version, finish, eos)."""

    def make(*turns, tokenizer=tok):
        return ScriptedClient(
            tokenizer, [t if isinstance(t, tuple) else (t, 0, "stop", True) for t in turns]
        )

    return make
