"""Replica fixtures of the multi-process tests (processes: ``support.replica_procs``)."""

from __future__ import annotations

import pytest
from support.replica_main import make_engine
from support.replica_procs import TRAINER_HOST, start_replica, stop_replica

from jaxrl_orch.distributed.offer_server import HttpWeightOffer


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Compiled programs the replicas share: each fresh one compiles only what none before did."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("replica_programs")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture
def replica(compile_cache, offer):
    """A fresh replica, holding no weights, pulling from ``offer``: ``(url, process)``."""
    address, proc, _ = start_replica(compile_cache, offer, "--max-queued", "3")
    yield address, proc
    stop_replica(proc)


@pytest.fixture
def bounded_replica(compile_cache, offer):
    """A fresh replica whose weight updates may pull for at most 1 + 1 s (its Processes
    section's ``max_pull_s``): ``(url, process)``."""
    bound = ("--weight-pull-timeout-s", "1", "--weight-load-extra-s", "1")
    address, proc, _ = start_replica(compile_cache, offer, *bound)
    yield address, proc
    stop_replica(proc)


@pytest.fixture
def lora_replica(compile_cache, offer):
    """A fresh replica of a rank-4 LoRA run: ``(url, process, its stdout lines)``."""
    started = start_replica(compile_cache, offer, "--lora-rank", "4")
    yield started
    stop_replica(started[1])


@pytest.fixture(scope="module")
def reference():
    engine = make_engine()  # the replica's engine, here on this process's first 2 devices
    return engine, {v: engine.load_params(seed=v) for v in (1, 2)}


@pytest.fixture(scope="module")
def offer():
    # The trainer's host as another machine would see it: an address of its own, not the
    # replica's loopback default, which a replica on another host would dial instead.
    sender = HttpWeightOffer(host=TRAINER_HOST)
    yield sender
    sender.close()
