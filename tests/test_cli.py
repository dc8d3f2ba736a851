"""The command's first contact with a newcomer: ``--help``, ``--list_config``, the bare command,
and the closing line naming a run's outputs.

Nothing here builds a model or runs jax: ``jaxrl_orch.run.stages`` is replaced by a module that
fails to import (the paths that must stop before any work) or by fake stages (the paths that
must go on to run), so only argument and config parsing are real.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import gin
import pytest

from jaxrl_orch import train
from jaxrl_orch.config import listing
from jaxrl_orch.config.rl import RLSettings as RL
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.config.train import WarmupSettings as Warmup
from jaxrl_orch.settings import Allowed, setting

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = (
    "python -m jaxrl_orch.train --gin_file=configs/reverse_text.gin --workdir=runs/reverse_text"
)
ENTRY = re.compile(r"^  ([\w.]+): (.+) = (.+)$")  # one field's line in the listing


@pytest.fixture(autouse=True)
def _clean_gin():
    yield
    gin.clear_config()  # bindings made through main() must not leak into other tests


def _replace_stages(monkeypatch, module: types.ModuleType | None) -> None:
    import jaxrl_orch.run as run_package

    monkeypatch.setitem(sys.modules, "jaxrl_orch.run.stages", module)
    if module is None:
        monkeypatch.delattr(run_package, "stages", raising=False)
    else:
        monkeypatch.setattr(run_package, "stages", module, raising=False)


@pytest.fixture
def no_run(monkeypatch):
    """Any attempt to build the run fails the test with an ImportError."""
    _replace_stages(monkeypatch, None)


def _entries(listing: str) -> dict[str, list[str]]:
    """``{field: [its entry line, the lines under it]}``, and the comment lines above it under
    the key ``"<above>field"``."""
    out: dict[str, list[str]] = {}
    above: list[str] = []
    current = None
    for line in listing.splitlines():
        if m := ENTRY.match(line):
            current = m.group(1)
            out[current] = [line]
            out["<above>" + current] = above
            above = []
        elif line.startswith("  # "):
            above.append(line[4:])
            current = None
        elif line.startswith("      ") and current:
            out[current].append(line.strip())
    return out


# --- --help ----------------------------------------------------------------------------------


def test_help_shows_the_command_options_and_the_listing_flag():
    res = subprocess.run(
        [sys.executable, "-m", "jaxrl_orch.train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("usage: python -m jaxrl_orch.train")
    assert f"  {DOCUMENTED}" in lines  # on one line, not reflowed
    for flag in ("--gin_file", "--gin_param", "--workdir", "--defaults", "--list_config"):
        assert any(line.lstrip().startswith(flag) for line in lines), flag
    assert "--list_config prints them all" in res.stdout  # the epilog's pointer
    assert "Placement:" not in res.stdout  # the module's design note is not the help text


# --- --list_config ---------------------------------------------------------------------------


def _declared() -> dict[str, dataclasses.Field]:
    """Every setting as the listing must name it: ``Section.name``, nested sections too."""
    fields, todo = {}, [TrainConfig]
    while todo:
        cls = todo.pop(0)
        for f in dataclasses.fields(cls):
            if hasattr(f.default_factory, "SECTION"):
                todo.append(f.default_factory)
            else:
                fields[f"{cls.SECTION}.{f.name}"] = f
    return fields


def test_list_config_prints_every_field_with_type_default_and_meaning(no_run, capsys):
    assert train.main(["--list_config"]) == 0
    out = capsys.readouterr().out
    entries = _entries(out)
    fields = _declared()
    listed = [ENTRY.match(line).group(1) for line in out.splitlines() if ENTRY.match(line)]
    assert sorted(listed) == sorted(fields)  # a hard-coded list would fall behind a new field
    assert f"TrainConfig: {len(fields)} settings" in out
    for name, f in fields.items():
        assert entries[name][0] == f"  {name}: {f.type} = {f.default!r}"
        assert " ".join(entries[name][1:]) == f.metadata["meaning"], name
    for heading in ("[RL]", "[Loss]", "[Lora]", "[Engine]"):
        assert heading in out.splitlines()  # grouped by section, the loss under RL
    assert out.index("[Loss]") == out.index("[RL]") + len(
        out[out.index("[RL]") :].split("[Loss]")[0]
    )
    assert all(f.metadata["meaning"] for f in fields.values())  # every setting says what it is
    assert entries["Data.rl_prompt_pool"][0] == "  Data.rl_prompt_pool: int | None = None"


def test_listing_follows_the_dataclass_so_a_new_field_is_listed():
    @dataclasses.dataclass(frozen=True)
    class Toy:
        SECTION = "Toy"
        alpha: int = setting(1, "the alpha", Allowed.at_least(0))
        beta: str | None = setting(None, "")

    entries = _entries(listing.format_config_listing(Toy))
    assert entries["Toy.alpha"] == ["  Toy.alpha: int = 1", "the alpha"]
    assert "    allowed: >= 0" in listing.format_config_listing(Toy).splitlines()
    assert entries["Toy.beta"] == ["  Toy.beta: str | None = None"]
    assert "Toy: 2 settings" in listing.format_config_listing(Toy)


# --- the bare command ------------------------------------------------------------------------


def test_bare_command_lists_configs_and_the_default_command_and_exits_2(
    no_run, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(ROOT)
    assert train.main([f"--workdir={tmp_path / 'w'}"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err
    assert err.startswith("error: no --gin_file given")
    assert f"  {DOCUMENTED}" in err.splitlines()
    assert "--defaults" in err and "--list_config" in err
    sft, rl = Warmup.__dataclass_fields__["steps"].default, RL.__dataclass_fields__["steps"].default
    assert f"{sft} SFT steps, then {rl} RL steps" in err
    gins = sorted((ROOT / "configs").glob("*.gin"))
    assert gins
    for g in gins:
        assert f"  configs/{g.name}" in err.splitlines()
    first = (ROOT / "configs" / "reverse_text.gin").read_text().splitlines()[0].lstrip("# ")
    assert " ".join(first.split()[:6]) in err  # its leading comment, summarised
    assert not (tmp_path / "w").exists()  # nothing ran


def test_bare_command_without_a_configs_dir_still_gives_the_command(no_run, capsys, monkeypatch):
    monkeypatch.setattr(listing, "CONFIGS_DIR", Path("/nonexistent/configs"))
    assert train.main([]) == 2
    err = capsys.readouterr().err
    assert "(no gin files at /nonexistent/configs" in err
    assert f"  {DOCUMENTED}" in err.splitlines()


def test_configs_help_summarises_each_file_by_its_first_sentence(tmp_path):
    (tmp_path / "b.gin").write_text(
        "# First sentence spans\n# two lines. Second sentence.\n#\n# more\nX.y = 1\n"
    )
    (tmp_path / "a.gin").write_text("X.y = 2  # no leading comment\n")
    (tmp_path / "notes.txt").write_text("# not a config\n")
    lines = listing.configs_help(tmp_path)
    assert lines[1:] == [
        f"  {tmp_path / 'a.gin'}",
        f"  {tmp_path / 'b.gin'}",
        "      First sentence spans two lines.",
    ]


def test_defaults_with_a_gin_file_is_refused_naming_both(no_run, capsys):
    assert train.main(["--defaults", "--gin_file=configs/reverse_text.gin"]) == 2
    err = capsys.readouterr().err
    assert "--defaults" in err and "configs/reverse_text.gin" in err


# --- runs that go ahead, with fake stages ----------------------------------------------------


@dataclasses.dataclass
class _FakeParts:
    cfg: TrainConfig
    workdir: Path
    role: Any


def _fake_stages(run: Any = None) -> types.ModuleType:
    """The stages module's five functions, recording what ``prepare`` was given; no workdir
    holds a finished run."""
    module = types.ModuleType("jaxrl_orch.run.stages")
    module.made = []
    module.finished = lambda cfg, workdir, role: None

    def prepare(cfg, workdir, role, engine_addresses=(), started=None):
        module.made.append(_FakeParts(cfg, workdir, role))
        workdir.mkdir(parents=True, exist_ok=True)
        return module.made[-1]

    def write_config(parts, text):
        (parts.workdir / "config.gin").write_text(text)

    def finish(parts, summary):
        (parts.workdir / "summary.json").write_text("{}")
        (parts.workdir / "report.md").write_text("# report")
        (parts.workdir / "reward.png").write_bytes(b"")

    module.prepare, module.write_config, module.finish = prepare, write_config, finish
    module.run = run or (lambda parts, stop: {"rl_steps": parts.cfg.rl.steps})
    return module


@pytest.fixture
def fake_run(monkeypatch):
    module = _fake_stages()
    _replace_stages(monkeypatch, module)
    return module.made


@pytest.mark.parametrize(
    ("argv", "rl_steps"),
    [
        (["--defaults"], RL.__dataclass_fields__["steps"].default),
        # how tests/test_train_e2e.py runs the command: bindings only, no gin file
        (["--gin_param=RL.steps = 3", "--gin_param=Warmup.steps = 2"], 3),
    ],
)
def test_defaults_or_bindings_run_and_end_with_the_outputs_line(
    fake_run, capsys, tmp_path, argv, rl_steps
):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    wd = tmp_path / "run"
    assert train.main([*argv, f"--workdir={wd}"]) == 0
    [parts] = fake_run
    assert parts.cfg.rl.steps == rl_steps and parts.workdir == wd
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-2])["rl_steps"] == rl_steps  # the headline, then the closing line
    assert out[-1] == train.outputs_line(wd)
    assert str(wd / "report.md") in out[-1] and str(wd / "reward.png") in out[-1]
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # main() puts them back


# --- the closing line ------------------------------------------------------------------------


def test_outputs_line_names_the_report_plots_export_and_summary(tmp_path):
    for name in ("report.md", "summary.json", "reward.png", "age_hist.png", "metrics.jsonl"):
        (tmp_path / name).write_text("x")
    (tmp_path / "export").mkdir()
    line = train.outputs_line(tmp_path)
    assert "\n" not in line and line.startswith("outputs: ")
    for name in ("report.md", "summary.json", "reward.png", "age_hist.png"):
        assert str(tmp_path / name) in line, name
    assert f"{tmp_path / 'export'}/" in line
    assert "metrics.jsonl" not in line  # only what a newcomer opens first
    assert line.index("report.md") < line.index("age_hist.png") < line.index("reward.png")


def test_outputs_line_omits_what_is_absent(tmp_path):
    (tmp_path / "report.md").write_text("x")
    (tmp_path / "summary.json").write_text("{}")
    line = train.outputs_line(tmp_path)
    assert "export" not in line and ".png" not in line and "plots" not in line
    assert str(tmp_path / "report.md") in line
    assert "none found" in train.outputs_line(tmp_path / "empty")


# --- a run stopped by its storage ------------------------------------------------------------


def test_storage_errors_anywhere_in_the_chain_become_one_line_naming_the_path():
    full = OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")
    try:
        raise RuntimeError("the trainer thread failed") from full
    except RuntimeError as exc:
        wrapped = exc
    line = train.storage_error(wrapped)
    assert line.startswith("No space left on device writing /w/metrics.jsonl; free space")
    assert "rerun the same command" in line and "\n" not in line
    # tensorstore (orbax's writer) reports the errno in its message, not as an OSError
    ts = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "x/0": Failed to write 25 bytes to file 15: No space '
        "left on device [os_error_code='28']\nmore"
    )
    assert train.storage_error(ts).startswith("No space left on device (RESOURCE_EXHAUSTED")
    ro = PermissionError(errno.EROFS, "Read-only file system", "/ro/run")
    assert train.storage_error(ro).startswith("Read-only file system writing /ro/run;")
    assert train.storage_error(ValueError("bad value")) is None
    assert train.storage_error(FileNotFoundError(errno.ENOENT, "gone", "/x")) is None


def _full_disk(parts, stop) -> dict:
    try:
        raise OSError(errno.ENOSPC, "No space left on device", str(parts.workdir / "ckpt"))
    except OSError as exc:
        raise RuntimeError("checkpoint failed on the trainer thread") from exc


def test_a_full_disk_ends_the_command_with_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    _replace_stages(monkeypatch, _fake_stages(run=_full_disk))
    assert train.main(["--gin_param=RL.steps = 3", f"--workdir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: No space left on device writing {tmp_path / 'ckpt'}; free space or fix the "
        "permissions there, then rerun the same command: it resumes from the last checkpoint"
    ]
