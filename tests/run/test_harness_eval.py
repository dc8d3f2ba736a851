"""The harness evals' bookkeeping, with stand-ins for lm-eval (a real lm-eval against a real run:
``test_harness_eval_e2e.py``): the row of a finished run at the step it started from, a failed
or hung run counted and named, a due run skipped while the last one goes, lm-eval's argv."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from jaxrl_orch.config.rl import HarnessEvalSettings
from jaxrl_orch.run.harness_eval import HarnessEvals, scores

RESULTS = {
    "results": {
        "jaxrl_mc": {"alias": "jaxrl_mc", "acc,none": 0.5, "acc_stderr,none": 0.25},
        "jaxrl_gen": {"exact_match,strip": 1.0, "exact_match_stderr,strip": "N/A"},
    }
}


def _stand_in(tmp_path: Path, body: str) -> list[str]:
    """A command standing in for ``python -m lm_eval``: ``body`` runs with ``out``, the
    ``--output_path`` it was given."""
    script = tmp_path / "stand_in.py"
    script.write_text(
        "import json, pathlib, sys, time\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--output_path') + 1])\n"
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def _evals(tmp_path: Path, command: list[str], **settings) -> tuple[HarnessEvals, list]:
    rows: list = []
    versions = iter(range(3, 100))
    evals = HarnessEvals(
        HarnessEvalSettings(tasks=("jaxrl_mc", "jaxrl_gen"), **settings),
        url=lambda: "http://127.0.0.1:8123/",
        model="tiny",
        tokenizer_dir="/tok",
        max_length=96,
        out_dir=tmp_path / "harness",
        write_row=lambda step, row: rows.append((step, row)),
        version=lambda: next(versions),
        command=command,
    )
    return evals, rows


def _steps(evals: HarnessEvals, steps: list[int], between_s: float = 0.0) -> None:
    async def main():
        for step in steps:
            evals.after_step(step)
            await asyncio.sleep(between_s)
        await evals.close()

    asyncio.run(main())


def test_a_finished_run_is_one_row_at_its_step_with_the_versions_it_spanned(tmp_path):
    body = f"""
    (out / 'tiny').mkdir(parents=True)
    (out / 'tiny' / 'results_2026.json').write_text(json.dumps({RESULTS!r}))
    """
    evals, rows = _evals(tmp_path, _stand_in(tmp_path, body), every=2)
    _steps(evals, [1, 2, 3])
    assert rows == [
        (
            2,
            {
                "harness/jaxrl_mc/acc": 0.5,
                "harness/jaxrl_gen/exact_match/strip": 1.0,
                "harness/version_first": 3,
                "harness/version_last": 4,
            },
        )
    ]
    assert evals.summary() == {"runs": 1, "failed": 0, "skipped": 0}
    assert (tmp_path / "harness" / "step_2" / "lm_eval.log").is_file()


def test_a_failed_and_a_hung_run_are_counted_and_named(tmp_path, capsys):
    failing, _ = _evals(tmp_path, _stand_in(tmp_path, "print('no such task'); sys.exit(3)"))
    _steps(failing, [10])
    hung, rows = _evals(tmp_path, _stand_in(tmp_path, "time.sleep(60)"), timeout_s=0.5)
    _steps(hung, [10])
    silent, _ = _evals(tmp_path, _stand_in(tmp_path, "pass"))  # exits 0, writes nothing
    _steps(silent, [10])
    assert rows == []
    for evals in (failing, hung, silent):
        assert evals.summary() == {"runs": 1, "failed": 1, "skipped": 0}
    out = capsys.readouterr().out
    log = tmp_path / "harness" / "step_10" / "lm_eval.log"
    assert f"!! the run of step 10 exited 3; its log: {log}" in out
    assert "!! the run of step 10 ran past 0.5 s (HarnessEval.timeout_s)" in out
    assert "exited 0 but wrote no results_*.json" in out


def test_a_due_run_is_skipped_while_the_last_one_goes(tmp_path, capsys):
    evals, _ = _evals(tmp_path, _stand_in(tmp_path, "time.sleep(1.0)"), every=1)
    _steps(evals, [1, 2, 3], between_s=0.05)
    assert evals.summary() == {"runs": 1, "failed": 1, "skipped": 2}
    assert "step 2 skipped: the run started earlier still goes" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["local-completions", "local-chat-completions"])
def test_lm_eval_is_pointed_at_the_live_server_as_a_user_points_it_at_vllm(tmp_path, model):
    evals, _ = _evals(tmp_path, ["lm_eval"], model=model, limit=4, include_path="/tasks")
    argv = evals.argv(tmp_path / "out")
    route = "/v1/completions" if model == "local-completions" else "/v1/chat/completions"
    args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
    assert argv[:3] == ["lm_eval", "--model", model]
    assert args["base_url"] == f"http://127.0.0.1:8123{route}"
    assert (args["model"], args["tokenizer"], args["max_length"]) == ("tiny", "/tok", "96")
    assert argv[argv.index("--tasks") + 1] == "jaxrl_mc,jaxrl_gen"
    assert argv[argv.index("--limit") + 1] == "4"
    assert argv[argv.index("--include_path") + 1] == "/tasks"
    assert ("--apply_chat_template" in argv) == (model == "local-chat-completions")


def test_scores_keep_every_number_but_the_standard_errors(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "results_1.json").write_text(json.dumps(RESULTS))
    assert scores(tmp_path) == {
        "harness/jaxrl_mc/acc": 0.5,
        "harness/jaxrl_gen/exact_match/strip": 1.0,
    }


def test_tasks_without_the_live_server_are_refused_naming_both_settings():
    from jaxrl_orch.config.load import load_config

    refusal = r"HarnessEval.tasks \(\['arc_easy'\]\).*Engine.serve_port"
    with pytest.raises(ValueError, match=refusal):
        load_config([], ["HarnessEval.tasks = ('arc_easy',)"])
    with pytest.raises(ValueError, match="HarnessEval.every must be >= 1, got 0"):
        load_config([], ["HarnessEval.every = 0"])


def test_close_with_abort_kills_a_running_harness_at_once(tmp_path):
    marker = tmp_path / "lm_eval_pid"
    evals, rows = _evals(
        tmp_path,
        _stand_in(
            tmp_path,
            f"import os; open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(60)",
        ),
    )

    async def main():
        evals.after_step(10)
        while not marker.exists():
            await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        await evals.close(abort=True)
        return asyncio.get_running_loop().time() - t0

    waited = asyncio.run(main())
    assert waited < 30  # not the stand-in's 60 s, nor the 1800 s timeout
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    assert rows == [] and evals.summary() == {"runs": 0, "failed": 0, "skipped": 0}
