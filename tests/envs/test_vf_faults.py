"""Faults of a verifiers environment under the real dispatcher: each becomes an error rollout,
counted, and every dispatched rollout reaches the dispatcher's output exactly once.

``jaxrl_vf_testkit``'s modes (a reward function that raises, a NaN reward, a harness that exits
1, one that hangs past ``env_timeout_s``) on real verifiers machinery; the engine is scripted, so
a test can also hold its requests and cancel the rollouts waiting on them.
"""

from __future__ import annotations

import asyncio

from support.chat_checkpoints import write_qwen_tokenizer
from support.dispatch_fakes import drain, make, until
from support.vf_fixtures import ScriptedClient

from jaxrl_orch.models.tokenizer import load_tokenizer

MODES = ["ok", "raise_reward", "nan", "exit_1", "hang"]
EXPECTED = {
    "raise_reward": "reward function crashed on purpose",
    "nan": "NonFiniteReward",
    "exit_1": "exited 1: harness crashed on purpose",
    "hang": "env_timeout_s=10s",
}


class OnePool:
    def __init__(self, client) -> None:
        self.clients = [client]

    def select(self):
        return self.clients[0]


class Examples:
    def __init__(self, examples, limit) -> None:
        self.examples, self.limit, self.i = examples, limit, 0

    def next_example(self):
        if self.i >= self.limit:
            raise StopIteration
        self.i += 1
        return self.examples[(self.i - 1) % len(self.examples)]

    def state(self):
        return {"i": self.i}

    def restore(self, state):
        self.i = state["i"]


def _kit(tmp_path, modes):
    from jaxrl_orch.envs.vf.env import VerifiersEnv

    tok_dir = write_qwen_tokenizer(tmp_path / "qwen")
    tokenizer = load_tokenizer(str(tok_dir))
    spec = {"taskset": {"id": "jaxrl-vf-testkit", "modes": modes, "repeat": 4}}
    return tokenizer, VerifiersEnv(tokenizer, env=spec, tokenizer_dir=str(tok_dir))


def _dispatch(env, client, n, scenario, **config):
    async def main():
        loop = asyncio.get_running_loop()
        examples = Examples(env.examples("train"), n)
        d, _, _ = make(loop, env, pool=OnePool(client), source=examples, **config)
        runner = asyncio.create_task(d.start())
        try:
            await scenario(loop, d)
            await until(loop, lambda: d.idle, limit_s=120)
            await d.stop()
            await runner
        finally:
            await env.aclose()
        return d

    return asyncio.run(main())


def test_each_fault_is_an_error_rollout_counted_and_every_rollout_emitted_once(tmp_path):
    tokenizer, env = _kit(tmp_path, MODES)
    client = ScriptedClient(tokenizer, ["fine.<|im_end|>"], [2])

    async def scenario(loop, d):
        await until(loop, lambda: d.gauges()["dispatcher/emitted_total"] == 10, limit_s=120)

    d = _dispatch(env, client, 10, scenario, max_inflight=10, group_size=1, env_timeout_s=10.0)
    rollouts = [r for ep in drain(d) for r in ep]
    assert sorted(r.episode_id for r in rollouts) == list(range(10))  # each exactly once
    for r in rollouts:
        mode = env.task(r.example).data.mode
        if mode == "ok":
            assert not r.errors and r.trainable and r.num_model_tokens > 0
        else:
            (error,) = r.errors
            assert EXPECTED[mode] in error and not r.trainable, (mode, error)
    modes = [env.task(r.example).data.mode for r in rollouts]
    assert set(modes) == set(MODES)
    assert d.gauges()["dispatcher/errors_total"] == sum(m != "ok" for m in modes)
    assert d.gauges()["dispatcher/env_timeouts_total"] == modes.count("hang")
    assert not env.bridge._sessions  # every session closed with its rollout


def test_a_cancelled_episode_cancels_its_engine_request_and_closes_serving(tmp_path, monkeypatch):
    marker = tmp_path / "stopped"
    monkeypatch.setenv("JAXRL_VF_STOP_MARKER", str(marker))
    tokenizer, env = _kit(tmp_path, ["ok"])
    client = ScriptedClient(tokenizer, ["fine.<|im_end|>"], [2])
    client.hold = asyncio.Event()  # never set: every request waits for the engine

    async def scenario(loop, d):
        await until(loop, lambda: len(client.prompts) == 4, limit_s=120)
        assert not marker.exists()  # serving is open while episodes run
        d.cancel_stale(1 << 30)  # what the drop policy and shutdown do to running rollouts

    d = _dispatch(env, client, 2, scenario, max_inflight=4, group_size=2)  # 2 groups of 2
    rollouts = [r for ep in drain(d) for r in ep]
    assert len(rollouts) == 4 and all(not r.trainable for r in rollouts)
    assert all(r.errors[0].startswith("Cancelled: group started at") for r in rollouts)
    assert client.cancelled == 4 and not client.replies  # the engine requests were cancelled
    assert not env.bridge._sessions
    assert marker.read_text() == "closed"  # aclose() closed verifiers' serving context


def test_a_harness_past_verifiers_own_deadline_is_an_error_rollout(tmp_path):
    from jaxrl_orch.envs.vf.env import VerifiersEnv
    from jaxrl_orch.envs.vf.traces import EpisodeFailed
    from jaxrl_orch.types import SamplingParams

    tok_dir = write_qwen_tokenizer(tmp_path / "qwen")
    tokenizer = load_tokenizer(str(tok_dir))
    spec = {
        "taskset": {"id": "jaxrl-vf-testkit", "modes": ["hang"], "repeat": 2},
        "agent": {"timeout": {"rollout": 1.0}},  # the agent's solve attempt, verifiers' setting
    }
    env = VerifiersEnv(tokenizer, env=spec, tokenizer_dir=str(tok_dir))

    async def main():
        try:
            await env.run(
                ScriptedClient(tokenizer, ["x"], [0]),
                env.examples("train")[0],
                group_id=0,
                episode_id=0,
                sampling=SamplingParams(max_tokens=8),
            )
        finally:
            await env.aclose()

    try:
        asyncio.run(main())
    except EpisodeFailed as exc:
        assert "timed out" in str(exc) and "timeout" in str(exc).rsplit("(", 1)[1]
    else:
        raise AssertionError("a timed-out episode was trained")
