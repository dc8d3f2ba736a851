"""The policy being trained, served over HTTP while it trains (``Engine.serve_port``).

What it owns: ``serve_live_policy(cfg, engine, driver, tokenizer)``: an ``EngineHost`` around the
RL stage's own running driver (not a copy: the server sees every weight swap the moment the
engine does, and each response's per-token ``policy_versions`` name the version that produced
it), served on loopback in a thread of its own so the orchestrator's event loop never waits on
a client. Eval harnesses and agent frameworks then query the live policy with vLLM's or OpenAI's
protocol; their requests share the engine's slots with the rollouts.

Never: takes weight updates (the trainer's weight path owns them) or binds beyond loopback.
"""

from __future__ import annotations

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.models.tokenizer import Tokenizer
from jaxrl_orch.orchestrator.metrics.writers import stage
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer


def serve_live_policy(
    cfg: TrainConfig, engine: JetStreamEngine, driver: InferenceDriver, tokenizer: Tokenizer
) -> HttpServer | None:
    """The started server, or None when ``Engine.serve_port`` is unset."""
    if cfg.engine.serve_port is None:
        return None
    host = EngineHost(engine, model=cfg.model.name, tokenizer=tokenizer, driver=driver)
    server = HttpServer(make_app(host), host="127.0.0.1", port=cfg.engine.serve_port)
    server.start_in_thread()
    stage("serve", f"the policy being trained at {server.url} (model {cfg.model.name!r})")
    return server
