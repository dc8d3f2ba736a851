"""``jaxrl-launch-local`` and the train command's process flags: bad input is
refused before anything starts, naming the bad value; the launcher owns the workdir before it
writes there and hands its claim to trainer process 0; a replica failing twice the same way
stops the run (stand-in processes, ``support.launch_standin``; the real runs are in
test_multiprocess_e2e)."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time

import pytest
from support.checkout import helper_cmd, subprocess_env

from jaxrl_orch import serve, train
from jaxrl_orch.compose.replica import check_bind
from jaxrl_orch.distributed import launch_local
from jaxrl_orch.distributed.addresses import (
    Replicas,
    bind_of,
    host_port,
    read_api_key,
    replica_urls,
)
from jaxrl_orch.distributed.group import Role
from jaxrl_orch.owner import claim_workdir


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--engine_replicas=0"], r"--engine_replicas must be >= 1, got 0 \(a run without"),
        (["--trainer_processes=0"], r"--trainer_processes must be >= 1, got 0"),
        (["--process_index=1"], r"--process_index is set by the launcher"),
        (["--engine_addresses=a:1"], r"--engine_addresses is set by the launcher"),
        (["--weight_source=a:1"], r"--weight_source is set by the launcher"),
    ],
)
def test_launcher_refuses_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        launch_local.parse_args(argv)
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@contextlib.contextmanager
def _launcher(*argv: str, program: tuple[str, ...] = launch_local.TRAIN):
    """A launcher on its claimed workdir, as ``launch_local.main`` builds it."""
    args, rest = launch_local.parse_args(list(argv))
    claim = claim_workdir(args.workdir)
    try:
        yield launch_local.LocalLauncher(args, rest, claim, program=program)
    finally:
        claim.release()


def test_launcher_passes_the_layout_and_addresses_to_every_process(tmp_path):
    with _launcher(
        "--trainer_processes=2", "--engine_replicas=3", f"--workdir={tmp_path}", "--gin_param=x"
    ) as launcher:
        pass
    assert launcher.train_args[0] == "--gin_param=x"
    assert len(set(launcher.addresses)) == 3 and launcher.coordinator.startswith("127.0.0.1:")
    assert all(a.startswith("http://127.0.0.1:") for a in launcher.addresses)
    ports = {a.rsplit(":", 1)[1] for a in launcher.addresses}
    ports |= {launcher.coordinator.rsplit(":", 1)[1], launcher.weight_source.rsplit(":", 1)[1]}
    assert len(ports) == 5 and launcher.weight_source.startswith("127.0.0.1:")
    assert "--gin_param=Processes.trainer_processes = 2" in launcher.train_args
    assert "--gin_param=Processes.engine_replicas = 3" in launcher.train_args
    assert f"--engine_addresses={','.join(launcher.addresses)}" in launcher.train_args
    assert f"--weight_source={launcher.weight_source}" in launcher.train_args
    # Every process gets the same flags: the trainer leader binds the weight source, each
    # replica pulls from it and binds its own URL.
    assert replica_urls(",".join(launcher.addresses)) == tuple(launcher.addresses)
    assert [launcher.role(k) for k in range(5)] == ["trainer"] * 2 + ["engine"] * 3
    assert (tmp_path / "logs").is_dir()


def test_each_launch_gives_its_replicas_a_fresh_key_only_its_user_can_read(tmp_path):
    def launch(*extra):
        with _launcher(
            "--engine_replicas=1", f"--workdir={tmp_path}", "--gin_param=x", *extra
        ) as launcher:
            return launcher.train_args

    key_file = tmp_path / "logs" / "engine.key"
    assert f"--api_key_file={key_file}" in launch()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = read_api_key(str(key_file))
    assert len(key) >= 32
    launch()
    assert read_api_key(str(key_file)) != key  # a new secret per launch
    own = tmp_path / "mine.key"
    own.write_text("the-user-key")
    kept = launch(f"--api_key_file={own}")
    assert [a for a in kept if "api_key_file" in a] == [f"--api_key_file={own}"]


def _standin(mode: str) -> tuple[str, ...]:
    return tuple(helper_cmd("launch_standin", mode))


def _files(workdir) -> dict[str, bytes]:
    return {str(f.relative_to(workdir)): f.read_bytes() for f in workdir.rglob("*") if f.is_file()}


def _wait_for(path, text: str, running: threading.Thread, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text()):
        said = path.read_text() if path.exists() else "nothing"
        assert running.is_alive(), f"the run ended; {path} said {said}"
        assert time.monotonic() < deadline, f"{path} never said {text!r}: {said}"
        time.sleep(0.05)


def test_a_second_launcher_on_a_running_run_is_refused_and_writes_nothing(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])  # support.launch_standin
    wd = tmp_path / "run"
    argv = ["--trainer_processes=1", "--engine_replicas=1", "--devices_per_process=0"]
    argv += [f"--workdir={wd}", "--gin_param=x"]
    rc: list[int] = []
    with _launcher(*argv, program=_standin("serve")) as first:
        thread = threading.Thread(target=lambda: rc.append(first.run()))
        thread.start()
        try:
            # Trainer process 0 adopted the launcher's claim, and a fresh claim was refused
            # beside it: one lock, held from the launch on (support.launch_standin).
            logs = wd / "logs"
            _wait_for(logs / "process_0_trainer.log", "ADOPTED: a fresh claim is refused", thread)
            _wait_for(logs / "process_1_engine.log", "serving", thread)
            before = _files(wd)
            assert launch_local.main(argv) == 2
            err = capsys.readouterr().err
            assert f"workdir {wd} is in use by another run: pid {os.getpid()}" in err
            # The first run's key, logs and lock record as they were; no file added.
            assert _files(wd) == before
        finally:
            (wd / "go").write_text("")
            thread.join(60)
    assert rc == [0]


def test_a_replica_failing_twice_the_same_way_stops_the_run_with_its_error(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    wd = tmp_path / "run"
    argv = ["--trainer_processes=1", "--engine_replicas=1", "--devices_per_process=0"]
    argv += [f"--workdir={wd}", "--gin_param=x"]
    with _launcher(*argv, program=_standin("same")) as launcher:
        assert launcher.run() == 2
    out = capsys.readouterr().out
    log = wd / "logs" / "process_1_engine.log"
    assert (
        "engine replica 0 exited with 2 twice in a row, the same way: "
        "error: Engine.slots must be >= 1, got 0\n"
    ) in out
    assert f"its log: {log}; stopping the run" in out
    assert log.read_text().count("replica 1 starting") == 2  # not the 11 starts of before


def test_a_replica_failing_differently_each_time_is_restarted_until_the_limit(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    wd = tmp_path / "run"
    argv = ["--trainer_processes=1", "--engine_replicas=1", "--devices_per_process=0"]
    argv += ["--max_restarts=2", f"--workdir={wd}", "--gin_param=x"]
    with _launcher(*argv, program=_standin("differs")) as launcher:
        assert launcher.run() == 1
    out = capsys.readouterr().out
    assert "engine replica 0 exited with 2 after 2 restarts (--max_restarts" in out
    assert "twice in a row" not in out
    assert (wd / "logs" / "process_1_engine.log").read_text().count("replica 1 starting") == 3


def test_a_replica_that_exits_0_was_drained_and_is_not_restarted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    wd = tmp_path / "run"
    argv = ["--trainer_processes=1", "--engine_replicas=1", "--devices_per_process=0"]
    argv += [f"--workdir={wd}", "--gin_param=x"]
    rc: list[int] = []
    with _launcher(*argv, program=_standin("drained")) as launcher:
        thread = threading.Thread(target=lambda: rc.append(launcher.run()))
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while "not restarted" not in capsys.readouterr().out:
                assert thread.is_alive() and time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(1.0)  # a few supervision rounds: a restart would start it again
        finally:
            (wd / "go").write_text("")
            thread.join(60)
    assert rc == [0] and launcher.restarts == 0
    assert (wd / "logs" / "process_1_engine.log").read_text().count("replica 1 starting") == 1


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o620, 0o604], ids=lambda m: f"{m:04o}")
def test_every_command_refuses_a_key_file_others_may_read_or_write(mode, tmp_path, capsys):
    key = tmp_path / "engine.key"
    key.write_text("s3cr3t")
    key.chmod(mode)
    wd = tmp_path / "run"
    wanted = f"--api_key_file={str(key)!r} has mode {mode:04o}"
    fix = f"only its owner may: chmod 600 {key}"
    # Each command is also given a bad value it checks after the key, so that without the key's
    # check it fails fast instead of starting a run or a server.
    replica_flags = ["--engine_addresses=http://127.0.0.1:1", "--weight_source=127.0.0.1:2"]
    bad_model = "--gin_param=Model.name = '/no/such/model_dir'"
    train_argv = [f"--workdir={wd}", "--gin_param=Processes.engine_replicas = 1", bad_model]
    assert train.main([*train_argv, "--process_index=0", *replica_flags, f"--api_key_file={key}"])
    assert serve.main([f"--api_key_file={key}", "--checkpoint=/no/such/checkpoint"]) == 2
    assert launch_local.main([f"--workdir={wd}", "--gin_param=x", "--api_key_file", str(key)])
    err = capsys.readouterr().err
    assert err.count(wanted) == 3 and err.count(fix) == 3, err
    assert not wd.exists()  # refused before the workdir was claimed or written
    key.chmod(0o600)
    assert read_api_key(str(key)) == "s3cr3t"


def test_the_launcher_keeps_its_logs_on_this_machine(capsys):
    assert launch_local.main(["--workdir=gs://bucket/run", "--gin_param=x"]) == 2
    assert "--workdir='gs://bucket/run': jaxrl-launch-local starts every process on this" in (
        capsys.readouterr().err
    )


def test_free_ports_are_distinct():
    ports = launch_local.free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--process_index=0", "--engine_addresses=http://127.0.0.1:1"],
            r"--engine_addresses names 1 replicas.*engine_replicas=2",
        ),
        ([], r"give each its --process_index"),
        (["--process_index=7", "--engine_addresses=a:1,b:2"], r"--process_index=7 is outside"),
        (
            ["--process_index=0", "--engine_addresses=127.0.0.1:1,http://127.0.0.1:2"],
            r"'127.0.0.1:1' has no scheme.*try 'http://127.0.0.1:1'",
        ),
        (
            ["--process_index=0", "--engine_addresses=http://127.0.0.1:1,http://127.0.0.1:2"],
            r"--weight_source=HOST:PORT is missing",
        ),
        (
            [
                "--process_index=0",
                "--engine_addresses=http://127.0.0.1:1,http://127.0.0.1:2",
                "--weight_source=127.0.0.1",
            ],
            r"--weight_source='127.0.0.1' is not HOST:PORT",
        ),
    ],
)
def test_train_refuses_a_bad_process_layout(flags, match, capsys, tmp_path):
    argv = [f"--workdir={tmp_path}", "--gin_param=Processes.engine_replicas = 2", *flags]
    assert train.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("changed", "match"),
    [
        ({"process_index": "2"}, r"--join serves a replica the run numbers itself: drop --proc"),
        (
            {"engine_addresses": "http://127.0.0.1:1"},
            r"--join serves a replica the run numbers itself: drop --engine_addresses",
        ),
        ({"weight_source": None}, r"--join needs --weight_source=HOST:PORT"),
        ({"join": "127.0.0.1:5"}, r"--join: '127.0.0.1:5' has no scheme"),
        ({"api_key_file": None}, r"--join needs --api_key_file: the run admits only replicas"),
    ],
)
def test_train_refuses_a_bad_join(changed, match, capsys, tmp_path):
    key = tmp_path / "key"
    key.write_text("s3cr3t")
    key.chmod(0o600)
    flags = {"join": "http://127.0.0.1:5", "weight_source": "127.0.0.1:3", "api_key_file": key}
    flags |= changed  # None: left out
    argv = [f"--workdir={tmp_path}", "--gin_param=Processes.engine_replicas = 2"]
    argv += [f"--{k}={v}" for k, v in flags.items() if v is not None]
    assert train.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_train_refuses_an_unreadable_or_empty_api_key_file(capsys, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("  \n")
    empty.chmod(0o600)
    flags = [
        "--process_index=0",
        "--engine_addresses=http://127.0.0.1:1,http://127.0.0.1:2",
        "--weight_source=127.0.0.1:3",
    ]
    argv = [f"--workdir={tmp_path}", "--gin_param=Processes.engine_replicas = 2", *flags]
    assert train.main([*argv, f"--api_key_file={empty}"]) == 2
    assert f"--api_key_file={str(empty)!r} is empty" in capsys.readouterr().err
    assert train.main([*argv, f"--api_key_file={tmp_path / 'none'}"]) == 2
    assert "cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("10.0.0.1:8000", r"'10.0.0.1:8000' has no scheme.*try 'http://10.0.0.1:8000'"),
        ("https://10.0.0.1:8000", r"uses 'https'.*replicas serve plain HTTP"),
        ("http://10.0.0.1", r"names no host and port"),
        ("http://10.0.0.1:99999", r"names no host and port in 1..65535"),
        ("http://10.0.0.1:8000/v1", r"has more than a host and port"),
    ],
)
def test_replica_urls_refuse_what_is_not_http_host_port(url, match):
    with pytest.raises(ValueError, match=match):
        replica_urls(f"http://127.0.0.1:1,{url}")


def test_addresses_parse_hosts_ports_and_ipv6():
    assert replica_urls("http://a:1/, http://[::1]:2") == ("http://a:1", "http://[::1]:2")
    assert bind_of("http://[::1]:2") == ("::1", 2) and bind_of("http://a:1") == ("a", 1)
    assert host_port("10.1.2.3:8470") == ("10.1.2.3", 8470) and host_port("[::1]:5") == ("::1", 5)
    with pytest.raises(ValueError, match=r"--weight_source='http://a:1' is not HOST:PORT"):
        host_port("http://a:1")


def test_a_replica_beyond_loopback_needs_an_api_key():
    role = Role("engine", 3, 2, 2)  # replica 1
    urls = ("http://127.0.0.1:9000", "http://10.0.0.7:9000")
    with pytest.raises(ValueError, match=r"refusing to bind '10.0.0.7' without an API key"):
        check_bind(Replicas(urls, "10.0.0.2:8470"), role)
    check_bind(Replicas(urls, "10.0.0.2:8470", api_key="s3cr3t"), role)
    check_bind(Replicas(urls, "10.0.0.2:8470"), Role("engine", 2, 2, 2))  # replica 0: loopback
    assert "s3cr3t" not in repr(Replicas(urls, "10.0.0.2:8470", api_key="s3cr3t"))  # never logged


def test_the_trainers_weight_server_beyond_loopback_needs_an_api_key():
    leader, peer = Role("trainer", 0, 2, 2), Role("trainer", 1, 2, 2)
    urls = ("http://127.0.0.1:9000",)
    with pytest.raises(ValueError, match=r"refusing to bind '10.0.0.2' without an API key"):
        check_bind(Replicas(urls, "10.0.0.2:8470"), leader)
    check_bind(Replicas(urls, "10.0.0.2:8470", api_key="s3cr3t"), leader)
    check_bind(Replicas(urls, "127.0.0.1:8470"), leader)
    check_bind(Replicas(urls, "10.0.0.2:8470"), peer)  # a peer serves nothing
