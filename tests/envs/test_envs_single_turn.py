"""Reverse-text and arithmetic envs: seed 003's reward figures, trace alignment, bad input."""

import asyncio
import math

import pytest

from jaxrl_orch.envs import env_names, make_env, register_env
from jaxrl_orch.envs.arithmetic import ArithmeticEnv, parse_int_answer
from jaxrl_orch.envs.base import SingleTurnEnv, check_reward, extract_answer
from jaxrl_orch.envs.reverse_text import ReverseTextEnv, reverse_text_reward
from jaxrl_orch.types import FINISH_REASONS, NO_VERSION, SamplingParams

SEED_SENTENCE = "In 1891 the community inaugurated its own cemetery"
TRUTH = SEED_SENTENCE[::-1]


def run(env, client, example, sampling=None, **kw):
    sampling = sampling or SamplingParams(temperature=0.7, max_tokens=128)
    return asyncio.run(env.run(client, example, group_id=5, episode_id=9, sampling=sampling, **kw))


def test_seed_003_reward_examples():
    assert reverse_text_reward(TRUTH, SEED_SENTENCE) == 1.0
    dropped = TRUTH.replace("yretemec", "yretmec")
    assert reverse_text_reward(dropped, SEED_SENTENCE) == pytest.approx(0.99, abs=0.005)
    unreversed_year = TRUTH.replace("1981", "1891")
    assert reverse_text_reward(unreversed_year, SEED_SENTENCE) == pytest.approx(0.98)
    words_reversed = " ".join(SEED_SENTENCE.split()[::-1])
    assert reverse_text_reward(words_reversed, SEED_SENTENCE) == pytest.approx(0.40)
    assert reverse_text_reward(None, SEED_SENTENCE) == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer> abc </answer>", "abc"),
        ("x<answer>a</answer><answer>b</answer>", "a"),
        ("<answer>abc", None),
        ("abc</answer>", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reverse_text_trace_and_reward(tok, scripted):
    env = ReverseTextEnv(tok)
    client = scripted((f"<answer>{TRUTH}</answer>", 7, "stop", True))
    example = {"text": SEED_SENTENCE}
    r = run(env, client, example)
    prompt = client.prompts[0]
    assert prompt == tok.encode(tok.apply_chat_template(env.build_messages(example)))
    assert tok.decode(prompt).endswith(f"{SEED_SENTENCE}\n<assistant>")
    completion = tok.encode(f"<answer>{TRUTH}</answer>") + [tok.eos_id]
    assert r.token_ids == prompt + completion
    assert r.loss_mask == [False] * len(prompt) + [True] * len(completion)
    assert r.versions == [NO_VERSION] * len(prompt) + [7] * len(completion)
    assert r.logprobs[: len(prompt)] == [0.0] * len(prompt)
    assert r.logprobs[len(prompt) :] == [-1 - j / 1000 for j in range(len(completion))]
    assert r.reward == 1.0
    assert (r.env, r.group_id, r.episode_id, r.num_turns) == ("reverse_text", 5, 9, 1)
    assert r.temperature == 0.7 and r.example is example
    assert r.metrics["completion_tokens"] == len(completion)
    assert r.metrics["truncated"] == 0.0 and r.metrics["format_ok"] == 1.0
    assert r.head_version == 7 and r.trainable
    # The env makes sure a turn stops at eos, keeping the caller's own stop ids.
    sp = SamplingParams(stop_token_ids=(99,))
    client2 = scripted("x")
    run(env, client2, example, sampling=sp)
    assert client2.samplings[0].stop_token_ids == (99, tok.eos_id)


def test_reverse_text_malformed_and_truncated_score_zero(tok, scripted):
    env = ReverseTextEnv(tok)
    r = run(env, scripted(("<answer>yretemec nwo", 0, "length", False)), {"text": SEED_SENTENCE})
    assert r.reward == 0.0 and r.metrics["truncated"] == 1.0 and r.metrics["format_ok"] == 0.0
    r = run(env, scripted("\xff garbage \u2603"), {"text": SEED_SENTENCE})
    assert r.reward == 0.0


def test_response_prefix_is_prompt_and_scored(tok, scripted):
    env = ReverseTextEnv(tok, response_prefix="<answer>")
    client = scripted(f"{TRUTH}</answer>")
    r = run(env, client, {"text": SEED_SENTENCE})
    assert tok.decode(client.prompts[0]).endswith("<assistant><answer>")
    assert r.reward == 1.0
    assert sum(r.loss_mask) == len(tok.encode(f"{TRUTH}</answer>")) + 1


def test_add_bos(tok, scripted):
    env = ReverseTextEnv(tok, add_bos=True)
    ids = env.prompt_ids({"text": "ab"})
    assert ids[0] == tok.bos_id and ids[1:] == ReverseTextEnv(tok).prompt_ids({"text": "ab"})
    tok.bos_id = None
    with pytest.raises(ValueError, match="add_bos=True but the tokenizer has no bos_id"):
        env.prompt_ids({"text": "ab"})


def test_default_reverse_prompt_is_short(tok):
    env = ReverseTextEnv(tok)
    content = env.build_messages({"text": "x" * 60})[0]["content"]
    assert len(content.encode()) <= 96


@pytest.mark.parametrize("example", [{}, {"text": ""}, {"text": 3}])
def test_reverse_text_bad_example_raises(tok, example):
    with pytest.raises(ValueError, match="'text'"):
        ReverseTextEnv(tok).prompt_ids(example)


@pytest.mark.parametrize(
    "text, value",
    [
        ("19", 19),
        (" <answer> -3 </answer>", -3),
        ("+4", 4),
        ("19.0", None),
        ("nineteen", None),
        ("19 apples", None),
        ("<answer>x</answer> 19", None),
        ("", None),
    ],
)
def test_parse_int_answer(text, value):
    assert parse_int_answer(text) == value


def test_arithmetic_binary_reward_and_zero_variance_group(tok, scripted):
    env = ArithmeticEnv(tok)
    example = {"question": "12+7", "answer": "19"}
    rewards = [run(env, scripted(t), example).reward for t in ("<answer>19</answer>", "19", "18")]
    assert rewards == [1.0, 1.0, 0.0]
    group = [run(env, scripted("<answer>19</answer>"), example).reward for _ in range(4)]
    assert group == [1.0] * 4  # identical rewards: the train sink's zero-variance case
    client = scripted("19")
    run(env, client, {"question": "3*4", "answer": 12})
    assert tok.decode(client.prompts[0]).endswith("3*4=\n<assistant>")


@pytest.mark.parametrize(
    "example",
    [
        {"answer": "1"},
        {"question": "1+1"},
        {"question": "1+1", "answer": "two"},
        {"question": "1+1", "answer": 2.0},
        {"question": "1+1", "answer": True},
    ],
)
def test_arithmetic_bad_example_raises(tok, example):
    with pytest.raises(ValueError, match="arithmetic example"):
        ArithmeticEnv(tok).prompt_ids(example)


class _BadRewardEnv(SingleTurnEnv):
    name = "bad"

    def __init__(self, tok, reward):
        super().__init__(tok)
        self.reward = reward

    def build_messages(self, example):
        return [{"role": "user", "content": "hi"}]

    def score(self, text, example):
        return self.reward, {}


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_raises(tok, scripted, reward):
    with pytest.raises(ValueError, match="non-finite reward"):
        run(_BadRewardEnv(tok, reward), scripted("x"), {})


def test_check_reward():
    assert check_reward(1, env="e") == 1.0
    with pytest.raises(TypeError, match="non-numeric reward 'a'"):
        check_reward("a", env="e")


@pytest.mark.parametrize("reason", sorted(FINISH_REASONS))
def test_a_turn_ended_short_leaves_the_rollout_untrainable_and_says_why(tok, scripted, reason):
    r = run(ReverseTextEnv(tok), scripted(("<answer>x", 0, reason, False)), {"text": "ab"})
    whole = reason in ("stop", "length", "tool_calls")
    assert r.trainable == whole and r.metrics["cut"] == float(not whole)
    assert r.cut == (None if whole else reason)


def test_registry(tok):
    assert {"reverse_text", "arithmetic", "calculator"} <= set(env_names())
    assert isinstance(make_env("reverse_text", tokenizer=tok), ReverseTextEnv)
    assert make_env("calculator", tokenizer=tok, max_turns=2).max_turns == 2
    with pytest.raises(ValueError, match=r"unknown env 'nope'.*arithmetic.*reverse_text"):
        make_env("nope")
    register_env("my_test_env", lambda **kw: ("built", kw))
    assert make_env("my_test_env", a=1) == ("built", {"a": 1})
    with pytest.raises(ValueError, match="built-in"):
        register_env("arithmetic", dict)


def test_env_by_importable_factory_name(tok):
    # What every process of a multi-process run does with Data.env = "module:factory".
    assert make_env("collections:OrderedDict", a=1) == {"a": 1}
    with pytest.raises(ValueError, match=r"env 'no_such_mod:make'.*no_such_mod.*built-in envs"):
        make_env("no_such_mod:make")
    with pytest.raises(ValueError, match=r"Data.env 'collections:nope': cannot load 'nope'"):
        make_env("collections:nope")
    with pytest.raises(ValueError, match=r"'collections:__name__' names a str, not a callable"):
        make_env("collections:__name__")


def test_tokenizer_without_chat_template_is_rejected():
    class Half:
        bos_id = eos_id = 0

        def encode(self, t):
            return []

        def decode(self, ids):
            return ""

    with pytest.raises(TypeError, match="apply_chat_template"):
        ReverseTextEnv(Half())


def test_reference_completions_score_one():
    from jaxrl_orch.envs.arithmetic import ArithmeticEnv
    from jaxrl_orch.envs.reverse_text import ReverseTextEnv
    from jaxrl_orch.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    rt, ar = ReverseTextEnv(tok), ArithmeticEnv(tok)
    ex = {"text": "In 1891 the community inaugurated its own cemetery"}
    assert rt.score(rt.reference_completion(ex), ex)[0] == 1.0
    ex = {"question": "12+7", "answer": 19}
    assert ar.score(ar.reference_completion(ex), ex)[0] == 1.0


def test_at_temperature_view_overrides_only_the_temperature(tok, scripted):
    from jaxrl_orch.envs.base import AtTemperature

    env = ReverseTextEnv(tok)
    view = AtTemperature(env, 1.0)
    client = scripted(f"<answer>{TRUTH}</answer>")
    greedy = SamplingParams(temperature=0.0, max_tokens=77, top_k=5)
    r = run(view, client, {"text": SEED_SENTENCE}, sampling=greedy)
    sent = client.samplings[0]
    assert (sent.temperature, sent.max_tokens, sent.top_k) == (1.0, 77, 5)
    assert r.reward == 1.0 and r.temperature == 1.0
    assert view.name == env.name and view.prompt_ids({"text": "ab"}) == env.prompt_ids(
        {"text": "ab"}
    )
    assert not hasattr(view, "run_group")
    for bad in (-0.5, float("nan"), "1"):
        with pytest.raises(ValueError, match="finite number >= 0"):
            AtTemperature(env, bad)
