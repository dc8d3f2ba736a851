"""Engine replica processes for the tests of ``tests/distributed`` (its conftest's fixtures).

Two loopback addresses stand for two hosts: the test process is the trainer's (``TRAINER_HOST``,
where its ``WeightOffer`` listens), each replica another's (``REPLICA_HOST``).
``start_replica`` runs ``support.replica_main`` there and waits for its ``READY`` line;
``reference_run`` decodes on an in-process driver, the reference a replica must match.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading

from jaxrl_orch.inference.driver import InferenceDriver
from support.checkout import helper_cmd, subprocess_env, xla_flags

TRAINER_HOST, REPLICA_HOST = "127.0.0.2", "127.0.0.3"


def start_replica(compile_cache: dict, offer, *flags: str):
    """A replica process pulling from ``offer``: ``(url, process, its stdout lines)``."""
    env = subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2), **compile_cache)
    cmd = helper_cmd(
        "replica_main", "--host", REPLICA_HOST, "--weight-source", offer.address, *flags
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    address = None
    while address is None and proc.poll() is None:  # it prints READY once bound, or exits
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line.startswith("READY "):
            address = line.split()[1]
    assert address, f"replica did not come up (exit code {proc.poll()})"
    return address, proc, lines


def stop_replica(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def reference_run(engine, params, version, prompts, sampling):
    """``prompts`` decoded by an in-process driver of ``engine`` on ``params``."""
    driver = InferenceDriver(engine, params, version)
    driver.start()
    try:
        return [driver.submit(p, sampling)[0].result(timeout=60) for p in prompts]
    finally:
        driver.stop()
