"""The examples check's verdict kept in the workdir: a restart over the same data reads nothing;
other data, another limit or a torn verdict file checks again, and a bad example still fails."""

from __future__ import annotations

import json

import gin
import pytest

from jaxrl_orch.compose import checks
from jaxrl_orch.compose.verdict import VERDICT_FILE, source_identity
from jaxrl_orch.config.load import make_config
from jaxrl_orch.data.sources import DatasetSource, make_source


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """``prepare(**settings)``: build a run's parts over a text file; returns how many examples
    the check read (0: the kept verdict stood)."""
    from support.runs import prepare

    reads = []
    real = checks.check_fits

    def counting(source, **kw):
        reads.append(len(source))
        return real(source, **kw)

    monkeypatch.setattr(checks, "check_fits", counting)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"sentence number {i} is short" for i in range(200)) + "\n")
    base = {
        "Trainer.mesh": (("fsdp", 1),),
        "Engine.mesh": (("tp", 1),),
        "Warmup.demonstrations": (),
        "Data.dataset": f"text:{corpus}",
    }

    def run(**settings):
        gin.clear_config()
        reads.clear()
        prepare(make_config({**base, **settings}), tmp_path / "run")
        return sum(reads)

    run.corpus, run.workdir = corpus, tmp_path / "run"
    return run


def test_a_restart_over_the_same_data_reads_nothing_and_a_change_checks_again(prepared, capsys):
    assert prepared() == 178 + 178 + 22  # warm-up samples, RL prompts, held-out prompts
    assert (prepared.workdir / VERDICT_FILE).is_file()
    assert prepared() == 0
    assert "every example fits (checked by an earlier start: same data)" in capsys.readouterr().out
    assert prepared(**{"RL.max_new_tokens": 60}) > 0  # another limit: its own verdict
    assert prepared(**{"RL.max_new_tokens": 60}) == 0
    lines = prepared.corpus.read_text().splitlines()
    prepared.corpus.write_text("\n".join([*lines, "x" * 10_000]) + "\n")
    with pytest.raises(ValueError, match=r"corpus.txt line 201"):  # new data: read, and it fails
        prepared(**{"RL.max_new_tokens": 60})


def test_a_torn_verdict_is_said_and_the_check_runs_again(prepared, capsys):
    prepared()
    (prepared.workdir / VERDICT_FILE).write_text('{"key": "ab')
    capsys.readouterr()
    assert prepared() == 178 + 178 + 22
    assert f"{VERDICT_FILE} cannot be read (JSONDecodeError)" in capsys.readouterr().out
    assert json.loads((prepared.workdir / VERDICT_FILE).read_text())["key"]  # written again
    assert prepared() == 0


def test_a_source_is_known_by_its_content_or_its_files():
    a = DatasetSource([{"text": "one"}, {"text": "two"}], name="tasks")
    b = DatasetSource([{"text": "one"}, {"text": "tw0"}], name="tasks")
    assert source_identity(a) != source_identity(b)
    assert source_identity(a) == source_identity(
        DatasetSource([{"text": "one"}, {"text": "two"}], name="tasks", seed=3)
    )  # the order a run walks is not what the check reads
    tfds_source = make_source("reverse_text", split="eval")
    files = source_identity(tfds_source)[-1]
    assert files and all(size > 0 for _, size, _ in files)
    assert source_identity(DatasetSource(tuple(a.data), name="tasks")) is None  # unknown kind
