"""Plugging in an engine (``Engine.kind``): the spec, the contract, the recompute rule."""

from __future__ import annotations

import types

import pytest

from jaxrl_orch.compose.engines import (
    check_engine,
    engine_factory,
    recompute_old_logprobs,
    reports_logprobs,
)
from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.engine import DecodeEngine


def test_the_spec_names_a_factory_or_fails_naming_the_value():
    assert engine_factory("builtin") is DecodeEngine
    assert engine_factory("jaxrl_orch.inference.engine:DecodeEngine") is DecodeEngine
    with pytest.raises(ValueError, match=r"'builtin' or 'package.module:factory', got 'jetstream'"):
        engine_factory("jetstream")
    with pytest.raises(ValueError, match=r"cannot load 'Nope' from 'jaxrl_orch.inference.engine'"):
        engine_factory("jaxrl_orch.inference.engine:Nope")
    with pytest.raises(ValueError, match=r"cannot load 'x' from 'no_such_pkg'"):
        engine_factory("no_such_pkg:x")
    with pytest.raises(ValueError, match="names a int, not a callable"):
        engine_factory("jaxrl_orch.types:NO_VERSION")


def test_an_engine_missing_part_of_the_contract_is_named():
    partial = types.SimpleNamespace(prefill=1, insert=1, generate=1, init_decode_state=1)
    with pytest.raises(TypeError, match=r"lacks \['param_shardings'\]"):
        check_engine(partial, "my:engine")


def test_recompute_follows_the_engine_unless_set():
    def cfg(v):
        return make_config({"RL.recompute_old_logprobs": v, "Engine.kind": "my:engine"})

    assert recompute_old_logprobs(cfg(None), engine_logprobs=True) is False
    assert recompute_old_logprobs(cfg(None), engine_logprobs=False) is True
    assert recompute_old_logprobs(cfg(True), engine_logprobs=True) is True
    with pytest.raises(ValueError, match="reports no behaviour log-probs.*leave it unset"):
        recompute_old_logprobs(cfg(False), engine_logprobs=False)
    assert reports_logprobs(types.SimpleNamespace()) is False
    assert reports_logprobs(types.SimpleNamespace(reports_logprobs=True)) is True
