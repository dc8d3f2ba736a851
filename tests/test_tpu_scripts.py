"""tpu_scripts/*.sh: syntax, --dry-run command lines, required settings and bad flags, and real
runs against a fake `gcloud` on PATH that records every call's argument list and answers the
describe/list calls from a script: the trainer slice plus engine VMs, created directly or
through queued resources (ACTIVE after several polls, FAILED, a timeout), set up on every
worker (with the extras a config needs, and the user's own code from --with), launched with
each process's role (--process_index, --coordinator_address, --engine_addresses), and torn
down (everything of the run, idempotently)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "tpu_scripts"
SCRIPTS = ["create.sh", "setup.sh", "launch.sh", "teardown.sh"]
BASH = shutil.which("bash")  # absolute: some tests run with a PATH that lacks it
BASE_ENV = {"TPU_PROJECT": "my-proj", "TPU_ZONE": "us-west4-a", "TPU_NAME": "rl-tpu"}
LOC = ["--project=my-proj", "--zone=us-west4-a"]
IPS = ["--flatten=networkEndpoints[]", "--format=value(networkEndpoints.ipAddress)"]
QR_STATE = ["--format=value(state.state)"]
LIST = ["--format=value(name.basename())"]


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
        timeout=60,
    )


def _gcloud_lines(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.startswith("gcloud ")]


def _flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def _train_argv(command: str) -> list[str]:
    """The `python -m jaxrl_orch.train ...` argv inside a launch ssh --command."""
    train_cmd = command.split("nohup ", 1)[1].split(" > ", 1)[0]
    argv = shlex.split(train_cmd)
    assert argv[:3] == ["python", "-m", "jaxrl_orch.train"], argv
    return argv[3:]


class FakeGcloud:
    """A `gcloud` on PATH. Every call appends its argv (a JSON list) to a log. A call is
    answered by the script for its key, the first positional words after `compute tpus`
    (e.g. "tpu-vm describe rl-tpu", "queued-resources list"): its n-th call gets the n-th
    answer (the last one repeats); unscripted calls print nothing and succeed."""

    def __init__(self, root: Path):
        self.bindir = root / "bin"
        self.bindir.mkdir()
        self.log = root / "gcloud_calls.jsonl"
        self.script = root / "gcloud_script.json"
        self.counts = root / "gcloud_counts.json"
        self.answers: dict[str, list[dict]] = {}
        fake = self.bindir / "gcloud"
        fake.write_text(
            f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(self.log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
words = [a for a in args if not a.startswith("-")]
named = words[3:4] in (["describe"], ["delete"], ["create"])
key = " ".join(words[2:5] if named else words[2:4])
try:
    script = json.load(open({str(self.script)!r}))
except FileNotFoundError:
    script = {{}}
try:
    counts = json.load(open({str(self.counts)!r}))
except FileNotFoundError:
    counts = {{}}
n = counts.get(key, 0)
counts[key] = n + 1
json.dump(counts, open({str(self.counts)!r}, "w"))
answers = script.get(key) or [{{}}]
answer = answers[min(n, len(answers) - 1)]
sys.stdout.write(answer.get("out", ""))
sys.stderr.write(answer.get("err", ""))
sys.exit(answer.get("rc", 0))
"""
        )
        fake.chmod(0o755)
        self.path = f"{self.bindir}:{os.environ['PATH']}"

    def respond(self, key: str, *answers: str | dict) -> None:
        self.answers[key] = [a if isinstance(a, dict) else {"out": a} for a in answers]
        self.script.write_text(json.dumps(self.answers))

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [["gcloud", *json.loads(x)] for x in self.log.read_text().splitlines()]

    def run(self, script: str, *args: str, env: dict | None = None):
        return _run(script, *args, env=env, path=self.path)


@pytest.fixture
def gcloud(tmp_path):
    return FakeGcloud(tmp_path)


# ---------------------------------------------------------------- every script


