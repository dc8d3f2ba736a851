"""The envs with the project's real ByteTokenizer (byte chat template specials, two stop ids)."""

import asyncio

import pytest

from jaxrl_orch.data.sentences import read_corpus
from jaxrl_orch.envs.arithmetic import ArithmeticEnv
from jaxrl_orch.envs.calculator import CalculatorEnv
from jaxrl_orch.envs.reverse_text import ReverseTextEnv
from jaxrl_orch.models.tokenizer import ByteTokenizer
from jaxrl_orch.types import NO_VERSION, SamplingParams


@pytest.fixture
def btok():
    return ByteTokenizer()


def run(env, client, example):
    return asyncio.run(
        env.run(client, example, group_id=0, episode_id=0, sampling=SamplingParams(max_tokens=64))
    )


def test_every_bundled_reverse_prompt_fits_80_tokens(btok):
    env = ReverseTextEnv(btok)
    lengths = [len(env.prompt_ids({"text": s})) for s in read_corpus()]
    assert max(lengths) <= 80
    ids = env.prompt_ids({"text": "abc"})
    assert ids[0] == btok.token_to_id("<|user|>")  # specials are single control ids
    assert btok.decode(ids).endswith("abc<|im_end|><|assistant|>")


def test_both_stop_ids_requested_and_stripped_before_scoring(btok, scripted):
    client = scripted("19<|endoftext|>", tokenizer=btok)  # fixture then appends <|im_end|>
    r = run(ArithmeticEnv(btok), client, {"question": "12+7", "answer": 19})
    assert set(btok.stop_ids) <= set(client.samplings[0].stop_token_ids)
    assert r.reward == 1.0


def test_calculator_with_byte_tokenizer(btok, scripted):
    client = scripted(
        ("<calc>983-437*773</calc>", 2, "stop", False),
        ("<answer>-336818</answer>", 3, "stop", True),
        tokenizer=btok,
    )
    r = run(CalculatorEnv(btok), client, {"question": "983-437*773", "answer": -336818})
    reply = btok.encode("<result>-336818</result>")
    assert client.prompts[1][-len(reply) :] == reply
    assert r.reward == 1.0 and r.token_ids[-1] == btok.eos_id
    env_span = slice(len(client.prompts[1]) - len(reply), len(client.prompts[1]))
    assert not any(r.loss_mask[env_span]) and set(r.versions[env_span]) == {NO_VERSION}
