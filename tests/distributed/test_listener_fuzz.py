"""Nothing outside the run can stop it: every listener of a live multi-process run, fuzzed.

A trainer group of 2 processes and 1 engine replica (``jaxrl-launch-local``) train the tiny
scenario. Once the first step is trained, the test finds every socket the run's processes
listen on (psutil: the replica's HTTP API, trainer process 0's weight server, the group's
``jax.distributed`` coordinator and its collectives' ports, whatever else) and sends each, in a
seeded order, bounded in count and time, over loopback only: random bytes, a frame of declared
size 2**32 then zeros (the bytes that abort a ``jax.experimental.transfer`` server), an HTTP
request line with a random JSON body to a random path, an unauthenticated weight update, and a
connection opened and left silent. Then the run must complete on its own: exit 0, every RL
step's row once, no process of the run lost.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support.checkout import subprocess_env

pytestmark = pytest.mark.slow

STEPS = 20  # enough that the run is still training when the fuzzing ends
SCENARIO = [
    "Warmup.steps = 2",
    "Warmup.batch_size = 8",
    "RL.prompts_per_step = 2",
    "RL.group_size = 4",
    "RL.eval_examples = 4",
    "RL.eval_every = 4",
    "Outputs.checkpoint_every = 4",
    "RL.max_new_tokens = 16",
    "Engine.slots = 8",
    "RL.dynamic_sampling = False",
    "Outputs.export_hf = False",
    f"RL.steps = {STEPS}",
    "Data.env = 'support.dense_env:make'",
]
SEED = 1234
ROUNDS = 3  # payloads per listener per kind
FUZZ_BUDGET_S = 60.0


def _launch(workdir: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "jaxrl_orch.distributed.launch_local",
        "--trainer_processes=2",
        "--engine_replicas=1",
        "--devices_per_process=2",
        f"--workdir={workdir}",
        *[f"--gin_param={p}" for p in SCENARIO],
    ]
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _trained_steps(workdir: Path) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["step"] for r in rows if "train/reward_mean" in r]


def _loopback(host: str) -> str:
    """The loopback address to dial for a listener bound to ``host``; a listener bound beyond
    loopback (an interface, or every one) fails the test: nothing here is meant to be."""
    ip = ipaddress.ip_address(host)
    ip = getattr(ip, "ipv4_mapped", None) or ip  # a dual-stack socket bound to 127.0.0.1
    assert ip.is_loopback, f"a listener of the run binds {host}, beyond loopback"
    return str(ip)


def _listeners(launcher: subprocess.Popen) -> list[tuple[int, str, int]]:
    """``(pid, loopback host, port)`` of every listening socket of the run's processes."""
    found = []
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.append((proc.pid, _loopback(c.laddr.ip), c.laddr.port))
        except psutil.Error:
            continue
    return sorted(found)


def _payloads(rng: random.Random) -> list[bytes]:
    """One round of hostile inputs."""
    body = json.dumps(
        {rng.choice(["version", "uuid", "timeout_s", "token_ids", "x"]): rng.random() * 1e12}
    ).encode()
    path = rng.choice(["/update_weights", "/pause", "/inference/v1/generate", "/offers/7", "/"])
    http = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    return [
        rng.randbytes(rng.randint(1, 4096)),
        struct.pack("<Q", 2**32) + bytes(64),
        struct.pack(">Q", 2**63) + rng.randbytes(64),
        http,
        b"GET /" + rng.randbytes(64) + b" HTTP/1.1\r\n\r\n",
    ]


def _send(host: str, port: int, payload: bytes) -> None:
    # Refused or reset: the listener defends itself; what matters is the run.
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2) as s:
        s.sendall(payload)
        s.settimeout(0.2)
        s.recv(1024)


def _fuzz(listeners: list[tuple[int, str, int]], deadline: float) -> int:
    rng = random.Random(SEED)
    silent = []  # connections opened and left without a byte
    sent = 0
    for _ in range(ROUNDS):
        for _pid, host, port in rng.sample(listeners, len(listeners)):
            for payload in _payloads(rng):
                if time.monotonic() > deadline:
                    return sent
                _send(host, port, payload)
                sent += 1
            with contextlib.suppress(OSError):
                silent.append(socket.create_connection((host, port), timeout=2))
    for s in silent:
        s.close()
    return sent


def test_hostile_bytes_to_every_listener_do_not_stop_the_run(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    launcher = _launch(workdir)
    try:
        deadline = time.monotonic() + 600
        while not _trained_steps(workdir):
            assert launcher.poll() is None, launcher.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "no RL step trained within 600 s"
            time.sleep(1)
        processes = psutil.Process(launcher.pid).children(recursive=True)
        listeners = _listeners(launcher)
        assert len({pid for pid, _, _ in listeners}) >= 3, listeners  # every process listens
        sent = _fuzz(listeners, time.monotonic() + FUZZ_BUDGET_S)
        assert sent >= len(listeners), (sent, listeners)
        time.sleep(2)  # a process the bytes killed is gone by now
        gone = [p.pid for p in processes if not p.is_running() or p.status() == "zombie"]
        assert not gone, (gone, listeners)
        assert max(_trained_steps(workdir)) < STEPS  # the fuzzing hit a run still training
        out, _ = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-4000:]
    assert "restarting" not in out and "exited with" not in out, out[-4000:]
    steps = _trained_steps(workdir)
    assert steps == list(range(1, STEPS + 1)), steps  # every step once, in order
