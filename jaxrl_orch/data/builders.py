"""tensorflow-datasets builders for the bundled tasks, written as array_record, no TensorFlow.

What this module owns
- ``JaxrlReverseText`` (tfds name ``jaxrl_reverse_text``): one ``{"text"}`` record per corpus
  sentence (default: the bundled ``corpus/sentences.txt``, see ``sentences.py``).
- ``JaxrlArithmetic`` (``jaxrl_arithmetic``): ``{"question", "answer"}`` problems from the
  seeded generator in ``problems.py``. Configs ``easy`` (a+b, a-b), ``mixed`` (+-*), ``calc``
  (three operands up to 999: worth a calculator call).
- ``prepare(name, data_dir, config=None)``: build once into ``data_dir`` and return the
  builder; later calls find the prepared files and only read metadata.
- ``load_split(name, split, data_dir, config=None)``: random-access ``tfds`` data source.

Invariants
- Splits ``train`` and ``eval`` are cut from one pool of *distinct* items by a seeded
  permutation, so they are disjoint by construction (tests check it on the written files).
- Everything is written with ``file_format="array_record"`` and read back with tfds'
  ``ArrayRecordDataSource``; nothing here imports TensorFlow (tested in a fresh subprocess:
  ``tensorflow`` never enters ``sys.modules``). tfds only needs TF for ``tf.data`` pipelines,
  which this project does not use.
- Configs are dataclasses; a custom config (e.g. a tiny one in tests) gets its own directory
  ``data_dir/<name>/<config.name>/<version>``, so give distinct settings distinct names.

Drivers: the entry point / gin config calls ``prepare`` before the run; ``sources.py`` turns a
split into a checkpointable ``types.Source``. This module never shuffles for training: order
within a split is whatever tfds wrote, and the source owns the epoch shuffle.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from jaxrl_orch.data.problems import generate_problems
from jaxrl_orch.data.sentences import CORPUS_PATH, read_corpus

# tfds 4.9.10 resolves a builder's ``code_path`` through ``importlib_resources``, which it
# declares as a dependency only for Python < 3.9 yet imports unconditionally for builders that
# live in a package (upstream tensorflow/datasets#11212, fix PRs #11227/#11234 still open).
# Pinning ``code_path`` to this file is what tfds itself falls back to for non-package modules.
_CODE_PATH = epath.Path(__file__)
DEFAULT_DATA_DIR = Path.home() / ".cache" / "jaxrl_orch" / "tfds"
SPLITS = ("train", "eval")


def split_pool(items: Sequence[Any], num_eval: int, seed: int) -> tuple[list[Any], list[Any]]:
    """Seeded disjoint ``(train, eval)`` cut of a pool of distinct items."""
    if not 0 < num_eval < len(items):
        raise ValueError(
            f"num_eval must be in [1, {len(items) - 1}] for a pool of "
            f"{len(items)} items, got {num_eval!r}"
        )
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order[num_eval:]], [items[i] for i in order[:num_eval]]


@dataclasses.dataclass(eq=False)
class ReverseTextConfig(tfds.core.BuilderConfig):
    corpus: str = ""  # path to a one-sentence-per-line file; "" = the bundled corpus
    num_eval: int = 256
    max_train: int = 0  # 0 = every remaining sentence
    split_seed: int = 0


class JaxrlReverseText(tfds.core.GeneratorBasedBuilder):
    """Sentences to reverse (the reverse-text task), from a one-sentence-per-line corpus."""

    name = "jaxrl_reverse_text"
    code_path = _CODE_PATH
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Bundled 4000-sentence synthetic corpus."}
    BUILDER_CONFIGS = [ReverseTextConfig(name="default")]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Short synthetic sentences for the reverse-text task.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        cfg: ReverseTextConfig = self.builder_config
        sentences = list(dict.fromkeys(read_corpus(cfg.corpus or CORPUS_PATH)))
        train, eval_ = split_pool(sentences, cfg.num_eval, cfg.split_seed)
        if cfg.max_train:
            train = train[: cfg.max_train]
        return {
            "train": self._generate_examples([{"text": s} for s in train]),
            "eval": self._generate_examples([{"text": s} for s in eval_]),
        }

    def _generate_examples(self, items: Iterable[dict[str, Any]]):
        yield from enumerate(items)


@dataclasses.dataclass(eq=False)
class ArithmeticConfig(tfds.core.BuilderConfig):
    num_train: int = 8000
    num_eval: int = 500
    seed: int = 0
    max_operand: int = 99
    num_operands: int = 2
    ops: str = "+-*"


class JaxrlArithmetic(tfds.core.GeneratorBasedBuilder):
    """Integer arithmetic problems with exact answers (binary-reward task)."""

    name = "jaxrl_arithmetic"
    code_path = _CODE_PATH
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Seeded generator, disjoint train/eval."}
    BUILDER_CONFIGS = [
        ArithmeticConfig(name="easy", ops="+-"),
        ArithmeticConfig(name="mixed", num_train=12000, num_eval=1000),
        ArithmeticConfig(
            name="calc", num_train=20000, num_eval=1000, max_operand=999, num_operands=3
        ),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Seeded integer arithmetic problems; answer is the exact integer.",
            features=tfds.features.FeaturesDict(
                {"question": tfds.features.Text(), "answer": np.int64}
            ),
        )

    def _split_generators(self, dl_manager):
        cfg: ArithmeticConfig = self.builder_config
        pool = generate_problems(
            cfg.num_train + cfg.num_eval,
            cfg.seed,
            max_operand=cfg.max_operand,
            num_operands=cfg.num_operands,
            ops=cfg.ops,
        )
        train, eval_ = split_pool(pool, cfg.num_eval, cfg.seed)
        return {"train": self._generate_examples(train), "eval": self._generate_examples(eval_)}

    def _generate_examples(self, items: Iterable[dict[str, Any]]):
        yield from enumerate(items)


BUILDERS: dict[str, type[tfds.core.GeneratorBasedBuilder]] = {
    "reverse_text": JaxrlReverseText,
    "arithmetic": JaxrlArithmetic,
}


def _builder_class(name: str) -> type[tfds.core.GeneratorBasedBuilder]:
    for short, cls in BUILDERS.items():
        if name in (short, cls.name):
            return cls
    raise ValueError(
        f"unknown bundled dataset {name!r}; available: "
        f"{sorted(BUILDERS)} (tfds names {sorted(c.name for c in BUILDERS.values())})"
    )


def prepare(
    name: str,
    data_dir: str | Path | None = None,
    config: str | tfds.core.BuilderConfig | None = None,
) -> tfds.core.GeneratorBasedBuilder:
    """Build bundled dataset ``name`` (``reverse_text`` | ``arithmetic``) once; return it.

    ``config`` is a config name of the builder (``None`` = its first) or a config object.
    """
    cls = _builder_class(name)
    if isinstance(config, str):
        known = [c.name for c in cls.BUILDER_CONFIGS]
        if config not in known:
            raise ValueError(f"unknown config {config!r} for {name!r}; available: {known}")
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    builder = cls(data_dir=str(data_dir), config=config, file_format="array_record")
    builder.download_and_prepare()
    return builder


def load_split(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    config: str | tfds.core.BuilderConfig | None = None,
):
    """Random-access data source over one split of a bundled dataset (built if needed)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; available: {list(SPLITS)}")
    return prepare(name, data_dir, config).as_data_source(split=split)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m jaxrl_orch.data.builders NAME [--config C] [--data_dir D]``: build once."""
    import argparse

    parser = argparse.ArgumentParser(description="Prepare a bundled jaxrl-orch dataset.")
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("--config", default=None, help="builder config name (default: first)")
    parser.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR))
    args = parser.parse_args(argv)
    builder = prepare(args.name, args.data_dir, args.config)
    sizes = {split: info.num_examples for split, info in builder.info.splits.items()}
    print(f"{builder.name}/{builder.builder_config.name}: {sizes} in {builder.data_path}")


if __name__ == "__main__":
    main()
