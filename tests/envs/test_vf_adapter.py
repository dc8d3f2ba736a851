"""verifiers 0.4 environments through ``envs.vf``: each sampled span of a rollout is an engine
reply of its session, token for token, with that reply's log-probs and per-token versions.

Real verifiers machinery throughout (``load_environment``, ``serving()``, its interception server,
the subprocess runtime, ``TrainClient`` with a ``renderers`` renderer) with the bundled example
tasksets and ``jaxrl_vf_testkit``. The engine is the tiny byte model on a real ``DecodeEngine``
(single- and two-turn) or a scripted one where a random model cannot do what a test needs (call a
tool, end a turn with spaces a template trims); either way the reference is what the client
returned, recorded outside the adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from support.chat_checkpoints import write_llama3_tokenizer, write_qwen3_tokenizer
from support.vf_fixtures import RecordingClient, ScriptedClient, tiny_byte_engine

from jaxrl_orch.envs.base import extract_answer, model_text
from jaxrl_orch.envs.reverse_text import reverse_text_reward
from jaxrl_orch.orchestrator.train_sink import TrainSink, TrainSinkConfig
from jaxrl_orch.types import NO_VERSION, SamplingParams

SAMPLING = SamplingParams(temperature=1.0, max_tokens=24)


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory):
    from jaxrl_orch.envs.vf.env import tokenizer_dir_for

    tokenizer, client, driver = tiny_byte_engine(version=3)
    yield tokenizer, client, tokenizer_dir_for("byte", tmp_path_factory.mktemp("byte_tok"))
    driver.stop()


@pytest.fixture(scope="module")
def reverse_env(byte_engine):
    """The reverse-text example, built once (its 4,000 tasks); every test closes it after use."""
    tokenizer, _, tok_dir = byte_engine
    return _env(tokenizer, tok_dir, {"taskset": {"id": "jaxrl-reverse-text", "instruction": "R:"}})


def _env(tokenizer, tok_dir, spec, **kw):
    from jaxrl_orch.envs.vf.env import VerifiersEnv

    return VerifiersEnv(tokenizer, env=spec, tokenizer_dir=str(tok_dir), **kw)


def _run(env, client, examples, sampling=SAMPLING):
    async def main():
        try:
            return await asyncio.gather(
                *(
                    env.run(client, ex, group_id=0, episode_id=i, sampling=sampling)
                    for i, ex in enumerate(examples)
                )
            )
        finally:
            await env.aclose()

    return asyncio.run(main())


def _spans(r):
    """The trained spans of a rollout's own path: [(ids, logprobs, versions)] per model turn."""
    spans, cur = [], None
    for t, m, lp, v in zip(r.token_ids, r.loss_mask, r.logprobs, r.versions, strict=True):
        if m:
            cur = cur or ([], [], [])
            for xs, x in zip(cur, (t, lp, v), strict=True):
                xs.append(x)
        elif cur is not None:
            spans.append(cur)
            cur = None
    return spans + ([cur] if cur else [])


def test_single_turn_rollouts_are_the_engines_replies_with_their_versions(byte_engine, reverse_env):
    tokenizer, inner, _ = byte_engine
    env = reverse_env
    examples = env.examples("eval")[:3]
    client = RecordingClient(inner)
    rollouts = _run(env, client, examples)
    assert len(client.calls) == 3
    by_prompt = {tuple(p): out for p, _, out in client.calls}
    for ex, r in zip(examples, rollouts, strict=True):
        prompt = env.prompt_ids(ex)
        assert r.token_ids[: len(prompt)] == prompt and not any(r.loss_mask[: len(prompt)])
        out = by_prompt[tuple(prompt)]
        ((ids, lps, vers),) = _spans(r)
        assert (
            ids == out.token_ids and lps == out.logprobs and vers == out.versions == [3] * len(ids)
        )
        assert r.token_ids == prompt + out.token_ids and r.num_turns == 1 and not r.branches
        text = env.task(ex).data.text
        want = reverse_text_reward(extract_answer(model_text(tokenizer, out.token_ids)), text)
        assert r.reward == pytest.approx(want) and r.metrics["reward/reversal"] == r.reward
        assert r.metrics["completion_tokens"] == len(out.token_ids)


