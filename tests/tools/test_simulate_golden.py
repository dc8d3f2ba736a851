"""The orchestrator's behaviour, pinned: ``jaxrl-simulate --json`` prints exactly the recorded
output, for S = 0, 1, 2 with ``admit``, ``drop`` and ``pace`` under fixed and lognormal latency
(a fixed seed). A change to the wiring must leave ``golden/simulate.jsonl`` as it is; one that
changes admission, shipping, ages or drops changes one of these strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrl_orch.tools import simulate

CASES = [json.loads(x) for x in (Path(__file__).parent / "golden" / "simulate.jsonl").open()]


@pytest.mark.parametrize("case", CASES, ids=lambda c: " ".join(c["args"][4:9:2]))
def test_simulate_output_is_byte_identical_to_the_recorded_one(case, capsys):
    assert simulate.main(case["args"]) == 0
    assert capsys.readouterr().out.strip() == case["output"]
