"""tpu_scripts/*.sh: syntax, --dry-run command lines, required settings, gcloud never needed
for a dry run, and a real run hands gcloud exactly the printed arguments."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "tpu_scripts"
SCRIPTS = ["create.sh", "setup.sh", "launch.sh", "teardown.sh"]
BASH = shutil.which("bash")  # absolute: some tests run with a PATH that lacks it
BASE_ENV = {"TPU_PROJECT": "my-proj", "TPU_ZONE": "us-west4-a", "TPU_NAME": "rl-tpu"}


def _run(script: str, *args: str, env: dict | None = None, path: str | None = None):
    full_env = {
        "PATH": path if path is not None else os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
    }
    full_env.update(BASE_ENV if env is None else env)
    return subprocess.run(
        [BASH, str(SCRIPTS_DIR / script), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=30,
    )


def _gcloud_lines(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.startswith("gcloud ")]


def _flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


@pytest.mark.parametrize("script", [*SCRIPTS, "_common.sh"])
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / script)], capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_and_strict(script):
    path = SCRIPTS_DIR / script
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()


def test_create_defaults_to_v5e_8():
    proc = _run("create.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    [argv] = _gcloud_lines(proc.stdout)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-tpu"]
    assert _flag(argv, "project") == "my-proj"
    assert _flag(argv, "zone") == "us-west4-a"
    assert _flag(argv, "accelerator-type") == "v5litepod-8"
    assert _flag(argv, "version") == "v2-alpha-tpuv5-lite"
    assert "--spot" not in argv


def test_create_v6e_picks_its_runtime_and_flags_override_env():
    proc = _run(
        "create.sh", "--dry-run", "--accelerator-type", "v6e-8", "--zone=europe-west4-a", "--spot"
    )
    assert proc.returncode == 0, proc.stderr
    [argv] = _gcloud_lines(proc.stdout)
    assert _flag(argv, "accelerator-type") == "v6e-8"
    assert _flag(argv, "version") == "v2-alpha-tpuv6e"
    assert _flag(argv, "zone") == "europe-west4-a"
    assert "--spot" in argv
    env = {**BASE_ENV, "TPU_RUNTIME_VERSION": "custom-rt", "TPU_ACCELERATOR_TYPE": "v6e-8"}
    [argv] = _gcloud_lines(_run("create.sh", "--dry-run", env=env).stdout)
    assert _flag(argv, "version") == "custom-rt"


def test_create_unknown_accelerator_needs_explicit_version():
    proc = _run("create.sh", "--dry-run", "--accelerator-type", "v9x-8")
    assert proc.returncode != 0
    assert "v9x-8" in proc.stderr and "--version" in proc.stderr


def test_teardown_deletes_and_confirms_unless_yes():
    proc = _run("teardown.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    [argv] = _gcloud_lines(proc.stdout)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "rl-tpu"]
    assert _flag(argv, "zone") == "us-west4-a" and _flag(argv, "project") == "my-proj"
    assert "--quiet" not in argv
    [argv] = _gcloud_lines(_run("teardown.sh", "--dry-run", "--yes").stdout)
    assert "--quiet" in argv


def test_setup_copies_checkout_and_installs_tpu_extra():
    proc = _run("setup.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(x) for x in proc.stdout.splitlines()]
    archive, scp, ssh = lines
    assert archive[0] == "git" and "archive" in archive and archive[-1] == "HEAD"
    tarball = _flag(archive, "output")
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[5] == tarball and scp[6] == "rl-tpu:jaxrl-orch-src.tar.gz"
    assert _flag(scp, "worker") == "all"
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl-tpu"]
    assert _flag(ssh, "worker") == "all" and _flag(ssh, "zone") == "us-west4-a"
    command = _flag(ssh, "command")
    assert "tar -xzf jaxrl-orch-src.tar.gz -C jaxrl-orch" in command
    assert "python3.11 -m venv .venv" in command
    assert "pip install -e '.[tpu]'" in command
    # The remote command must itself be valid shell.
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0


def test_setup_clones_repo_url_at_ref():
    proc = _run(
        "setup.sh", "--dry-run", "--repo-url", "https://example.com/x/jaxrl-orch.git", "--ref=dev"
    )
    assert proc.returncode == 0, proc.stderr
    [ssh] = _gcloud_lines(proc.stdout)  # no archive, no scp
    command = _flag(ssh, "command")
    assert "git clone https://example.com/x/jaxrl-orch.git jaxrl-orch" in command
    assert "git checkout --detach origin/dev" in command
    assert "pip install -e '.[tpu]'" in command
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0


def test_launch_runs_train_under_nohup_on_all_workers():
    proc = _run(
        "launch.sh",
        "--dry-run",
        "--workdir",
        "gs://bucket/run1",
        "--",
        "--gin_param=Orchestrator.max_staleness = 2",
    )
    assert proc.returncode == 0, proc.stderr
    [ssh] = _gcloud_lines(proc.stdout)
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "rl-tpu"]
    assert _flag(ssh, "worker") == "all"
    command = _flag(ssh, "command")
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    assert command.startswith("cd jaxrl-orch && . .venv/bin/activate")
    nohup_part = command.split("nohup ", 1)[1]
    train_cmd, redirect = nohup_part.split(" > ", 1)
    assert shlex.split(train_cmd) == [
        "python",
        "-m",
        "jaxrl_orch.train",
        "--gin_file=configs/tpu_v5e_8.gin",
        "--workdir=gs://bucket/run1",
        "--gin_param=Orchestrator.max_staleness = 2",
    ]
    assert redirect.startswith("logs/train-") and "2>&1 < /dev/null &" in redirect


def test_launch_default_workdir_and_gin_file_override():
    env = {**BASE_ENV, "TPU_GIN_FILE": "configs/tpu_v6e_8.gin"}
    [ssh] = _gcloud_lines(_run("launch.sh", "--dry-run", "--worker=0", env=env).stdout)
    assert _flag(ssh, "worker") == "0"
    command = _flag(ssh, "command")
    assert "--gin_file=configs/tpu_v6e_8.gin --workdir=runs/rl-tpu" in command


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    ("missing", "words"),
    [("TPU_NAME", "TPU name"), ("TPU_PROJECT", "project"), ("TPU_ZONE", "zone")],
)
def test_missing_required_setting_fails_naming_it(script, missing, words):
    env = {k: v for k, v in BASE_ENV.items() if k != missing}
    proc = _run(script, "--dry-run", env=env)
    assert proc.returncode != 0
    assert words in proc.stderr and missing in proc.stderr
    assert "gcloud" not in proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_flag_and_bad_name_are_rejected(script):
    proc = _run(script, "--dry-run", "--nope", "1")
    assert proc.returncode != 0 and "--nope" in proc.stderr
    proc = _run(script, "--dry-run", "--name", "Bad_Name")
    assert proc.returncode != 0 and "Bad_Name" in proc.stderr


@pytest.fixture
def fake_gcloud(tmp_path):
    """A gcloud on PATH that records its argv, one argument per line, to a file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "gcloud_calls"
    fake = bindir / "gcloud"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {log}\necho --- >> {log}\n')
    fake.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}", log


@pytest.mark.parametrize("script", SCRIPTS)
def test_dry_run_never_calls_gcloud(script, fake_gcloud):
    path, log = fake_gcloud
    proc = _run(script, "--dry-run", path=path)
    assert proc.returncode == 0, proc.stderr
    assert not log.exists()


@pytest.mark.parametrize(("script", "args"), [("create.sh", ["--spot"]), ("teardown.sh", [])])
def test_real_run_passes_gcloud_the_printed_arguments(script, args, fake_gcloud):
    path, log = fake_gcloud
    [printed] = _gcloud_lines(_run(script, "--dry-run", *args, path=path).stdout)
    proc = _run(script, *args, path=path)
    assert proc.returncode == 0, proc.stderr
    called = log.read_text().splitlines()
    assert called[-1] == "---"
    assert ["gcloud", *called[:-1]] == printed


def test_real_run_without_gcloud_says_so(tmp_path):
    # A PATH holding only the tools the scripts use, so no gcloud can be found.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("dirname", "basename", "date"):
        (bindir / tool).symlink_to(shutil.which(tool))
    proc = _run("create.sh", path=str(bindir))
    assert proc.returncode != 0
    assert "gcloud not found" in proc.stderr and "--dry-run" in proc.stderr
