"""The replica protocol's JSON messages: every SamplingParams field, NaN log-probs, strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from jaxrl_orch.distributed import protocol
from jaxrl_orch.types import Completion, SamplingParams


def test_sampling_round_trips_every_dataclass_field():
    sampling = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, max_tokens=33, stop_token_ids=(1, 2)
    )
    data = protocol.sampling_to_json(sampling)
    assert set(data) == {f.name for f in dataclasses.fields(SamplingParams)}
    wire = protocol.loads(protocol.dumps({"sampling": data}))["sampling"]
    back = protocol.sampling_from_json(wire)
    assert back == sampling and isinstance(back.stop_token_ids, tuple)
    assert protocol.sampling_from_json({}) == SamplingParams()
    with pytest.raises(ValueError, match=r"unknown SamplingParams fields \['nucleus'\]"):
        protocol.sampling_from_json({**data, "nucleus": 1})
    with pytest.raises(ValueError, match="top_p must be in"):
        protocol.sampling_from_json({"top_p": 0.0})


def test_completion_nan_logprobs_travel_as_null_and_come_back_nan():
    completion = Completion([5, 6, 7], [-0.5, math.nan, -1.25], [3, 3, 4], "stop")
    wire = protocol.dumps(protocol.completion_to_json(completion))
    assert json.loads(wire)["logprobs"] == [-0.5, None, -1.25]  # strict JSON: no NaN literal
    back = protocol.completion_from_json(protocol.loads(wire))
    assert back.token_ids == [5, 6, 7] and back.versions == [3, 3, 4]
    assert (
        back.logprobs[0] == -0.5 and math.isnan(back.logprobs[1]) and back.finish_reason == "stop"
    )
    with pytest.raises(ValueError):
        protocol.dumps({"x": math.nan})


def test_handlers_must_cover_the_service_exactly():
    async def ok(request, context):
        return {}

    assert protocol.method_path("Generate") == "/jaxrl_orch.Engine/Generate"
    protocol.generic_handler({m: ok for m in protocol.METHODS})
    with pytest.raises(ValueError, match=r"missing \['Health'\]"):
        protocol.generic_handler({"LoadWeights": ok, "Generate": ok})
    with pytest.raises(ValueError, match="unknown"):
        protocol.method_path("Shutdown")
