"""A tiny chat engine served over HTTP on loopback, for the OpenAI-client tests.

``tiny_chat_host(directory)`` writes a Qwen-style tokenizer directory (its jinja chat template,
eos ``<|im_end|>``: ``support.chat_checkpoints``), loads it as the project does
(``models.tokenizer.load_tokenizer``) and builds a small ``DecodeEngine`` whose vocabulary is
exactly the tokenizer's (every id it samples decodes), with params from a fixed seed (scaled so
its greedy text is not one repeated token), behind an ``EngineHost``. ``serve(host)``: the app
``make_app`` builds, served by ``HttpServer`` on a free loopback port in a thread of its own,
stopped on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import jax

from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from support.chat_checkpoints import tiny_chat_config, write_qwen_tokenizer

MODEL = "tiny-qwen"
LIMITS = EngineLimits(
    max_concurrent_decodes=2, max_target_length=128, max_prefill_length=96, steps_per_call=4
)


def tiny_chat_host(directory: Path, *, seed: int = 0) -> EngineHost:
    tokenizer = load_tokenizer(write_qwen_tokenizer(directory))
    cfg = tiny_chat_config(tokenizer.vocab_size)
    engine = DecodeEngine(cfg, limits=LIMITS, decode_widths=(2,))  # one generate program
    # A random model this small greedily repeats one token forever; scaled up, its greedy text
    # changes token to token (broken UTF-8 and special ids included): what the text paths and
    # the comparisons with the engine need.
    params = jax.tree.map(lambda x: x * 4, engine.load_params(seed=seed))
    return EngineHost(engine, model=MODEL, tokenizer=tokenizer, params=params)


@contextlib.contextmanager
def serve(host: EngineHost, api_key: str | None = None) -> Iterator[str]:
    """The server's base URL while the context is open."""
    server = HttpServer(make_app(host, api_key=api_key), api_key=api_key).start_in_thread()
    try:
        yield server.url
    finally:
        server.stop()
