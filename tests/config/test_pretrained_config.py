"""configs/pretrained.gin: a pretrained checkpoint's settings parse, name the checkpoint once
(``CHECKPOINT``, i.e. ``Model.name``: its weights, and its tokenizer by default; refused until
named), and validate against a Qwen-style
checkpoint directory (its own tokenizer and chat template, every bundled prompt within the
engine's and the row's limits)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.chat_checkpoints import write_qwen_tokenizer
from support.checkout import ROOT

from jaxrl_orch.train import load_config

CONFIG = "configs/pretrained.gin"
MISSING = "/nonexistent/Qwen2.5-0.5B-Instruct"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    import gin

    monkeypatch.chdir(ROOT)
    yield
    gin.clear_config()  # these bindings must not reach a later test's TrainConfig(...)


def test_no_warm_up_a_pretrained_learning_rate_and_the_checkpoints_tokenizer():
    cfg = load_config([CONFIG], [f"CHECKPOINT = '{MISSING}'"])
    assert cfg.model.name == MISSING and cfg.model.tokenizer is None  # the checkpoint's own
    assert cfg.warmup.steps == 0 and cfg.warmup.demonstrations == ()
    assert cfg.rl.learning_rate == 1e-6 and cfg.rl.lr_warmup_steps == 10
    assert cfg.model.param_dtype == "float32"  # a 1e-6 step needs fp32 master weights
    assert cfg.data.instruction is None and cfg.rl.loss.kl_beta == 0.0
    assert cfg.rl.max_new_tokens < cfg.trainer.row_len and cfg.engine.max_target_length // 2 >= 128
    assert (ROOT / CONFIG).read_text().startswith("#")


def test_one_binding_names_the_checkpoint_for_weights_and_tokenizer():
    cfg = load_config([CONFIG], ["Model.name = 'gs://bucket/ckpt'"])
    assert cfg.model.name == "gs://bucket/ckpt" and cfg.model.tokenizer is None
    cfg = load_config([CONFIG], ["Model.name = '/a'", "Model.tokenizer = '/b'"])
    assert (cfg.model.name, cfg.model.tokenizer) == ("/a", "/b")


def test_an_unnamed_checkpoint_is_refused_naming_the_macro_and_a_missing_one_its_path():
    from support.runs import prepare

    with pytest.raises(ValueError, match=r"model/checkpoint.gin:\d+ reads %CHECKPOINT, which no"):
        load_config([CONFIG], [])
    cfg = load_config([CONFIG], [f"CHECKPOINT = '{MISSING}'"])
    with pytest.raises(ValueError, match=f"model directory '{MISSING}' does not exist"):
        prepare(cfg, Path("unused"))


def test_validates_against_a_qwen_style_checkpoint(tmp_path):
    from flax import nnx
    from support.runs import prepare

    from jaxrl_orch.models.configs import ModelConfig
    from jaxrl_orch.models.hf_import import save_hf_checkpoint
    from jaxrl_orch.models.transformer import Transformer

    ckpt = write_qwen_tokenizer(tmp_path / "ckpt")
    shape = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
    model = ModelConfig(vocab_size=320, qkv_bias=True, max_seq_len=512, **shape)
    save_hf_checkpoint(Transformer(model, rngs=nnx.Rngs(0)), model, ckpt)
    cfg = load_config([CONFIG], [f"CHECKPOINT = '{ckpt}'"])
    parts = prepare(cfg, tmp_path / "run")  # every bundled prompt, templated, fits
    assert parts.tokenizer.chat_template_origin == str(ckpt / "tokenizer_config.json")
    assert parts.env.instruction == "Reverse in <answer></answer>:"
    prompt = parts.env.prompt_text({"text": "hello world"})
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")  # the template's system turn
