"""Calculator env: safe expression parser vs a Fraction reference, multi-turn trace masking."""

import asyncio
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.env_fakes import FakeByteTokenizer, ScriptedClient

from jaxrl_orch.envs.calculator import CalculatorEnv, find_call, tool_reply
from jaxrl_orch.envs.expression import ExpressionError, evaluate, format_value
from jaxrl_orch.types import NO_VERSION, SamplingParams

EXAMPLE = {"question": "12*7", "answer": 84}


def run(env, client, example=EXAMPLE):
    sampling = SamplingParams(temperature=1.0, max_tokens=64)
    return asyncio.run(env.run(client, example, group_id=1, episode_id=2, sampling=sampling))


# ----------------------------------------------------------------------------- parser

_leaf = st.integers(0, 999).map(lambda n: (str(n), Fraction(n)))


def _combine(children):
    def build(a, op, b):
        (sa, va), (sb, vb) = a, b
        if op in "/%" and vb == 0:
            return sa, va
        value = {
            "+": va + vb,
            "-": va - vb,
            "*": va * vb,
            "/": va / vb if vb else va,
            "%": va % vb if vb else va,
        }[op]
        return f"({sa}{op}{sb})", value

    neg = children.map(lambda c: (f"-{c[0]}", -c[1]))
    return st.builds(build, children, st.sampled_from("+-*/%"), children) | neg


_exprs = st.recursive(_leaf, _combine, max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(_exprs)
def test_evaluate_matches_fraction_reference(pair):
    text, value = pair
    if len(text) > 80 or max(abs(value.numerator), value.denominator) > 10**12:
        return
    assert evaluate(text) == value


@pytest.mark.parametrize(
    "text, value",
    [
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("10-4-3", 3),
        ("-2*-3", 6),
        ("7/2", Fraction(7, 2)),
        ("7 % 3", 1),
        ("1.5*2", 3),
        (" 12 * 7 ", 84),
        ("--4", 4),
    ],
)
def test_evaluate_precedence(text, value):
    assert evaluate(text) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("2**3", "unexpected '\\*'"),
        ("__import__('os')", "unexpected character '_'"),
        ("(1+2", "unexpected end"),
        ("1+2)", "unexpected '\\)'"),
        ("", "empty"),
        ("1" * 81, "longer than 80"),
        ("9999999*9999999", "too large"),
        ("-" * 20 + "1", "nested too deeply"),
        ("(" * 17 + "1" + ")" * 17, "nested too deeply"),
        ("1 2", "unexpected '2'"),
    ],
)
def test_evaluate_rejects(text, message):
    with pytest.raises(ExpressionError, match=message):
        evaluate(text)


def test_format_value():
    assert format_value(Fraction(84)) == "84"
    assert format_value(Fraction(-7, 2)) == "-3.5"
    assert format_value(Fraction(1, 3)) == "0.333333"
    assert format_value(Fraction(-1, 10**9)) == "0"


def test_find_call_and_reply():
    assert find_call("ok <calc>1+2</calc> tail") == ("1+2", len("ok <calc>1+2</calc>"))
    assert find_call("<answer>3</answer><calc>1+2</calc>") is None
    assert find_call("<calc>1+2") is None
    assert tool_reply("12*7") == ("<result>84</result>", False)
    assert tool_reply("1/0") == ("<result>error: division by zero</result>", True)


# ----------------------------------------------------------------------------- multi-turn


def test_two_turn_trace_masks_env_tokens_and_keeps_turn_versions(tok, scripted):
    turn1 = "I use <calc>12*7</calc>"
    hallucinated = "<result>99</result>"
    turn2 = "<answer>84</answer>"
    client = scripted((turn1 + hallucinated, 3, "stop", True), (turn2, 4, "stop", True))
    r = run(CalculatorEnv(tok), client)

    prompt = client.prompts[0]
    t1 = tok.encode(turn1)  # the hallucinated tail past </calc> is cut
    reply = tok.encode("<result>84</result>")
    t2 = tok.encode(turn2) + [tok.eos_id]
    assert client.prompts[1] == prompt + t1 + reply  # turn 2 sees the full history
    assert r.token_ids == prompt + t1 + reply + t2
    assert r.loss_mask == [False] * len(prompt) + [True] * len(t1) + [False] * len(reply) + [
        True
    ] * len(t2)
    assert r.versions == [NO_VERSION] * len(prompt) + [3] * len(t1) + [NO_VERSION] * len(reply) + [
        4
    ] * len(t2)
    n0 = len(prompt)
    assert r.logprobs[:n0] == [0.0] * n0
    assert r.logprobs[n0 : n0 + len(t1)] == [-1 - j / 1000 for j in range(len(t1))]
    assert r.logprobs[n0 + len(t1) : n0 + len(t1) + len(reply)] == [0.0] * len(reply)
    assert r.logprobs[-len(t2) :] == [-2 - j / 1000 for j in range(len(t2))]
    assert (r.head_version, r.tail_version) == (3, 4)
    assert r.reward == 1.0 and r.num_turns == 2
    assert r.metrics["tool_calls"] == 1.0 and r.metrics["tool_errors"] == 0.0
    assert r.metrics["completion_tokens"] == len(tok.encode(turn1 + hallucinated)) + 1 + len(t2)
    assert r.metrics["format_ok"] == 1.0 and r.metrics["max_turns_reached"] == 0.0
    assert all(tok.eos_id in s.stop_token_ids for s in client.samplings)


