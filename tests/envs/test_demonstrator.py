"""The mixed-quality demonstrator and reverse-text's behaviour accounting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxrl_orch.envs.demonstrator import MixedDemonstrator, example_fraction
from jaxrl_orch.envs.reverse_text import ReverseTextEnv, classify_answer, word_order_reversal
from jaxrl_orch.models.tokenizer import load_tokenizer

SENTENCES = [f"The town planted {n} new statues in {1700 + n}" for n in range(2000)]


@pytest.fixture(scope="module")
def env():
    return ReverseTextEnv(load_tokenizer("byte"), instruction="Reverse:")


def test_shares_follow_the_mix(env):
    demo = MixedDemonstrator(env, (("word_order", 0.5), ("no_tags", 0.2)))
    kinds = [demo.behaviour({"text": t}) for t in SENTENCES]
    assert kinds.count("word_order") / len(kinds) == pytest.approx(0.5, abs=0.03)
    assert kinds.count("no_tags") / len(kinds) == pytest.approx(0.2, abs=0.03)
    assert kinds.count("reference") / len(kinds) == pytest.approx(0.3, abs=0.03)


def test_completions_render_each_behaviour(env):
    demo = MixedDemonstrator(env, (("word_order", 0.5), ("no_tags", 0.2)))
    by_kind = {}
    for t in SENTENCES[:200]:
        by_kind.setdefault(demo.behaviour({"text": t}), t)
    t = by_kind["word_order"]
    assert demo.completion({"text": t}) == f"<answer>{word_order_reversal(t)}</answer>"
    t = by_kind["no_tags"]
    assert demo.completion({"text": t}) == t[::-1]
    t = by_kind["reference"]
    assert demo.completion({"text": t}) == f"<answer>{t[::-1]}</answer>"


def test_choice_is_a_pure_function_of_the_example(env):
    """The same example gets the same behaviour in another process (no hash seed, no state),
    so every epoch, resume and seed of a run imitates the same demonstrations."""
    ex = {"text": SENTENCES[7]}
    code = (
        "from jaxrl_orch.envs.demonstrator import example_fraction;"
        f"print(repr(example_fraction({ex!r})))"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(other.stdout) == example_fraction(ex)
    demo = MixedDemonstrator(env, (("word_order", 0.6),))
    assert len({demo.behaviour(ex) for _ in range(5)}) == 1
    # A larger share only moves examples from the reference to the worse behaviour.
    demo_more = MixedDemonstrator(env, (("word_order", 0.8),))
    for t in SENTENCES[:300]:
        if demo.behaviour({"text": t}) == "word_order":
            assert demo_more.behaviour({"text": t}) == "word_order"


def test_the_reward_is_untouched(env):
    """The demonstrator changes warm-up targets only: the verifier still scores a worse
    behaviour as worse and the reference as perfect."""
    MixedDemonstrator(env, (("word_order", 1.0),))
    t = SENTENCES[3]
    ex = {"text": t}
    assert env.score(env.reference_completion(ex), ex)[0] == 1.0
    assert env.score(env.demonstration(ex, "word_order"), ex)[0] < 0.6
    assert env.score(env.demonstration(ex, "no_tags"), ex)[0] == 0.0


@pytest.mark.parametrize(
    "mix, needle",
    [
        ((("shouting", 0.5),), "unknown demonstration behaviour 'shouting'.*no_tags"),
        ((("word_order", 1.5),), r"must be in \(0, 1\], got 1.5"),
        ((("word_order", 0.7), ("no_tags", 0.5)), "sum to 1.2"),
        ((("word_order", 0.2), ("word_order", 0.2)), "named twice"),
        ((("word_order",),), r"\(behaviour, share\) pairs"),
    ],
)
def test_bad_mix_fails_naming_the_value(env, mix, needle):
    with pytest.raises(ValueError, match=needle):
        MixedDemonstrator(env, mix)


TEXT = "In 1891 the community inaugurated its own cemetery"


@pytest.mark.parametrize(
    "answer, kind",
    [
        (TEXT[::-1], "full"),
        (TEXT[::-1].replace("y", "i", 1), "full"),  # one letter off: still a full reversal
        ("cemetery own its inaugurated community the 1891 In", "word_order"),
        ("cemetery own its inaugurated community the 1891", "word_order"),
        ("hello world", "other"),
        ("", "other"),
        (None, "no_tags"),
    ],
)
def test_behaviour_of_hand_written_answers(answer, kind):
    assert classify_answer(answer, TEXT) == kind


def test_score_labels_exactly_one_behaviour(env):
    ex = {"text": TEXT}
    for text, kind in [
        (f"<answer>{TEXT[::-1]}</answer>", "full"),
        (f"<answer>{word_order_reversal(TEXT)}</answer>", "word_order"),
        (TEXT[::-1], "no_tags"),
        ("<answer>no idea</answer>", "other"),
    ]:
        _, m = env.score(text, ex)
        labels = {k: v for k, v in m.items() if k.startswith("behaviour/")}
        assert labels == {
            f"behaviour/{b}": float(b == kind) for b in ("full", "word_order", "no_tags", "other")
        }