def test_two_turn_rollout_trains_both_turns_and_not_the_environments_reply(byte_engine):
    tokenizer, inner, tok_dir = byte_engine
    env = _env(tokenizer, tok_dir, {"taskset": {"id": "jaxrl-two-turn", "instruction": "R:"}})
    client = RecordingClient(inner)
    (r,) = _run(env, client, env.examples("train")[:1])
    (p1, _, out1), (p2, _, out2) = client.calls
    assert r.num_turns == 2 and p2[: len(p1)] == p1
    # A random model's first turn may hold bytes that are not UTF-8: rendered again as text it
    # does not extend the sampled ids, and the trace forks. Either way each turn trains once.
    spans = [s for path in (r, *r.branches) for s in _spans(path)]
    assert [s[0] for s in spans] == [out1.token_ids, out2.token_ids]
    assert [s[1] for s in spans] == [out1.logprobs, out2.logprobs]
    assert [s[2] for s in spans] == [out1.versions, out2.versions]
    last = r.branches[-1] if r.branches else r
    assert last.token_ids == p2 + out2.token_ids
    assert "Try again" in tokenizer.decode(p2[len(p1) :])  # the environment's turn: context


def test_tool_call_turns_through_the_qwen3_renderer(tmp_path):
    from jaxrl_orch.models.tokenizer import load_tokenizer

    tok_dir = write_qwen3_tokenizer(tmp_path / "qwen3")
    tokenizer = load_tokenizer(str(tok_dir))
    env = _env(tokenizer, tok_dir, {"taskset": {"id": "jaxrl-tool-call"}}, renderer="qwen3")
    ex = env.examples("train")[0]
    a, b = env.task(ex).data.a, env.task(ex).data.b
    args = f'{{"a": {a}, "b": {b}}}'
    call = f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
    client = ScriptedClient(tokenizer, [call + "<|im_end|>", f"It is {a + b}.<|im_end|>"], [4])
    (r,) = _run(env, client, [ex])
    assert r.reward == 1.0 and r.num_turns == 2
    spans = _spans(r)
    assert [s[0] for s in spans] == [c.token_ids for c in client.replies]
    assert [s[1] for s in spans] == [c.logprobs for c in client.replies]
    assert [s[2] for s in spans] == [c.versions for c in client.replies]  # 4, 4, ..., 5, 5
    # The tool's answer reached the model as context: in the second prompt, never trained.
    second = tokenizer.decode(client.prompts[1])
    assert f"<tool_response>\n{a + b}\n</tool_response>" in second
    assert r.token_ids == client.prompts[1] + client.replies[1].token_ids


def test_a_forked_trace_is_two_samples_and_a_shared_node_trains_once(tmp_path):
    from jaxrl_orch.models.tokenizer import load_tokenizer

    # Llama 3's template trims message content, so a turn ending in spaces re-renders shorter
    # than it was sampled: the next prompt does not extend it and the trace forks.
    tok_dir = write_llama3_tokenizer(tmp_path / "llama3")
    tokenizer = load_tokenizer(str(tok_dir))
    env = _env(tokenizer, tok_dir, {"taskset": {"id": "jaxrl-vf-testkit", "turns": 3}})
    texts = ["one<|eot_id|>", "  two  <|eot_id|>", "three<|eot_id|>"]
    client = ScriptedClient(tokenizer, texts, [7])
    (r,) = _run(env, client, env.examples("train")[:1])
    one, two, three = client.replies
    assert len(r.branches) == 1
    (branch,) = r.branches
    assert [s[0] for s in _spans(r)] == [one.token_ids, two.token_ids]
    # The second path holds turn one as well (shared), but trains only turn three.
    assert _contains(branch.token_ids, one.token_ids)
    trained = [t for t, m in zip(branch.token_ids, branch.loss_mask, strict=True) if m]
    assert trained == three.token_ids
    context = [v for v, m in zip(branch.versions, branch.loss_mask, strict=True) if not m]
    assert set(context) == {NO_VERSION}
    # The train sink makes a sample of each path, both carrying the rollout's advantage.
    (other,) = _run(env, ScriptedClient(tokenizer, ["x<|eot_id|>"], [7]), env.examples("train")[:1])
    r.reward, other.reward, other.episode_id = 1.0, 0.0, 1
    sink = TrainSink(TrainSinkConfig(group_size=2, batch_size=2), "grpo")

    async def feed():
        await sink.add([r])
        await sink.add([other])
        return sink.take_batch()

    batch = asyncio.run(feed())
    assert len(batch.samples) == 3 and len(r.samples) == 2 and len(other.samples) == 1
    trained = sum(s.num_loss_tokens for s in r.samples)
    assert trained == sum(len(c.token_ids) for c in client.replies)  # each sampled token once
    adv = {float(a) for s in r.samples for a in s.advantages[s.loss_mask]}
    assert adv == {r.advantage} and r.advantage > 0


