"""The run's example streams, opened once from the settings: ``build_data`` gives the RL
prompts, the warm-up examples (their own order) and the held-out set twice (greedy and sampled
evals), from ``Data.dataset`` / ``eval_dataset`` or from an environment that brings its own
tasks (a verifiers taskset); ``first_examples`` is the ``Data.rl_prompt_pool`` probe's source.
"""

from __future__ import annotations

import dataclasses

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.data.sources import DatasetSource, make_source, text_file_path
from jaxrl_orch.envs.base import RunEnv


def first_examples(source: DatasetSource, n: int, seed: int) -> DatasetSource:
    """A source over the first ``n`` examples of ``source``'s data (the same every run)."""
    if n > len(source):
        raise ValueError(f"rl_prompt_pool {n} exceeds the {len(source)} training examples")
    return DatasetSource([source.example_at(i) for i in range(n)], seed=seed, name=f"first{n}")


@dataclasses.dataclass(frozen=True)
class DataSources:
    """The run's example streams: RL prompts, warm-up examples (their own order), and the
    held-out set twice (greedy eval and eval at the training temperature)."""

    train: DatasetSource
    sft: DatasetSource
    eval: DatasetSource
    sampled_eval: DatasetSource


def build_data(cfg: TrainConfig, env: RunEnv | None = None) -> DataSources:
    """The sources of ``Data.dataset`` / ``eval_dataset``, or of an env that brings its own
    examples (``env.examples(split)``, a verifiers taskset). A text file is split in two
    unless a separate eval set is named: then all of it trains, an eval text file is held out
    whole (datasets use their own splits), and a line in both fails."""
    if hasattr(env, "examples"):
        return _env_data(cfg, env)
    train_split = "all" if cfg.data.eval_dataset and text_file_path(cfg.data.dataset) else "train"
    train = make_source(
        cfg.data.dataset, split=train_split, data_dir=cfg.data.data_dir, seed=cfg.seed
    )
    if cfg.data.rl_prompt_pool is not None:
        train = first_examples(train, cfg.data.rl_prompt_pool, cfg.seed)
    sft = make_source(
        cfg.data.dataset, split=train_split, data_dir=cfg.data.data_dir, seed=cfg.seed + 1
    )
    eval_name = cfg.data.eval_dataset or cfg.data.dataset
    eval_split = "all" if cfg.data.eval_dataset and text_file_path(eval_name) else "eval"
    held_out = [
        make_source(eval_name, split=eval_split, data_dir=cfg.data.data_dir, shuffle=False)
        for _ in range(2)
    ]
    if train_split == "all" and eval_split == "all":
        seen = {ex["text"] for ex in train.data}
        shared = [ex["text"] for ex in held_out[0].data if ex["text"] in seen]
        if shared:
            raise ValueError(
                f"{len(shared)} of {len(held_out[0])} lines of eval_dataset {eval_name!r} "
                f"also appear in dataset {cfg.data.dataset!r} (e.g. {shared[0]!r}); eval lines "
                "must be held out of training"
            )
    return DataSources(train, sft, *held_out)


def _env_data(cfg: TrainConfig, env: RunEnv) -> DataSources:
    name = f"{env.name} tasks"
    train = DatasetSource(env.examples("train"), seed=cfg.seed, name=name)
    if cfg.data.rl_prompt_pool is not None:
        train = first_examples(train, cfg.data.rl_prompt_pool, cfg.seed)
    sft = DatasetSource(env.examples("train"), seed=cfg.seed + 1, name=name)
    held_out = [
        DatasetSource(env.examples("eval"), shuffle=False, name=f"{env.name} held-out tasks")
        for _ in range(2)
    ]
    return DataSources(train, sft, *held_out)
