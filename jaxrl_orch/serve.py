"""``python -m jaxrl_orch.serve``: a config's model behind the engine's HTTP contract.

    python -m jaxrl_orch.serve --gin_file=configs/reverse_text.gin \\
        [--checkpoint=runs/reverse_text] [--host=127.0.0.1] [--port=8000] [--api_key_file=F]
        [--tool_call_parser=hermes]

What it owns: reading the gin config (the same ``TrainConfig`` the train command reads: model,
tokenizer, engine settings), the weights to serve, and the server's life. It prints
``serving http://HOST:PORT`` once the server answers, then serves until SIGTERM / Ctrl-C.

Weights (``--checkpoint``):
- none: a fresh init of the config's model (``TrainConfig.seed``), for trying the surface out;
- an HF checkpoint directory (``config.json`` + safetensors, e.g. a run's ``export/``), local
  or ``gs://``: its weights, read shard by shard onto the engine's mesh, and its tokenizer when
  it holds one;
- a train command's workdir: its ``export/`` when the run finished, else its newest RL
  checkpoint (or its warm-up's), restored as the train command restores it.
``--weight_source=HOST:PORT`` lets a weight update (``serving.contract.UPDATE_WEIGHTS``) pull
offers from that weight server (the trainer's), with the config's ``Processes.weight_transport``
and the ``--api_key_file`` key; without it the server refuses updates. A request never names
where to pull from.

Tool calls: ``--tool_call_parser`` names how chat replies' tool calls are parsed (``hermes``,
``llama3_json``; vLLM's names); without it, the format the checkpoint's chat template writes
its tool calls in, and a server whose template shows none refuses requests with tools.

Safety: loopback by default; any other ``--host`` refuses to start without ``--api_key_file``
(a file holding the key, so it stays out of the process list and shell history; one its group
or others may read or write is refused, naming its mode and the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import jax

from jaxrl_orch.compose.engines import build_engine, to_engine
from jaxrl_orch.compose.model import build_model, pretrained_params
from jaxrl_orch.compose.parts import build_run
from jaxrl_orch.compose.placement import build_placement
from jaxrl_orch.compose.trainers import build_trainer
from jaxrl_orch.config.load import load_config
from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.distributed.addresses import read_api_key
from jaxrl_orch.distributed.group import Role
from jaxrl_orch.distributed.replica import serve_until_signal
from jaxrl_orch.distributed.source import TransferSource
from jaxrl_orch.paths import as_path
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.guard import Limits
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.serving.tool_parsers import TOOL_PARSERS, get_tool_parser
from jaxrl_orch.trainer.checkpoint import Checkpointer, restore_trainer

_SUMMARY = "Serve a config's model behind vLLM's RL API and OpenAI's, over HTTP."
ONE_PROCESS = Role("single", 0, 1, 0)  # the engine, and for a workdir its trainer, here


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    p.add_argument(
        "--gin_param", action="append", default=[], help="a binding, e.g. 'Engine.slots=8'"
    )
    p.add_argument("--checkpoint", default=None, help="an HF checkpoint directory or a workdir")
    p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs a key)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--api_key_file", default=None, help="a file holding the Bearer key")
    p.add_argument("--weight_source", default=None, help="HOST:PORT of the trainer's offers")
    p.add_argument("--served_model_name", default=None, help="the model id clients name")
    p.add_argument(
        "--tool_call_parser",
        default=None,
        help=f"how chat replies' tool calls are parsed: {', '.join(sorted(TOOL_PARSERS))} "
        "(default: the format the checkpoint's chat template writes, if it shows one)",
    )
    return p.parse_args(argv)


def checkpoint_bindings(checkpoint: str | None) -> list[str]:
    """Bindings that point the config at an HF checkpoint (a directory or a workdir's export)."""
    if checkpoint is None:
        return []
    path = as_path(checkpoint)  # a local directory or gs://, as a run's workdir and export are
    hf = path if (path / "config.json").is_file() else path / "export"
    if not (hf / "config.json").is_file():
        if not path.is_dir():
            raise ValueError(
                f"--checkpoint {checkpoint!r} does not exist; name an HF checkpoint directory "
                "(config.json + safetensors) or a train command's workdir"
            )
        return []  # a workdir without an export: its orbax checkpoints (``workdir_params``)
    out = [f"Model.name = '{hf}'"]
    return out + ([f"Model.tokenizer = '{hf}'"] if (hf / "tokenizer.json").is_file() else [])


def workdir_params(cfg: TrainConfig, workdir: str) -> Any:
    """The newest RL checkpoint of a workdir (else its warm-up's), restored like a resume."""
    parts = build_run(cfg, workdir, ONE_PROCESS)
    trainer = build_trainer(parts, "rl", cfg.rl.learning_rate)
    for sub in ("checkpoints", "sft"):
        ckpt = Checkpointer(parts.workdir / sub, max_to_keep=1)
        try:
            if ckpt.latest_step() is not None:
                restore_trainer(ckpt, trainer)
                return trainer.params
        finally:
            ckpt.close()
    raise ValueError(f"workdir {workdir!r} has no export/, checkpoints/ or sft/ to serve")


def build_host(args: argparse.Namespace, api_key: str | None) -> tuple[EngineHost, Limits]:
    """The served host, and its limits: the longest pull a weight update may ask for is the
    config's (``Processes.max_pull_s``), as on a run's replicas."""
    cfg = load_config(args.gin_file, args.gin_param + checkpoint_bindings(args.checkpoint))
    tokenizer, model_cfg = build_model(cfg)
    decode_mesh = build_placement(cfg, len(jax.devices())).decode_mesh
    engine = build_engine(cfg, model_cfg, decode_mesh, tokenizer).engine
    if args.checkpoint and not checkpoint_bindings(args.checkpoint):
        params = to_engine(workdir_params(cfg, args.checkpoint), engine)
    elif (pretrained := pretrained_params(cfg.model.name)) is not None:
        params = to_engine(pretrained, engine)
    else:
        params = engine.load_params(seed=cfg.seed)
    source = None
    if args.weight_source:  # the run's transport and key; 'jax' binds this server's address
        how = {"transport": cfg.processes.weight_transport, "api_key": api_key}
        source = TransferSource(engine, args.weight_source, host=args.host, **how)
    host = EngineHost(
        engine,
        model=args.served_model_name or cfg.model.name,
        tokenizer=tokenizer,
        params=params,
        source=source,
        warm_up=cfg.engine.warmup,
    )
    return host, Limits(max_pull_s=cfg.processes.max_pull_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        key = read_api_key(args.api_key_file)
        HttpServer.check_bind(args.host, key)  # before minutes of building, not after
        if args.tool_call_parser is not None:
            get_tool_parser(args.tool_call_parser)  # an unknown name, before building too
        host, limits = build_host(args, key)
    except (ValueError, OSError) as exc:  # a bad flag, config or checkpoint: one line, exit 2
        print(f"jaxrl_orch.serve: {exc}", file=sys.stderr)
        return 2
    app = make_app(host, api_key=key, limits=limits, tool_parser=args.tool_call_parser)
    server = HttpServer(app, host=args.host, port=args.port, api_key=key)
    # The replicas' own loop: serve until SIGTERM / Ctrl-C, then stop the server and the driver.
    asyncio.run(
        serve_until_signal(host, server, on_up=lambda url: print(f"serving {url}", flush=True))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
