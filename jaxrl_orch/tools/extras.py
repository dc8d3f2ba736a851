"""``python -m jaxrl_orch.tools.extras``: the extras of ``pyproject.toml`` a config needs on a host.

    python -m jaxrl_orch.tools.extras --gin_file=configs/verifiers.gin [--gin_param=...]
        [--workdir=gs://BUCKET/run]

Prints them as one comma list (``tpu,verifiers``); ``tpu_scripts/setup.sh --gin-file`` installs
that list on every TPU VM worker. The config is read by ``config.load``, as the train command
reads it (a bad file or binding is refused the same way, exit 2), and nothing is built: no JAX,
no environment is imported, so a user's taskset need not be importable where this runs.

- ``tpu``, always: on a TPU VM it is the chips' runtime (libtpu);
- ``gcs`` when the workdir or any setting is a ``gs://`` URL (``Model.name``,
  ``Warmup.from_workdir``, ...): every path goes through epath, whose gs:// backend it is;
- ``verifiers`` when ``Data.env = 'verifiers'``;
- ``wandb`` when ``Outputs.wandb_project`` is set;
- ``evals`` when ``HarnessEval.tasks`` names tasks (lm-evaluation-harness).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

from jaxrl_orch.config.load import load_config
from jaxrl_orch.config.train import TrainConfig


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a config value: sections, their fields, dicts (a verifiers env's
    config), lists and tuples."""
    if isinstance(value, str):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _strings(getattr(value, field.name))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def needed_extras(cfg: TrainConfig, workdir: str = "") -> list[str]:
    """The extras ``cfg`` (run into ``workdir``) needs, in a fixed order."""
    extras = ["tpu"]
    if any(s.startswith("gs://") for s in (workdir, *_strings(cfg))):
        extras.append("gcs")
    if cfg.data.env == "verifiers":
        extras.append("verifiers")
    if cfg.outputs.wandb_project:
        extras.append("wandb")
    if cfg.harness_eval.tasks:
        extras.append("evals")
    return extras


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxrl_orch.tools.extras",
        description="Print the pyproject extras (comma list) a training config needs on a host.",
    )
    p.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
    p.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
    p.add_argument("--workdir", default="", help="the run's workdir (gs:// needs gcs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.gin_file or args.gin_param):
        print("error: give the run's config: --gin_file FILE (repeatable)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.gin_file, args.gin_param)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(",".join(needed_extras(cfg, args.workdir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