@pytest.mark.parametrize("script", [*SCRIPTS, "_common.sh"])
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / script)], capture_output=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_executable_and_strict(script):
    path = SCRIPTS_DIR / script
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    proc = subprocess.run(
        ["shellcheck", "-x", *SCRIPTS, "_common.sh"],
        cwd=SCRIPTS_DIR,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


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
    proc = _run(script, "--dry-run", "--name")
    assert proc.returncode != 0 and "--name needs a value" in proc.stderr


@pytest.mark.parametrize("script", ["create.sh", "setup.sh", "launch.sh"])
def test_engine_replicas_must_be_a_number(script):
    proc = _run(script, "--dry-run", "--engine-replicas", "two")
    assert proc.returncode == 2
    assert (
        "--engine-replicas 'two' is invalid" in proc.stderr and "TPU_ENGINE_REPLICAS" in proc.stderr
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_dry_run_never_calls_gcloud(script, gcloud):
    proc = gcloud.run(script, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert gcloud.calls() == []


def test_real_run_without_gcloud_says_so(tmp_path):
    # A PATH holding only the tools the scripts use, so no gcloud can be found.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("dirname", "basename", "date"):
        (bindir / tool).symlink_to(shutil.which(tool))
    proc = _run("create.sh", path=str(bindir))
    assert proc.returncode != 0
    assert "gcloud not found" in proc.stderr and "--dry-run" in proc.stderr


# ---------------------------------------------------------------- create.sh


def test_create_defaults_to_v5e_8():
    proc = _run("create.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    [argv] = _gcloud_lines(proc.stdout)
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl-tpu"]
    assert _flag(argv, "project") == "my-proj"
    assert _flag(argv, "zone") == "us-west4-a"
    assert _flag(argv, "accelerator-type") == "v5litepod-8"
    assert _flag(argv, "version") == "v2-alpha-tpuv5-lite"
    assert "--spot" not in argv and "--reserved" not in argv


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


def test_create_direct_makes_the_slice_and_one_vm_per_engine(gcloud):
    proc = gcloud.run(
        "create.sh", "--accelerator-type=v5litepod-16", "--engine-replicas=2", "--reserved"
    )
    assert proc.returncode == 0, proc.stderr
    base = ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert gcloud.calls() == [
        [*base, "rl-tpu", *LOC, "--accelerator-type=v5litepod-16",
         "--version=v2-alpha-tpuv5-lite", "--reserved"],
        [*base, "rl-tpu-engine-0", *LOC, "--accelerator-type=v5litepod-8",
         "--version=v2-alpha-tpuv5-lite", "--reserved"],
        [*base, "rl-tpu-engine-1", *LOC, "--accelerator-type=v5litepod-8",
         "--version=v2-alpha-tpuv5-lite", "--reserved"],
    ]  # fmt: skip


def test_create_engine_type_and_runtime_flags():
    env = {**BASE_ENV, "TPU_ENGINE_REPLICAS": "1"}
    proc = _run(
        "create.sh", "--dry-run", "--version=rt-x", "--engine-accelerator-type=v6e-4", env=env
    )
    assert proc.returncode == 0, proc.stderr
    trainer, engine = _gcloud_lines(proc.stdout)
    assert _flag(trainer, "version") == "rt-x"
    # another generation than the trainer's: its own default runtime, not --version
    assert _flag(engine, "accelerator-type") == "v6e-4"
    assert _flag(engine, "version") == "v2-alpha-tpuv6e"
    proc = _run("create.sh", "--dry-run", "--engine-version=rt-e", env=env)
    assert _flag(_gcloud_lines(proc.stdout)[1], "version") == "rt-e"


def test_create_refuses_a_multi_host_engine_vm():
    proc = _run(
        "create.sh", "--dry-run", "--engine-replicas=1", "--engine-accelerator-type=v5litepod-16"
    )
    assert proc.returncode == 2
    assert "v5litepod-16" in proc.stderr and "single-host" in proc.stderr
    assert _gcloud_lines(proc.stdout) == []


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--spot", "--reserved"], "--spot and --reserved exclude each other"),
        (["--valid-until-duration=6h"], "add --queued"),
        (["--queued", "--valid-until-duration=soon"], "'soon' is invalid"),
        (["--queued", "--timeout=-1"], "--timeout '-1' is invalid"),
        (["--queued", "--poll-interval=x"], "--poll-interval 'x' is invalid"),
    ],
)
def test_create_bad_settings_give_clear_errors(args, words, gcloud):
    proc = gcloud.run("create.sh", *args)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert gcloud.calls() == []


def test_create_queued_requests_each_vm_then_waits_for_active(gcloud):
    gcloud.respond(
        "queued-resources describe rl-tpu",
        "WAITING_FOR_RESOURCES\n",
        "PROVISIONING\n",
        "ACTIVE\n",
    )
    gcloud.respond("queued-resources describe rl-tpu-engine-0", "ACCEPTED\n", "ACTIVE\n")
    proc = gcloud.run(
        "create.sh",
        "--queued",
        "--engine-replicas=1",
        "--spot",
        "--valid-until-duration=6h",
        "--poll-interval=0",
    )
    assert proc.returncode == 0, proc.stderr
    create = ["gcloud", "compute", "tpus", "queued-resources", "create"]
    describe = ["gcloud", "compute", "tpus", "queued-resources", "describe"]
    rest = ["--accelerator-type=v5litepod-8", "--runtime-version=v2-alpha-tpuv5-lite",
            "--valid-until-duration=6h", "--spot"]  # fmt: skip
    assert gcloud.calls() == [
        [*create, "rl-tpu", *LOC, "--node-id=rl-tpu", *rest],
        [*create, "rl-tpu-engine-0", *LOC, "--node-id=rl-tpu-engine-0", *rest],
        # poll 1: both waiting; poll 2: the engine is ACTIVE and is not asked again
        [*describe, "rl-tpu", *LOC, *QR_STATE],
        [*describe, "rl-tpu-engine-0", *LOC, *QR_STATE],
        [*describe, "rl-tpu", *LOC, *QR_STATE],
        [*describe, "rl-tpu-engine-0", *LOC, *QR_STATE],
        [*describe, "rl-tpu", *LOC, *QR_STATE],
    ]
    assert (
        "WAITING_FOR_RESOURCES" in proc.stderr
        and "all 2 queued resources are ACTIVE" in proc.stderr
    )


@pytest.mark.parametrize("state", ["FAILED", "SUSPENDED"])
def test_create_queued_stops_on_failed_or_suspended(state, gcloud):
    gcloud.respond("queued-resources describe rl-tpu", "WAITING_FOR_RESOURCES\n", f"{state}\n")
    proc = gcloud.run("create.sh", "--queued", "--poll-interval=0")
    assert proc.returncode == 2
    assert f"queued resource rl-tpu is {state}" in proc.stderr
    assert "teardown.sh" in proc.stderr
    assert [c[4] for c in gcloud.calls()] == ["create", "describe", "describe"]


def test_create_queued_wait_is_bounded(gcloud):
    gcloud.respond("queued-resources describe rl-tpu", "WAITING_FOR_RESOURCES\n")
    proc = gcloud.run("create.sh", "--queued", "--timeout=0", "--poll-interval=0")
    assert proc.returncode == 2
    assert "not ACTIVE after 0s: rl-tpu:WAITING_FOR_RESOURCES" in proc.stderr


def test_create_queued_describe_error_is_reported(gcloud):
    gcloud.respond(
        "queued-resources describe rl-tpu", {"rc": 1, "err": "ERROR: PERMISSION_DENIED\n"}
    )
    proc = gcloud.run("create.sh", "--queued", "--poll-interval=0")
    assert proc.returncode == 2
    assert "could not read the state of queued resource rl-tpu" in proc.stderr


def test_create_failure_says_what_stays(gcloud):
    gcloud.respond("tpu-vm create rl-tpu-engine-0", {"rc": 1, "err": "ERROR: RESOURCE_EXHAUSTED\n"})
    proc = gcloud.run("create.sh", "--engine-replicas=2")
    assert proc.returncode == 2
    assert "creating rl-tpu-engine-0 failed" in proc.stderr and "teardown.sh" in proc.stderr
    assert [c[5] for c in gcloud.calls()] == ["rl-tpu", "rl-tpu-engine-0"]


@pytest.mark.parametrize(
    "args",
    [["--spot"], ["--queued", "--engine-replicas=1", "--reserved"]],
    ids=["direct", "queued"],
)
def test_real_create_passes_gcloud_the_printed_arguments(args, gcloud):
    gcloud.respond("queued-resources describe rl-tpu", "ACTIVE\n")
    gcloud.respond("queued-resources describe rl-tpu-engine-0", "ACTIVE\n")
    printed = _gcloud_lines(gcloud.run("create.sh", "--dry-run", *args).stdout)
    proc = gcloud.run("create.sh", *args)
    assert proc.returncode == 0, proc.stderr
    assert gcloud.calls() == printed


# ---------------------------------------------------------------- setup.sh


def test_setup_copies_checkout_and_installs_tpu_and_gcs_extras():
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
    assert "pip install -e '.[tpu,gcs]'" in command
    # The remote command must itself be valid shell.
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0


def test_setup_installs_on_every_worker_of_every_vm(gcloud):
    proc = gcloud.run("setup.sh", "--engine-replicas=2")
    assert proc.returncode == 0, proc.stderr
    calls = gcloud.calls()
    assert [(c[4], c[5] if c[4] == "ssh" else c[6], _flag(c, "worker")) for c in calls] == [
        ("scp", "rl-tpu:jaxrl-orch-src.tar.gz", "all"),
        ("ssh", "rl-tpu", "all"),
        ("scp", "rl-tpu-engine-0:jaxrl-orch-src.tar.gz", "all"),
        ("ssh", "rl-tpu-engine-0", "all"),
        ("scp", "rl-tpu-engine-1:jaxrl-orch-src.tar.gz", "all"),
        ("ssh", "rl-tpu-engine-1", "all"),
    ]
    for c in calls:
        assert c[:4] == ["gcloud", "compute", "tpus", "tpu-vm"]
        assert LOC[0] in c and LOC[1] in c
        if c[4] == "ssh":
            assert "pip install -e '.[tpu,gcs]'" in _flag(c, "command")
    # the tarball the scp calls copy is the archive of HEAD, really made
    assert Path(calls[0][5]).is_file()


def test_setup_clones_repo_url_at_ref():
    proc = _run(
        "setup.sh", "--dry-run", "--repo-url", "https://example.com/x/jaxrl-orch.git", "--ref=dev"
    )
    assert proc.returncode == 0, proc.stderr
    [ssh] = _gcloud_lines(proc.stdout)  # no archive, no scp
    command = _flag(ssh, "command")
    assert "git clone https://example.com/x/jaxrl-orch.git jaxrl-orch" in command
    assert "git checkout --detach origin/dev" in command
    assert "pip install -e '.[tpu,gcs]'" in command
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0


REPO = SCRIPTS_DIR.parent
# The interpreter that derives extras from a config: this one, which imports the checkout.
DERIVE_ENV = {**BASE_ENV, "TPU_LOCAL_PYTHON": sys.executable}


def _installs(command: str) -> str:
    """The extras of the `pip install -e '.[...]'` in a setup ssh --command."""
    return re.search(r"pip install -e '\.\[([^\]]*)\]'", command)[1]


def test_setup_derives_the_extras_of_a_verifiers_config_on_every_worker(gcloud, tmp_path):
    env = {**DERIVE_ENV, "TMPDIR": str(tmp_path)}
    gin = str(REPO / "configs" / "verifiers.gin")
    proc = gcloud.run("setup.sh", "--engine-replicas=1", f"--gin-file={gin}", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "the config needs the extras: tpu,verifiers" in proc.stderr
    ssh = [c for c in gcloud.calls() if c[4] == "ssh"]
    assert [c[5] for c in ssh] == ["rl-tpu", "rl-tpu-engine-0"]
    assert all(_installs(_flag(c, "command")) == "tpu,gcs,verifiers" for c in ssh)
    # a binding counts as the train command counts it; --extras adds to what is derived
    rt = str(REPO / "configs" / "reverse_text.gin")
    args = [f"--gin-file={rt}", "--gin-param=Outputs.wandb_project = 'p'", "--extras=verifiers,tpu"]
    proc = _run("setup.sh", "--dry-run", *args, env=DERIVE_ENV)
    assert proc.returncode == 0, proc.stderr
    assert _installs(_flag(_gcloud_lines(proc.stdout)[-1], "command")) == "tpu,gcs,verifiers,wandb"


def test_setup_refuses_an_undeclared_extra_naming_it(gcloud):
    proc = gcloud.run("setup.sh", "--extras=verifiers,vllm")
    assert proc.returncode == 2
    assert "extra 'vllm' is not declared in pyproject.toml" in proc.stderr
    allowed = proc.stderr.split("allowed:", 1)[1].split()
    assert {"tpu", "gcs", "verifiers", "wandb"} <= set(allowed) and "vllm" not in allowed
    assert gcloud.calls() == []
    proc = _run("setup.sh", "--dry-run", env={**BASE_ENV, "TPU_EXTRAS": "gpu"})
    assert proc.returncode == 2 and "extra 'gpu'" in proc.stderr


@pytest.mark.parametrize(
    ("env", "gin", "words"),
    [
        ({"TPU_LOCAL_PYTHON": "/nonexistent/python3"}, "verifiers.gin", "pass"),
        ({}, "nope.gin", "refused"),
    ],
)
def test_setup_says_when_it_cannot_derive_the_extras(env, gin, words, gcloud):
    proc = gcloud.run("setup.sh", f"--gin-file={REPO / 'configs' / gin}", env={**DERIVE_ENV, **env})
    assert proc.returncode == 2
    if words == "pass":
        assert "cannot derive the extras" in proc.stderr and "--extras LIST" in proc.stderr
    else:
        assert "nope.gin' does not exist" in proc.stderr and words in proc.stderr
    assert gcloud.calls() == []


def _user_code(root: Path) -> tuple[list[str], Path]:
    """A taskset module, a package and a pyproject.toml project; each would leave a marker file
    if anything ran it."""
    marker = root / "ran"
    code = f"open({str(marker)!r}, 'w').close()\n"
    root.mkdir()
    (root / "my_tasks.py").write_text(code)
    (root / "my_pkg" / "__pycache__").mkdir(parents=True)
    (root / "my_pkg" / "__init__.py").write_text(code)
    (root / "my_pkg" / "__pycache__" / "x.pyc").write_bytes(b"")
    (root / "proj" / "proj").mkdir(parents=True)
    (root / "proj" / "pyproject.toml").write_text("[project]\nname = 'proj'\n")
    (root / "proj" / "setup.py").write_text(code)
    return [str(root / "my_tasks.py"), f"{root / 'my_pkg'}/", str(root / "proj")], marker


def test_setup_with_ships_user_code_to_every_worker_of_every_vm(gcloud, tmp_path):
    paths, marker = _user_code(tmp_path / "mine")
    env = {**BASE_ENV, "TMPDIR": str(tmp_path), "TPU_WORKER": "0,1"}
    flags = [f"--with={p}" for p in paths]
    proc = gcloud.run("setup.sh", "--engine-replicas=2", *flags, env=env)
    assert proc.returncode == 0, proc.stderr
    calls = gcloud.calls()
    vms = [("rl-tpu", "0,1"), ("rl-tpu-engine-0", "all"), ("rl-tpu-engine-1", "all")]
    assert [(c[4], c[5] if c[4] == "ssh" else c[6], _flag(c, "worker")) for c in calls] == [
        step
        for vm, worker in vms
        for step in [
            ("scp", f"{vm}:jaxrl-orch-src.tar.gz", worker),
            ("scp", f"{vm}:jaxrl-orch-user.tar.gz", worker),
            ("ssh", vm, worker),
        ]
    ]
    with tarfile.open(calls[1][5]) as tar:
        names = set(tar.getnames())
    assert {"my_tasks.py", "my_pkg/__init__.py", "proj/pyproject.toml"} <= names
    assert not any("__pycache__" in n for n in names)
    for c in calls[2::3]:
        command = _flag(c, "command")
        assert "rm -rf user; mkdir -p user; tar -xzf ~/jaxrl-orch-user.tar.gz -C user" in command
        # a project is installed from outside user/, where it would shadow its own package
        assert "mv user/proj user/.projects/proj" in command
        assert command.index("pip install -e '.[tpu,gcs]'") < command.index(
            "pip install -e user/.projects/proj"
        )
    assert not marker.exists()  # nothing of the user's ran here


def test_setup_with_lands_under_user_on_the_host(gcloud, tmp_path):
    """The ssh command's unpacking steps, run in a host's home: user/ holds the modules."""
    paths, _ = _user_code(tmp_path / "mine")
    env = {**BASE_ENV, "TMPDIR": str(tmp_path)}
    repo = "--repo-url=https://example.com/r.git"
    proc = gcloud.run("setup.sh", repo, f"--with={paths[0]}", f"--with={paths[2]}", env=env)
    assert proc.returncode == 0, proc.stderr
    [scp, ssh] = gcloud.calls()
    home = tmp_path / "home"
    (home / "jaxrl-orch" / "user" / "stale").mkdir(parents=True)
    shutil.copy(scp[5], home / "jaxrl-orch-user.tar.gz")
    steps = _flag(ssh, "command").split("; ")
    unpack = steps[steps.index("rm -rf user") : steps.index("mv user/proj user/.projects/proj") + 1]
    host_env = {**os.environ, "HOME": str(home)}
    script = "cd jaxrl-orch; " + "; ".join(unpack)
    proc = subprocess.run([BASH, "-ec", script], cwd=home, env=host_env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    user = home / "jaxrl-orch" / "user"
    assert sorted(p.name for p in user.iterdir()) == [".projects", "my_tasks.py"]
    assert (user / ".projects" / "proj" / "pyproject.toml").is_file()


def test_setup_with_one_taskset_module(tmp_path):
    """The common case: one module file, no project among the paths."""
    (tmp_path / "my_tasks.py").write_text("")
    proc = _run("setup.sh", "--dry-run", f"--with={tmp_path / 'my_tasks.py'}")
    assert proc.returncode == 0, proc.stderr
    tar = [shlex.split(x) for x in proc.stdout.splitlines() if x.startswith("tar ")]
    assert tar == [[*tar[0][:-3], "-C", str(tmp_path), "my_tasks.py"]]
    command = _flag(_gcloud_lines(proc.stdout)[-1], "command")
    assert "tar -xzf ~/jaxrl-orch-user.tar.gz -C user" in command and ".projects" not in command


def test_setup_refuses_a_missing_with_path_naming_it(gcloud, tmp_path):
    missing = str(tmp_path / "my_taskz.py")
    proc = gcloud.run("setup.sh", f"--with={missing}")
    assert proc.returncode == 2
    assert f"--with '{missing}' does not exist" in proc.stderr
    assert gcloud.calls() == []
    (tmp_path / "notes.txt").write_text("")
    proc = _run("setup.sh", "--dry-run", f"--with={tmp_path / 'notes.txt'}")
    assert proc.returncode == 2 and "neither a Python module file" in proc.stderr


# ---------------------------------------------------------------- launch.sh


def _multi_host_layout(gcloud, trainer_ips=("10.0.0.2", "10.0.0.3"), engines=2):
    gcloud.respond("tpu-vm describe rl-tpu", "".join(f"{ip}\n" for ip in trainer_ips))
    for i in range(engines):
        gcloud.respond(f"tpu-vm describe rl-tpu-engine-{i}", f"10.0.1.{i + 10}\n")


def test_launch_passes_every_file_of_a_composition_in_order(gcloud):
    _multi_host_layout(gcloud)
    files = [
        "configs/model/checkpoint.gin",
        "configs/slice/v5e_16.gin",
        "configs/env/verifiers.gin",
    ]
    proc = gcloud.run(
        "launch.sh",
        "--engine-replicas=2",
        "--workdir=gs://bucket/run1",
        *(f"--gin-file={f}" for f in files),
        "--",
        "--gin_param=CHECKPOINT = 'gs://bucket/ckpt'",
    )
    assert proc.returncode == 0, proc.stderr
    for command in (_flag(c, "command") for c in gcloud.calls()[3:]):
        argv = _train_argv(command)
        assert [a for a in argv if a.startswith("--gin_file=")] == [
            f"--gin_file={f}" for f in files
        ]
        assert argv[-1] == "--gin_param=CHECKPOINT = 'gs://bucket/ckpt'"


def test_launch_starts_engines_then_every_trainer_worker_with_their_roles(gcloud):
    _multi_host_layout(gcloud)
    proc = gcloud.run(
        "launch.sh",
        "--engine-replicas=2",
        "--workdir=gs://bucket/run1",
        "--gin-file=configs/tpu_v5e_8.gin",
        "--",
        "--gin_param=Orchestrator.max_staleness = 2",
    )
    assert proc.returncode == 0, proc.stderr
    calls = gcloud.calls()
    describe = ["gcloud", "compute", "tpus", "tpu-vm", "describe"]
    assert calls[:3] == [
        [*describe, "rl-tpu", *LOC, *IPS],
        [*describe, "rl-tpu-engine-0", *LOC, *IPS],
        [*describe, "rl-tpu-engine-1", *LOC, *IPS],
    ]
    ssh = calls[3:]
    assert [(c[4], c[5], _flag(c, "worker")) for c in ssh] == [
        ("ssh", "rl-tpu-engine-0", "0"),
        ("ssh", "rl-tpu-engine-1", "0"),
        ("ssh", "rl-tpu", "all"),
    ]
    common = [
        "--gin_file=configs/tpu_v5e_8.gin",
        "--workdir=gs://bucket/run1",
        "--gin_param=Processes.trainer_processes = 2",
        "--gin_param=Processes.engine_replicas = 2",
        "--coordinator_address=10.0.0.2:8476",
        "--engine_addresses=http://10.0.1.10:50051,http://10.0.1.11:50051",
        "--weight_source=10.0.0.2:8477",
        "--api_key_file=logs/engine.key",
    ]
    extra = ["--gin_param=Orchestrator.max_staleness = 2"]
    commands = [_flag(c, "command") for c in ssh]
    assert _train_argv(commands[0]) == [*common, "--process_index=2", *extra]
    assert _train_argv(commands[1]) == [*common, "--process_index=3", *extra]
    # each trainer worker substitutes its own id ($wid) on the host
    assert _train_argv(commands[2]) == [*common, "--process_index=$wid", *extra]
    keys = {re.search(r"printf '%s' '([0-9a-f]{64})' > logs/engine.key", c)[1] for c in commands}
    assert len(keys) == 1  # one fresh key, written (mode 600) on every host of the run
    for command in commands:
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
        assert command.startswith("cd jaxrl-orch && . .venv/bin/activate")
        # setup.sh --with's code, importable by every process
        assert 'export PYTHONPATH="$PWD/user${PYTHONPATH:+:$PYTHONPATH}"' in command
        assert "umask 077 && rm -f logs/engine.key" in command
        # A host already running refuses the launch before the key is written: its run keeps
        # the key its replicas hold.
        assert command.index("training already running") < command.index("> logs/engine.key")
        assert "2>&1 < /dev/null &" in command
    assert " > logs/engine-0-" in commands[0] and " > logs/engine-1-" in commands[1]
    assert " > logs/trainer-$wid-" in commands[2]
    assert "started 2 engine replica(s) and 2 trainer process(es)" in proc.stderr


def test_launch_ports_are_flags(gcloud):
    _multi_host_layout(gcloud, trainer_ips=("10.0.0.2",), engines=1)
    env = {**BASE_ENV, "TPU_ENGINE_REPLICAS": "1", "TPU_WORKDIR": "gs://b/r"}
    proc = gcloud.run("launch.sh", "--coordinator-port=9000", "--engine-port", "7000", env=env)
    assert proc.returncode == 0, proc.stderr
    argv = _train_argv(_flag(gcloud.calls()[-1], "command"))
    assert "--coordinator_address=10.0.0.2:9000" in argv
    assert "--engine_addresses=http://10.0.1.10:7000" in argv
    assert "--gin_param=Processes.trainer_processes = 1" in argv
    proc = _run("launch.sh", "--dry-run", "--engine-port=70000")
    assert proc.returncode == 2 and "--engine-port '70000' is invalid" in proc.stderr


def _trainer_host(tmp_path, command, env, curl_out=None):
    """Run a launch ssh --command as one trainer worker would: in a home with the remote dir
    and its venv, `python` a stub that records its argv, `curl` a stub metadata server."""
    home = tmp_path / "host"
    (home / "jaxrl-orch" / ".venv" / "bin").mkdir(parents=True)
    (home / "jaxrl-orch" / ".venv" / "bin" / "activate").write_text("")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    # argv.txt last: a test that saw it may read the rest
    stub = 'printf "%s" "$PYTHONPATH" > pythonpath.txt; printf "%s\\n" "$@" > argv.txt'
    (stubs / "python").write_text(f"#!/bin/sh\n{stub}\n")
    if curl_out is None:
        (stubs / "curl").write_text("#!/bin/sh\nexit 7\n")
    else:
        (stubs / "curl").write_text(f'#!/bin/sh\necho "$*" > curl.txt\nprintf "{curl_out}"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    proc = subprocess.run(
        [BASH, "-c", command],
        cwd=home,
        env={"PATH": f"{stubs}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc, home / "jaxrl-orch"


def _wait_for(path: Path) -> str:
    for _ in range(100):
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _dry_trainer_command(hosts="2"):
    proc = _run(
        "launch.sh", "--dry-run", "--engine-replicas=1", f"--trainer-hosts={hosts}",
        "--workdir=gs://b/r",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ssh = _gcloud_lines(proc.stdout)[-1]
    assert ssh[5] == "rl-tpu" and _flag(ssh, "worker") == "all"
    return _flag(ssh, "command")


def test_launch_trainer_worker_reads_its_id_from_tpu_metadata(tmp_path):
    proc, remote_dir = _trainer_host(tmp_path, _dry_trainer_command(), env={}, curl_out="1")
    assert proc.returncode == 0, proc.stderr
    argv = _wait_for(remote_dir / "argv.txt").splitlines()
    assert argv[:2] == ["-m", "jaxrl_orch.train"]
    assert "--process_index=1" in argv and argv.count("--process_index=1") == 1
    assert "--coordinator_address=TRAINER_W0_IP:8476" in argv
    assert "agent-worker-number" in (remote_dir / "curl.txt").read_text()
    assert "Metadata-Flavor: Google" in (remote_dir / "curl.txt").read_text()
    [log] = (remote_dir / "logs").glob("trainer-1-*.log")
    assert (remote_dir / "logs" / "train.pid").read_text().strip().isdigit()
    assert "started trainer process 1 pid" in proc.stdout and log.name in proc.stdout


@pytest.mark.parametrize(("inherited", "tail"), [({}, ""), ({"PYTHONPATH": "/opt/x"}, ":/opt/x")])
def test_launch_puts_the_user_code_first_on_pythonpath(tmp_path, inherited, tail):
    env = {"TPU_WORKER_ID": "0", **inherited}
    proc, remote_dir = _trainer_host(tmp_path, _dry_trainer_command(), env=env)
    assert proc.returncode == 0, proc.stderr
    _wait_for(remote_dir / "argv.txt")
    assert (remote_dir / "pythonpath.txt").read_text() == f"{remote_dir}/user{tail}"


def test_launch_trainer_worker_prefers_tpu_worker_id(tmp_path):
    proc, remote_dir = _trainer_host(
        tmp_path, _dry_trainer_command(), env={"TPU_WORKER_ID": "0"}, curl_out="1"
    )
    assert proc.returncode == 0, proc.stderr
    assert "--process_index=0" in _wait_for(remote_dir / "argv.txt").splitlines()
    assert not (remote_dir / "curl.txt").exists()


@pytest.mark.parametrize(
    ("env", "curl_out", "words"),
    [
        ({}, None, "cannot tell this TPU worker's id"),
        ({"TPU_WORKER_ID": "x1"}, None, "cannot tell this TPU worker's id"),
        ({"TPU_WORKER_ID": "2"}, None, "worker id 2 is not below the 2 trainer processes"),
    ],
)
def test_launch_trainer_worker_without_a_valid_id_starts_nothing(tmp_path, env, curl_out, words):
    proc, remote_dir = _trainer_host(tmp_path, _dry_trainer_command(), env=env, curl_out=curl_out)
    assert proc.returncode == 1
    assert words in proc.stderr
    time.sleep(0.2)
    assert not (remote_dir / "argv.txt").exists()
    assert not (remote_dir / "logs" / "train.pid").exists()


def test_launch_refuses_to_start_twice_on_a_host(tmp_path):
    command = _dry_trainer_command()
    proc, remote_dir = _trainer_host(tmp_path, command, env={"TPU_WORKER_ID": "0"})
    assert proc.returncode == 0, proc.stderr
    (remote_dir / "logs" / "train.pid").write_text(f"{os.getpid()}\n")  # a live pid
    again = subprocess.run(
        [BASH, "-c", command],
        cwd=remote_dir.parent,
        env={"PATH": os.environ["PATH"], "TPU_WORKER_ID": "0"},
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "training already running" in again.stderr


@pytest.mark.parametrize(
    ("args", "trainer_ips"),
    [
        (["--engine-replicas=1"], ("10.0.0.2",)),  # one trainer host plus an engine VM
        ([], ("10.0.0.2", "10.0.0.3")),  # a multi-host trainer slice alone
        (["--engine-replicas=1", "--workdir=/mnt/runs/x"], ("10.0.0.2",)),
    ],
)
def test_launch_refuses_a_local_workdir_with_several_hosts(args, trainer_ips, gcloud):
    _multi_host_layout(gcloud, trainer_ips=trainer_ips, engines=1)
    proc = gcloud.run("launch.sh", *args)
    assert proc.returncode == 2
    assert "--workdir must be a gs:// URL" in proc.stderr and "TPU_WORKDIR" in proc.stderr
    assert all(c[4] == "describe" for c in gcloud.calls())  # nothing was started


def test_launch_single_host_keeps_a_local_default_workdir_and_gin_override(gcloud):
    gcloud.respond("tpu-vm describe rl-tpu", "10.0.0.2\n")
    env = {**BASE_ENV, "TPU_GIN_FILE": "configs/tpu_v6e_8.gin"}
    proc = gcloud.run("launch.sh", env=env)
    assert proc.returncode == 0, proc.stderr
    describe, ssh = gcloud.calls()
    assert ssh[5] == "rl-tpu" and _flag(ssh, "worker") == "all"
    assert _train_argv(_flag(ssh, "command")) == [
        "--gin_file=configs/tpu_v6e_8.gin",
        "--workdir=runs/rl-tpu",
        "--gin_param=Processes.trainer_processes = 1",
        "--gin_param=Processes.engine_replicas = 0",
        "--coordinator_address=10.0.0.2:8476",
        "--process_index=$wid",
    ]


def test_launch_dry_run_prints_describes_and_placeholder_addresses():
    proc = _run("launch.sh", "--dry-run", "--engine-replicas=1", "--workdir=gs://b/r")
    assert proc.returncode == 0, proc.stderr
    lines = _gcloud_lines(proc.stdout)
    assert [line[4:6] for line in lines] == [
        ["describe", "rl-tpu"],
        ["describe", "rl-tpu-engine-0"],
        ["ssh", "rl-tpu-engine-0"],
        ["ssh", "rl-tpu"],
    ]
    assert lines[0][6:] == [*LOC, *IPS]
    argv = _train_argv(_flag(lines[2], "command"))
    assert "--process_index=1" in argv  # P = 1 assumed without --trainer-hosts
    assert "--engine_addresses=http://ENGINE_0_IP:50051" in argv
    assert "placeholders" in proc.stderr


@pytest.mark.parametrize(
    ("describe", "args", "words"),
    [
        ({"rc": 1, "err": "ERROR: NOT_FOUND\n"}, [], "could not describe TPU VM rl-tpu"),
        ("", [], "TPU VM rl-tpu has no network endpoints yet"),
        ("10.0.0.2\n", ["--trainer-hosts=4"], "--trainer-hosts 4 does not match"),
        ("not-an-ip\n", [], "reported 'not-an-ip'"),
    ],
)
def test_launch_trainer_describe_problems_are_clear(describe, args, words, gcloud):
    gcloud.respond("tpu-vm describe rl-tpu", describe)
    proc = gcloud.run("launch.sh", *args)
    assert proc.returncode == 2
    assert words in proc.stderr
    assert all(c[4] == "describe" for c in gcloud.calls())


def test_launch_refuses_a_multi_host_engine_vm(gcloud):
    gcloud.respond("tpu-vm describe rl-tpu", "10.0.0.2\n")
    gcloud.respond("tpu-vm describe rl-tpu-engine-0", "10.0.1.1\n10.0.1.2\n")
    proc = gcloud.run("launch.sh", "--engine-replicas=1", "--workdir=gs://b/r")
    assert proc.returncode == 2
    assert "engine VM rl-tpu-engine-0 has 2 workers" in proc.stderr
    assert all(c[4] == "describe" for c in gcloud.calls())


def test_launch_no_longer_takes_worker():
    proc = _run("launch.sh", "--dry-run", "--worker=0")
    assert proc.returncode == 2 and "unknown flag --worker" in proc.stderr


# ---------------------------------------------------------------- teardown.sh


def test_teardown_dry_run_prints_lists_and_deletes():
    proc = _run("teardown.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lists_and_deletes = _gcloud_lines(proc.stdout)
    assert lists_and_deletes == [
        ["gcloud", "compute", "tpus", "queued-resources", "list", *LOC, *LIST],
        ["gcloud", "compute", "tpus", "tpu-vm", "list", *LOC, *LIST],
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "rl-tpu", *LOC,
         "--force", "--async"],
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", "rl-tpu", *LOC, "--async"],
    ]  # fmt: skip
    lines = _gcloud_lines(_run("teardown.sh", "--dry-run", "--yes").stdout)
    assert all("--quiet" in line for line in lines[2:])


def test_teardown_deletes_every_vm_and_queued_resource_of_the_run(gcloud):
    gcloud.respond(
        "queued-resources list",
        "rl-tpu\nrl-tpu-engine-0\nother-run\n",
        "rl-tpu\n",  # poll 1: the trainer's request is still deleting
        "",
    )
    gcloud.respond(
        "tpu-vm list",
        # the queued resources' VMs, a VM made directly, and VMs of other runs
        "rl-tpu\nrl-tpu-engine-0\nrl-tpu-engine-1\nrl-tpu-other\nother-run\n",
        "rl-tpu\n",
        "",
    )
    proc = gcloud.run("teardown.sh", "--yes", "--poll-interval=0")
    assert proc.returncode == 0, proc.stderr
    qr = ["gcloud", "compute", "tpus", "queued-resources"]
    vm = ["gcloud", "compute", "tpus", "tpu-vm"]
    assert gcloud.calls() == [
        [*qr, "list", *LOC, *LIST],
        [*vm, "list", *LOC, *LIST],
        [*qr, "delete", "rl-tpu", *LOC, "--force", "--async", "--quiet"],
        [*qr, "delete", "rl-tpu-engine-0", *LOC, "--force", "--async", "--quiet"],
        [*vm, "delete", "rl-tpu-engine-1", *LOC, "--async", "--quiet"],
        [*qr, "list", *LOC, *LIST],
        [*vm, "list", *LOC, *LIST],
        [*qr, "list", *LOC, *LIST],
        [*vm, "list", *LOC, *LIST],
    ]
    assert "waiting for deletion" in proc.stderr and "deleted: every" in proc.stderr


def test_teardown_accepts_full_resource_names_and_asks_without_yes(gcloud):
    gcloud.respond("tpu-vm list", "projects/my-proj/locations/us-west4-a/nodes/rl-tpu\n", "")
    proc = gcloud.run("teardown.sh", "--poll-interval=0")
    assert proc.returncode == 0, proc.stderr
    deletes = [c for c in gcloud.calls() if c[4] == "delete"]
    assert deletes == [["gcloud", "compute", "tpus", "tpu-vm", "delete", "rl-tpu", *LOC, "--async"]]


def test_teardown_is_idempotent(gcloud):
    proc = gcloud.run("teardown.sh", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert "nothing to delete" in proc.stderr
    assert [c[4] for c in gcloud.calls()] == ["list", "list"]


def test_teardown_wait_is_bounded(gcloud):
    gcloud.respond("tpu-vm list", "rl-tpu\n")
    gcloud.respond("tpu-vm delete rl-tpu", {"rc": 1, "err": "ERROR: FAILED_PRECONDITION\n"})
    proc = gcloud.run("teardown.sh", "--yes", "--timeout=0", "--poll-interval=0")
    assert proc.returncode == 2
    assert "delete failed for: TPU VM rl-tpu" in proc.stderr
    assert "still there after 0s: TPU VM rl-tpu" in proc.stderr


def test_teardown_list_error_is_reported(gcloud):
    gcloud.respond("queued-resources list", {"rc": 1, "err": "ERROR: PERMISSION_DENIED\n"})
    proc = gcloud.run("teardown.sh", "--yes")
    assert proc.returncode == 2
    assert "could not list the queued-resources" in proc.stderr
    assert [c[4] for c in gcloud.calls()] == ["list"]


def test_launch_stops_when_an_engine_does_not_start(gcloud):
    _multi_host_layout(gcloud, trainer_ips=("10.0.0.2",), engines=2)
    gcloud.respond("tpu-vm ssh", {"rc": 1, "err": "rl-tpu-engine-0: training already running\n"})
    proc = gcloud.run("launch.sh", "--engine-replicas=2", "--workdir=gs://b/r")
    assert proc.returncode == 2
    assert "starting engine replica 0 on rl-tpu-engine-0 failed" in proc.stderr
    assert [c[4:6] for c in gcloud.calls() if c[4] == "ssh"] == [["ssh", "rl-tpu-engine-0"]]
