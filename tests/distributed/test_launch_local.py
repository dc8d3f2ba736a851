"""``jaxrl-launch-local`` and the train command's process flags: bad input is
refused before anything starts, naming the bad value (the runs are in test_multiprocess_e2e)."""

from __future__ import annotations

import re

import pytest

from jaxrl_orch import train
from jaxrl_orch.distributed import launch_local


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--engine_replicas=0"], r"--engine_replicas must be >= 1, got 0 \(a run without"),
        (["--trainer_processes=0"], r"--trainer_processes must be >= 1, got 0"),
        (["--process_index=1"], r"--process_index is set by the launcher"),
        (["--engine_addresses=a:1"], r"--engine_addresses is set by the launcher"),
    ],
)
def test_launcher_refuses_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_local.parse_args(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_launcher_passes_the_layout_and_addresses_to_every_process(tmp_path):
    args, rest = launch_local.parse_args(
        ["--trainer_processes=2", "--engine_replicas=3", f"--workdir={tmp_path}", "--gin_param=x"]
    )
    launcher = launch_local.Launcher(args, rest)
    assert rest == ["--gin_param=x"]
    assert len(set(launcher.addresses)) == 3 and launcher.coordinator.startswith("127.0.0.1:")
    assert "--gin_param=Processes.trainer_processes = 2" in launcher.train_args
    assert "--gin_param=Processes.engine_replicas = 3" in launcher.train_args
    assert f"--engine_addresses={','.join(launcher.addresses)}" in launcher.train_args
    assert [launcher.role(k) for k in range(5)] == ["trainer"] * 2 + ["engine"] * 3
    assert (tmp_path / "logs").is_dir()


def test_free_ports_are_distinct():
    ports = launch_local.free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--process_index=0", "--engine_addresses=127.0.0.1:1"],
            r"--engine_addresses names 1 replicas.*engine_replicas=2",
        ),
        ([], r"give each its --process_index"),
        (["--process_index=7", "--engine_addresses=a:1,b:2"], r"--process_index=7 is outside"),
    ],
)
def test_train_refuses_a_bad_process_layout(flags, match, capsys, tmp_path):
    argv = [f"--workdir={tmp_path}", "--gin_param=Processes.engine_replicas = 2", *flags]
    assert train.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)
