"""``Engine.serve_port``: the policy being trained served over HTTP from the RL stage's own driver.

On the hand-calculable ToyEngine (greedy tokens count upwards shifted by the params version): a
response names the version that produced each token, and a weight swap by the trainer's path
(``swap_params`` on the shared driver) shows in the very next response; the live server takes
no weight updates of its own and binds loopback only.
"""

from __future__ import annotations

import httpx
import pytest
from support.toy_engine import ToyEngine

from jaxrl_orch.compose.live import serve_live_policy
from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.driver import InferenceDriver


@pytest.fixture
def driver():
    d = InferenceDriver(ToyEngine(slots=2, vocab=1000), 0, 0)
    d.start()
    yield d
    d.stop()


def _generate(url: str, model: str) -> dict:
    body = {
        "model": model,
        "token_ids": [5],
        "sampling_params": {"temperature": 0.0, "max_tokens": 3, "logprobs": 1},
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_live_server_answers_with_the_version_the_trainer_swapped_in(driver):
    cfg = make_config({"Engine.serve_port": 0})
    server = serve_live_policy(cfg, driver.engine, driver, tokenizer=None)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [cfg.model.name]
        first = _generate(server.url, cfg.model.name)
        assert first["token_ids"] == [6, 7, 8] and first["policy_versions"] == [0, 0, 0]
        driver.swap_params(1, 1).result(timeout=30)  # what the weight path does after a step
        second = _generate(server.url, cfg.model.name)
        assert second["token_ids"] == [7, 9, 11] and second["policy_versions"] == [1, 1, 1]
        update = {"version": 2, "uuid": 1, "timeout_s": 30}
        r = httpx.post(f"{server.url}/update_weights", json=update, timeout=30)
        assert r.status_code == 409 and "weight source" in r.text
    finally:
        server.stop()
    assert driver.version == 1  # the server stopped; the driver is the stage's and still runs


def test_no_port_no_server(driver):
    assert serve_live_policy(make_config(), driver.engine, driver, tokenizer=None) is None