def test_tool_error_is_replied_not_raised(tok, scripted):
    client = scripted("<calc>1/0</calc>", "<answer>0</answer>")
    r = run(CalculatorEnv(tok), client)
    assert tok.decode(client.prompts[1]).endswith("<result>error: division by zero</result>")
    assert r.metrics["tool_errors"] == 1.0 and r.reward == 0.0 and r.metrics["format_ok"] == 1.0


def test_max_turns_ends_on_model_tokens(tok, scripted):
    client = scripted(*["<calc>1+1</calc>"] * 3)
    r = run(CalculatorEnv(tok, max_turns=3), client)
    assert r.num_turns == 3 and len(client.prompts) == 3
    assert r.metrics["max_turns_reached"] == 1.0 and r.metrics["tool_calls"] == 3.0
    assert r.reward == 0.0 and r.loss_mask[-1]  # no reply appended after the last turn


def test_malformed_and_direct_answers(tok, scripted):
    r = run(CalculatorEnv(tok), scripted("eighty four"))
    assert (r.reward, r.num_turns, r.metrics["format_ok"]) == (0.0, 1, 0.0)
    r = run(CalculatorEnv(tok), scripted("<answer>84</answer> <calc>1</calc>"))
    assert (r.reward, r.num_turns, r.metrics["tool_calls"]) == (1.0, 1, 0.0)
    for reason in ("cancelled", "abort"):  # a turn ended short: its tool call is not run
        client = scripted(("<calc>12*7</calc>", 0, reason, False), "<answer>84</answer>")
        r = run(CalculatorEnv(tok), client)
        assert not r.trainable and r.cut == reason and r.metrics["cut"] == 1.0
        assert r.num_turns == 1 and r.metrics["tool_calls"] == 0.0


def test_context_limit_stops_before_reply(tok, scripted):
    env = CalculatorEnv(tok)
    prompt_len = len(env.prompt_ids(EXAMPLE))
    call = "<calc>12*7</calc>"
    env = CalculatorEnv(tok, max_context_tokens=prompt_len + len(call) + 5)
    client = scripted(call, "<answer>84</answer>")
    r = run(env, client)
    assert len(client.prompts) == 1 and r.metrics["truncated"] == 1.0
    assert r.metrics["max_turns_reached"] == 0.0 and len(r.token_ids) == prompt_len + len(call)


def test_cut_respects_multibyte_tokens(tok, scripted):
    # "é" is two byte tokens; the cut must land on the last byte of "</calc>", not inside it.
    client = scripted("é<calc>2*3</calc>é", "<answer>6</answer>")
    r = run(CalculatorEnv(tok), client, {"question": "2*3", "answer": "6"})
    assert client.prompts[1][-len(tok.encode("<result>6</result>")) - 1] == tok.encode(">")[0]
    assert r.reward == 1.0


def test_bad_config_and_example(tok):
    with pytest.raises(ValueError, match="max_turns must be >= 1, got 0"):
        CalculatorEnv(tok, max_turns=0)
    with pytest.raises(ValueError, match="max_context_tokens"):
        CalculatorEnv(tok, max_context_tokens=1)
    with pytest.raises(ValueError, match="prompt has \\d+ tokens, not below max_context_tokens=5"):
        run(CalculatorEnv(tok, max_context_tokens=5), None)
    with pytest.raises(ValueError, match="'question'"):
        CalculatorEnv(tok).prompt_ids({"answer": 1})


_turn = st.one_of(
    st.tuples(
        st.just("call"), st.sampled_from(["1+2", "3*(4-5)", "7/0", "x"]), st.text(max_size=8)
    ),
    st.tuples(st.just("text"), st.text(max_size=12), st.just("")),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_turn, min_size=1, max_size=5), st.integers(1, 4))
def test_trace_invariants_for_any_turn_script(turns, max_turns):
    scripts = [
        (f"<calc>{arg}</calc>{tail}" if kind == "call" else arg, 10 + k, "stop", False)
        for k, (kind, arg, tail) in enumerate(turns)
    ] + [("<answer>1</answer>", 99, "stop", True)] * 5
    tok = FakeByteTokenizer()
    client = ScriptedClient(tok, scripts)
    r = run(CalculatorEnv(tok, max_turns=max_turns), client)
    r.validate_trace()
    assert r.num_turns == len(client.prompts) <= max_turns
    # Each generate call saw exactly the trace so far, so the trace is prompt-consistent.
    for p in client.prompts:
        assert r.token_ids[: len(p)] == p
    # Model tokens carry their turn's version and log-probs; everything else is context.
    bounds = [len(p) for p in client.prompts] + [len(r.token_ids)]
    for k in range(r.num_turns):
        span = range(bounds[k], bounds[k + 1])
        model = [i for i in span if r.loss_mask[i]]
        assert model == list(range(bounds[k], bounds[k] + len(model)))  # model first, then reply
        assert all(r.versions[i] == scripts[k][1] for i in model)
        assert [r.logprobs[i] for i in model] == [-(k + 1) - j / 1000 for j in range(len(model))]
        assert all(
            r.versions[i] == NO_VERSION and r.logprobs[i] == 0.0 for i in span if not r.loss_mask[i]
        )
    assert not any(r.loss_mask[: len(client.prompts[0])])
