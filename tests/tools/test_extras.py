"""``python -m jaxrl_orch.tools.extras``: the extras a config needs on a TPU VM host, read from
the config as the train command reads it (tpu_scripts/setup.sh --gin-file installs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl_orch.tools import extras

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _extras(capsys, *argv: str) -> str:
    assert extras.main(list(argv)) == 0
    return capsys.readouterr().out.strip()


def test_bundled_env_needs_only_tpu(capsys):
    assert _extras(capsys, f"--gin_file={CONFIGS / 'reverse_text.gin'}") == "tpu"


def test_verifiers_config_needs_verifiers(capsys):
    assert _extras(capsys, f"--gin_file={CONFIGS / 'verifiers.gin'}") == "tpu,verifiers"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--workdir=gs://bucket/run"], "tpu,gcs"),
        (["--gin_param=Warmup.from_workdir = 'gs://bucket/warm'"], "tpu,gcs"),
        (["--gin_param=Outputs.wandb_project = 'p'", "--workdir=runs/x"], "tpu,wandb"),
    ],
)
def test_gs_urls_and_wandb(capsys, args, expected):
    assert _extras(capsys, f"--gin_file={CONFIGS / 'reverse_text.gin'}", *args) == expected


def test_a_gs_url_inside_the_verifiers_dict_needs_gcs(capsys):
    env = "VERIFIERS_ENV = {'taskset': {'id': 'my_tasks', 'data': 'gs://b/tasks.jsonl'}}"
    got = _extras(capsys, f"--gin_file={CONFIGS / 'verifiers.gin'}", f"--gin_param={env}")
    assert got == "tpu,gcs,verifiers"


def test_a_bad_config_is_refused_naming_it(capsys):
    assert extras.main(["--gin_file=nope.gin"]) == 2
    assert "'nope.gin' does not exist" in capsys.readouterr().err
    assert extras.main([]) == 2
    assert "--gin_file" in capsys.readouterr().err


def test_the_command_imports_no_jax():
    code = (
        "import sys; from jaxrl_orch.tools import extras; "
        f"extras.main(['--gin_file={CONFIGS / 'verifiers.gin'}']); "
        "assert 'jax' not in sys.modules and 'verifiers' not in sys.modules, 'heavy import'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tpu,verifiers"


def test_harness_evals_need_lm_eval(capsys):
    args = ["--gin_param=HarnessEval.tasks = ('arc_easy',)", "--gin_param=Engine.serve_port = 0"]
    out = _extras(capsys, f"--gin_file={CONFIGS / 'reverse_text.gin'}", *args)
    assert out == "tpu,evals"