def _contains(seq, sub):
    n = len(sub)
    return any(seq[i : i + n] == sub for i in range(len(seq) - n + 1))


def test_a_span_that_is_no_reply_of_its_session_is_an_error_naming_it(
    byte_engine, reverse_env, monkeypatch
):
    import jaxrl_orch.envs.vf.env as vf_env
    from jaxrl_orch.envs.vf.traces import TraceMismatch, episode_rollout

    inner, env = byte_engine[1], reverse_env
    seen = []
    monkeypatch.setattr(
        vf_env, "episode_rollout", lambda *a, **kw: seen.append(a) or episode_rollout(*a, **kw)
    )
    _run(env, inner, env.examples("eval")[:1])
    episode, replies = seen[0]
    (reply,) = replies
    other_lps = dataclasses.replace(reply, logprobs=[x + 0.5 for x in reply.logprobs])
    with pytest.raises(TraceMismatch, match="has the ids of engine reply 0 but other log-probs"):
        episode_rollout(episode, [other_lps], env="e", group_id=0, episode_id=0, example={})
    shifted = dataclasses.replace(reply, token_ids=[*reply.token_ids[1:], 0])
    with pytest.raises(TraceMismatch, match=r"equals no engine reply of the session \(1 replies"):
        episode_rollout(episode, [shifted], env="e", group_id=0, episode_id=0, example={})


def test_sampling_keys_the_engine_does_not_take_are_refused_at_start(byte_engine):
    tokenizer, _, tok_dir = byte_engine
    spec = {
        "taskset": {"id": "jaxrl-reverse-text"},
        "agent": {"sampling": {"temperature": 1.0, "repetition_penalty": 1.1}},
    }
    with pytest.raises(ValueError, match=r"sampling keys \['repetition_penalty'\] are not supp"):
        _env(tokenizer, tok_dir, spec)


def test_the_held_out_split_comes_from_the_taskset(byte_engine, reverse_env):
    tokenizer, _, tok_dir = byte_engine
    env = reverse_env
    train = {env.task(x).data.text for x in env.examples("train")}
    held = [env.task(x).data.text for x in env.examples("eval")]
    assert len(held) == 256 and not train & set(held)  # the bundled corpus' own split
    kit = _env(tokenizer, tok_dir, {"taskset": {"id": "jaxrl-vf-testkit", "repeat": 20}})
    names = [kit.task(x).data.name for x in kit.examples("eval")]
    assert names == [f"ok-{i}" for i in (9, 19)]  # no split field: every 10th task
    assert np.isin(names, [kit.task(x).data.name for x in kit.examples("train")]).sum() == 0


class _CutClient(RecordingClient):
    """The engine's replies, each ended short as a pause's abort ends them (its partial ids)."""

    async def generate(self, prompt_ids, sampling):
        out = await super().generate(prompt_ids, sampling)
        return dataclasses.replace(
            out,
            token_ids=out.token_ids[:3],
            logprobs=out.logprobs[:3],
            versions=out.versions[:3],
            finish_reason="abort",
        )


def test_a_reply_the_engine_cut_short_leaves_the_rollout_untrainable(byte_engine, reverse_env):
    env = reverse_env
    client = _CutClient(byte_engine[1])
    (r,) = _run(env, client, env.examples("eval")[:1])
    assert len(client.calls) == 1
    assert not r.errors and not r.trainable and r.cut == "abort" and r.metrics["cut"] == 1.0
