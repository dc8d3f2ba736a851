"""Seeded generators: the shipped corpus is regenerable; problems are distinct and correct."""

import pytest

from jaxrl_orch.data.problems import evaluate_chain, generate_problems
from jaxrl_orch.data.sentences import (
    CORPUS_PATH,
    MAX_CHARS,
    MIN_CHARS,
    generate_sentences,
    read_corpus,
)
from jaxrl_orch.envs.expression import evaluate


def test_shipped_corpus_is_the_generator_output():
    shipped = read_corpus(CORPUS_PATH)
    assert shipped == generate_sentences()
    assert len(shipped) == len(set(shipped)) == 4000
    assert all(MIN_CHARS <= len(s) <= MAX_CHARS for s in shipped)
    assert all(s.isascii() for s in shipped)


def test_sentences_deterministic_and_seeded():
    assert generate_sentences(50, seed=1) == generate_sentences(50, seed=1)
    assert generate_sentences(50, seed=1) != generate_sentences(50, seed=2)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        generate_sentences(0)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_corpus("/nonexistent/nope.txt")


def test_problems_distinct_in_range_and_correct():
    problems = generate_problems(500, seed=7, max_operand=20, num_operands=3, ops="+-*")
    questions = [p["question"] for p in problems]
    assert len(set(questions)) == 500
    for p in problems:
        # Independent reference: the calculator's exact Fraction parser.
        assert evaluate(p["question"]) == p["answer"]
        nums = [int(x) for x in p["question"].replace("-", "+").replace("*", "+").split("+")]
        assert len(nums) == 3 and all(0 <= n <= 20 for n in nums)
    assert generate_problems(20, seed=7) == generate_problems(20, seed=7)
    assert generate_problems(20, seed=7) != generate_problems(20, seed=8)
    plus_only = generate_problems(40, ops="+", max_operand=9)
    assert {c for p in plus_only for c in p["question"] if not c.isdigit()} == {"+"}


def test_evaluate_chain_precedence():
    assert evaluate_chain([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_chain([2, 3, 4], ["*", "-"]) == 2
    assert evaluate_chain([10, 4, 3], ["-", "-"]) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ops": "/"}, "ops must be a non-empty subset"),
        ({"ops": ""}, "ops must be"),
        ({"max_operand": 0}, "max_operand must be >= 1"),
        ({"num_operands": 1}, "num_operands"),
        ({"count": 10**6, "max_operand": 9}, "count must be in \\[1, 150\\]"),
    ],
)
def test_problem_generator_bad_args(kwargs, message):
    kwargs = {"count": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_problems(**kwargs)
