"""A replica's HTTP server in this process around a stand-in engine and driver (no JAX).

``StandInEngine`` has the limits ``EngineHost`` reads; ``HeldDriver`` keeps every submitted
future for the test to resolve or watch (``answer`` set: it answers each at once with a
completion of that one token, stamped with its version). ``serve(host, api_key)`` serves an
``EngineHost`` with ``make_app`` + ``HttpServer`` from a thread (``grace_s`` 0.2, so a stop cuts
requests off quickly); the caller stops it. ``FakeOffer`` stands in for the trainer's weight
offer when the replicas are stand-ins: they "pull" any offer at once, so an offer is a new uuid.
"""

from __future__ import annotations

import concurrent.futures
import types

from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.types import Completion


class FakeOffer:
    def __init__(self) -> None:
        self.offers = 0
        self.offered: list = []  # what was offered, in order

    def offer(self, arrays, *, expire_s=None):
        self.offers += 1
        self.offered.append(arrays)
        return self.offers


class StandInEngine:
    max_concurrent_decodes = 2
    max_prefill_length = 16
    max_target_length = 256
    config = types.SimpleNamespace(vocab_size=256)


class HeldDriver:
    paused = False

    def __init__(self, version: int = 5, answer: int | None = None) -> None:
        self.version, self.answer = version, answer
        self.futures: list[concurrent.futures.Future] = []
        self.samplings: list = []

    def submit(self, prompt_ids, samplings, on_token=None):
        self.samplings.extend(samplings)
        new = [concurrent.futures.Future() for _ in samplings]
        if self.answer is not None:
            for f in new:
                f.set_result(Completion([self.answer], [-1.0], [self.version], "length"))
        self.futures.extend(new)
        return new

    def gauges(self):
        return {"inference/queue_depth": 0.0}


def serve(host: EngineHost, api_key: str | None = None) -> HttpServer:
    app = make_app(host, api_key=api_key)
    return HttpServer(app, port=0, api_key=api_key, grace_s=0.2).start_in_thread()
