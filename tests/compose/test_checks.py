"""The before-any-work data check: every example read, only the doubtful ones tokenized."""

from __future__ import annotations

import pytest

from jaxrl_orch.compose.checks import check_fits
from jaxrl_orch.data.sources import DatasetSource


def test_only_examples_whose_byte_bound_exceeds_the_limit_are_tokenized():
    texts = [f"short line {i}" for i in range(2000)] + ["é" * 60]  # 120 UTF-8 bytes
    src = DatasetSource([{"text": t} for t in texts], shuffle=False, name="lines")
    calls = []

    def measure(ex):
        calls.append(ex["text"])
        return len(ex["text"])  # 60 characters: it fits after all

    n = check_fits(
        src, measure=measure, limit=100, what="a prompt", fix="fix it", text_of=lambda e: e["text"]
    )
    assert n == 1 and calls == ["é" * 60]  # 2,000 lines read, one tokenized
    with pytest.raises(
        ValueError, match=r"a prompt has 60 tokens, over the limit of 50: example 2000 of lines"
    ):
        check_fits(src, measure=len_text, limit=50, what="a prompt", fix="fix it", text_of=None)


def len_text(ex):
    return len(ex["text"])
