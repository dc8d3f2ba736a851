"""``Model.name`` may name an HF checkpoint directory: the run starts from its weights
and ends by exporting the trained policy as an HF checkpoint that loads back.

The checkpoint here is written by ``save_hf_checkpoint`` from a seeded tiny-byte model (no
network): what matters is that the weights the warm-up/RL trainer and the engine start from are
exactly the checkpoint's, not a fresh init, and that a resumed run does not reload them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from support.runs import prepare, run, warmup
from support.tiny_tokenizers import write_bpe
from support.toy_rl import toy_config

from jaxrl_orch.config.train import TrainConfig
from jaxrl_orch.models.byte_hf import save_byte_tokenizer
from jaxrl_orch.models.configs import get_config
from jaxrl_orch.models.hf_import import load_hf_checkpoint, save_hf_checkpoint
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.run import warmup as warmup_stage

pytestmark = pytest.mark.slow


def _leaves(state):
    return {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    }


def _cfg(model: str) -> TrainConfig:
    # The toy env's reward has spread inside a group, so two RL steps really move the weights.
    return toy_config(
        {
            "Model.name": model,
            "RL.steps": 2,
            "RL.lr_warmup_steps": 0,
            "RL.learning_rate": 1e-3,
            "RL.prompts_per_step": 2,
        }
    )


def test_run_starts_from_an_hf_checkpoint_and_exports_the_trained_policy(tmp_path, monkeypatch):
    preset = get_config("tiny-byte")
    source = Transformer(preset, rngs=nnx.Rngs(7))
    save_hf_checkpoint(source, preset, tmp_path / "hf")
    save_byte_tokenizer(tmp_path / "hf")  # the run reads the checkpoint's own tokenizer
    start = _leaves(nnx.state(source))

    parts = prepare(_cfg(str(tmp_path / "hf")), tmp_path / "run")
    assert parts.model_cfg.d_model == preset.d_model and parts.model_cfg.output_vocab is not None
    # Warmup.steps = 0: the RL stage starts from these
    params, _ = warmup(parts, tmp_path / "sft_metrics.jsonl")
    got = _leaves(params)
    assert got.keys() == start.keys()
    for k in start:
        np.testing.assert_array_equal(got[k], start[k], err_msg=k)

    summary = run(parts)
    assert summary["rl_steps"] == 2
    assert summary["export_dir"] == str(tmp_path / "run" / "export")
    config, model = load_hf_checkpoint(summary["export_dir"])
    assert (config.d_model, config.n_layers, config.vocab_size) == (
        preset.d_model,
        preset.n_layers,
        preset.vocab_size,
    )
    trained = _leaves(nnx.state(model))
    assert trained.keys() == start.keys()
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # two RL steps moved it
    assert not (tmp_path / "run" / "export.tmp").exists()

    # A resumed run restores its own checkpoint; it never goes back to the HF weights.
    again = prepare(_cfg(str(tmp_path / "hf")), tmp_path / "run")
    refuse = lambda _parts: pytest.fail("a resumed run must not reload the HF weights")
    monkeypatch.setattr(warmup_stage, "pretrained_params", refuse)
    warmup(again, tmp_path / "sft_metrics2.jsonl")


def test_the_export_carries_the_runs_own_tokenizer(tmp_path):
    preset = get_config("tiny-byte")  # 512 rows cover the small BPE written next to it
    save_hf_checkpoint(Transformer(preset, rngs=nnx.Rngs(1)), preset, tmp_path / "hf")
    write_bpe(tmp_path / "hf")
    hf = str(tmp_path / "hf")
    base = _cfg(hf)
    cfg = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, tokenizer=hf),
        rl=dataclasses.replace(base.rl, steps=1),
    )
    parts = prepare(cfg, tmp_path / "run")
    # The BPE's ids limit the logits, not the byte tokenizer's.
    assert parts.model_cfg.output_vocab == parts.tokenizer.output_vocab_size <= 320
    run(parts)
    exported = tmp_path / "run" / "export" / "tokenizer.json"
    assert exported.read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    "model, needle",
    [
        ("/no/such/checkpoint", "does not exist (nothing is downloaded"),
        ("Qwen/Qwen2.5-0.5B", "does not exist (nothing is downloaded"),
        ("no-such-preset", "unknown model config 'no-such-preset'"),
    ],
)
def test_bad_model_names_fail_before_any_work(tmp_path, model, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        prepare(_cfg(model), tmp_path)


def test_a_directory_without_config_json_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="without config.json"):
        prepare(_cfg(str(tmp_path / "empty")), tmp_path / "run")
