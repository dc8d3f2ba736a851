"""``jaxrl-launch-local`` and the train command's process flags: bad input is
refused before anything starts, naming the bad value (the runs are in test_multiprocess_e2e)."""

from __future__ import annotations

import re
import stat

import pytest

from jaxrl_orch import train
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


def test_launcher_passes_the_layout_and_addresses_to_every_process(tmp_path):
    args, rest = launch_local.parse_args(
        ["--trainer_processes=2", "--engine_replicas=3", f"--workdir={tmp_path}", "--gin_param=x"]
    )
    launcher = launch_local.Launcher(args, rest)
    assert rest == ["--gin_param=x"]
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
        args, rest = launch_local.parse_args(
            ["--engine_replicas=1", f"--workdir={tmp_path}", "--gin_param=x", *extra]
        )
        return launch_local.Launcher(args, rest)

    key_file = tmp_path / "logs" / "engine.key"
    first = launch()
    assert f"--api_key_file={key_file}" in first.train_args
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = read_api_key(str(key_file))
    assert len(key) >= 32
    launch()
    assert read_api_key(str(key_file)) != key  # a new secret per launch
    own = tmp_path / "mine.key"
    own.write_text("the-user-key")
    kept = launch(f"--api_key_file={own}")
    assert [a for a in kept.train_args if "api_key_file" in a] == [f"--api_key_file={own}"]


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


def test_train_refuses_an_unreadable_or_empty_api_key_file(capsys, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("  \n")
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
