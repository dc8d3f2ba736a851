"""The policy being trained, served over HTTP while it trains (``Engine.serve_port``).

What it owns: ``serve_live_policy(cfg, engine, driver, tokenizer)``: an ``EngineHost`` around the
RL stage's own running driver (not a copy: the server sees every weight swap the moment the
engine does, and each response's per-token ``policy_versions`` name the version that produced
it), served on loopback in a thread of its own so the orchestrator's event loop never waits on
a client. Eval harnesses and agent frameworks then query the live policy with vLLM's or OpenAI's
protocol; their requests share the engine's slots with the rollouts. The ``LivePolicy`` it
returns is what the engine side reads of the server: ``held()``, what a caller's pause holds
the engine with (for a stall error), and ``gauges()``.

The engine's state belongs to the run: the control routes (``serving.guard.CONTROL``: pause,
resume, weight updates) are refused to every caller (403 naming ``Engine.serve_control``)
unless ``Engine.serve_control`` hands them out. A pause a caller then makes is never silent
(``LiveHost``): one console line when it is asked for and one at the resume, the gauges
``serve/paused_by_caller`` (1 while it holds the engine) and ``serve/caller_pauses_total``, and
``held()`` names the caller, so a run that stalls behind it says so.

Never: takes weight updates (the trainer's weight path owns them) or binds beyond loopback.
"""

from __future__ import annotations

import time

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.models.tokenizer import Tokenizer
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer

CONTROL_SETTING = "Engine.serve_control"


class LiveHost(EngineHost):
    """The stage's driver as the live server sees it; reports a caller's pause and resume."""

    def __init__(
        self, engine: JetStreamEngine, *, model: str, tokenizer: Tokenizer, driver: InferenceDriver
    ) -> None:
        super().__init__(engine, model=model, tokenizer=tokenizer, driver=driver)
        self.paused_by: str | None = None  # the caller whose pause holds the engine now
        self.pause_mode: str | None = None
        self.paused_at = 0.0
        self.caller_pauses = 0

    def controlled(self, action: str, mode: str | None, caller: str | None) -> None:
        who = caller or "an unnamed client"
        if action == "pause":
            self.paused_by = who
            self.pause_mode = mode
            self.paused_at = time.monotonic()
            self.caller_pauses += 1
            stage(
                "serve",
                f"!! the engine is paused (mode {mode}) by POST /pause from {who}: no rollout "
                "decodes until POST /resume",
            )
        elif self.paused_by is not None:
            held_s = time.monotonic() - self.paused_at
            stage(
                "serve",
                f"the engine resumed (POST /resume from {who}) after {held_s:.1f} s paused "
                f"by {self.paused_by}",
            )
            self.paused_by = None
            self.pause_mode = None

    def held(self) -> str | None:
        if self.paused_by is None:
            return None
        held_s = time.monotonic() - self.paused_at
        return (
            f"the engine is paused (by POST /pause from {self.paused_by}) with mode "
            f"{self.pause_mode} for {held_s:.0f}s; nothing decodes until POST /resume"
        )

    def live_gauges(self) -> dict[str, float]:
        return {
            "serve/paused_by_caller": float(self.paused_by is not None),
            "serve/caller_pauses_total": float(self.caller_pauses),
        }


class LivePolicy:
    """The started server and its host: what the engine side stops, reads and reports."""

    def __init__(self, server: HttpServer, host: LiveHost) -> None:
        self.server = server
        self.host = host

    @property
    def url(self) -> str:
        return self.server.url

    def held(self) -> str | None:
        """What a caller's pause holds the engine with, or None."""
        return self.host.held()

    def gauges(self) -> dict[str, float]:
        return self.host.live_gauges()

    def stop(self) -> None:
        self.server.stop()


def serve_live_policy(
    cfg: TrainConfig, engine: JetStreamEngine, driver: InferenceDriver, tokenizer: Tokenizer
) -> LivePolicy | None:
    """The started ``LivePolicy``, or None when ``Engine.serve_port`` is unset."""
    if cfg.engine.serve_port is None:
        return None
    # Imported when the port is asked for: a run without one does not load FastAPI.
    from jaxrl_orch.serving.app import make_app

    host = LiveHost(engine, model=cfg.model.name, tokenizer=tokenizer, driver=driver)
    withheld = None if cfg.engine.serve_control else CONTROL_SETTING
    app = make_app(host, withhold_control=withheld)
    server = HttpServer(app, host="127.0.0.1", port=cfg.engine.serve_port)
    server.start_in_thread()
    control = "handed out" if cfg.engine.serve_control else f"refused ({CONTROL_SETTING})"
    detail = f"the policy being trained at {server.url} (model {cfg.model.name!r})"
    stage("serve", f"{detail}; control routes {control}")
    return LivePolicy(server, host)
