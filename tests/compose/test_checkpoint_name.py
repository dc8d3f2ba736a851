"""``Model.name``: a checkpoint named wherever it lives, with its own tokenizer by default.

A tiny Qwen-style HF checkpoint (random weights, a small BPE with a ChatML chat template in its
``tokenizer_config.json``) is written here and named by a local path and by a ``gs://`` path in
the local emulator: either way ``build_model`` gives the checkpoint's config and its tokenizer
and chat template, and ``pretrained_params`` reads the same bits. Each bad name is refused with
one line naming it, before any work; a published model's preset without its checkpoint trains
only when ``Model.random_init`` asks for random weights; the byte presets stay random as ever.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx
from support.chat_checkpoints import write_qwen_tokenizer
from support.checkout import ROOT
from support.gcs_emulator import BUCKET

from jaxrl_orch.compose.model import build_model, pretrained_params, tokenizer_spec
from jaxrl_orch.config.train import ModelSettings, TrainConfig
from jaxrl_orch.models.configs import ModelConfig, get_config
from jaxrl_orch.models.hf_import import save_hf_checkpoint
from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.tokenizer import ByteTokenizer, load_tokenizer
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.paths import as_path, copy_tree
from jaxrl_orch.run.identity import identity

SHAPE = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
MODEL = ModelConfig(vocab_size=320, qkv_bias=True, max_seq_len=512, **SHAPE)
TEXT = "<|im_start|>user\nhello world<|im_end|>"
TURN = [{"role": "user", "content": "reverse this"}]


@pytest.fixture(autouse=True)
def _no_gin_left():
    import gin

    yield
    gin.clear_config()  # a config file's bindings must not reach a later test's TrainConfig(...)


def _cfg(name: str, **model) -> TrainConfig:
    return TrainConfig(model=ModelSettings(name=name, **model))


def _checkpoint(path, tokenizer: bool = True):
    """A tiny Qwen-style checkpoint in ``path``; its params as a pure dict."""
    if tokenizer:
        write_qwen_tokenizer(path)
    model = Transformer(MODEL, rngs=nnx.Rngs(3))
    save_hf_checkpoint(model, MODEL, path)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _upload(local, tag: str) -> str:
    url = f"gs://{BUCKET}/{tag}-{local.name}"
    copy_tree(local, url)
    return url


def test_a_local_or_gs_checkpoint_gives_its_config_tokenizer_and_bits(gcs, tmp_path):
    want = _checkpoint(tmp_path / "ckpt")
    local = str(tmp_path / "ckpt")
    url = _upload(tmp_path / "ckpt", "named")
    files = load_tokenizer(local)  # the checkpoint's files read directly
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for name in (local, url):
        tok, model_cfg = build_model(_cfg(name))
        assert (model_cfg.d_model, model_cfg.vocab_size, model_cfg.qkv_bias) == (32, 320, True)
        assert tok.encode(TEXT) == files.encode(TEXT) and tok.eos_id == files.eos_id
        assert len(tok.encode(TEXT)) < len(TEXT)  # the BPE, not the byte tokenizer
        assert tok.chat_template_origin == os.fspath(as_path(name) / "tokenizer_config.json")
        assert tok.apply_chat_template(TURN) == files.apply_chat_template(TURN)
        handle = pretrained_params(name)
        assert isinstance(handle, HFCheckpoint) and handle.path == name
        got = nnx.to_pure_dict(handle.load(handle.abstract(), sharding))
        flat_want = jax.tree_util.tree_leaves_with_path(want)
        flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
        assert len(flat_got) == len(flat_want)
        for key, value in flat_want:
            np.testing.assert_array_equal(np.asarray(flat_got[key]), np.asarray(value), str(key))


def test_an_explicit_tokenizer_still_wins(tmp_path):
    _checkpoint(tmp_path / "ckpt")
    tok, model_cfg = build_model(_cfg(str(tmp_path / "ckpt"), tokenizer="byte"))
    assert isinstance(tok, ByteTokenizer) and model_cfg.output_vocab == tok.output_vocab_size


def test_a_missing_gs_directory_or_config_is_one_line_naming_it(gcs, tmp_path):
    missing = f"gs://{BUCKET}/no-such-checkpoint"
    with pytest.raises(ValueError, match=f"model directory '{missing}' does not exist"):
        build_model(_cfg(missing))
    _checkpoint(tmp_path / "ckpt")
    url = _upload(tmp_path / "ckpt", "noconfig")
    (as_path(url) / "config.json").unlink()
    for call in (build_model, pretrained_params):
        with pytest.raises(ValueError, match=f"model '{url}' is a directory without config.json"):
            call(_cfg(url) if call is build_model else url)


def test_a_checkpoint_without_a_tokenizer_says_to_set_model_tokenizer(gcs, tmp_path):
    _checkpoint(tmp_path / "ckpt", tokenizer=False)
    for name in (str(tmp_path / "ckpt"), _upload(tmp_path / "ckpt", "notok")):
        match = f"checkpoint '{name}' holds no tokenizer.json: set Model.tokenizer"
        with pytest.raises(ValueError, match=match):
            build_model(_cfg(name))


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "llama-3.1-8b", "qwen3-8b"])
def test_a_published_preset_without_weights_needs_random_init(preset):
    with pytest.raises(ValueError, match=f"model '{preset}' is the preset of a published.*"):
        build_model(_cfg(preset))
    with pytest.raises(
        ValueError, match=r"CHECKPOINT='/path/or/gs://.*else Model.name.*Model.random_init=True"
    ):
        build_model(_cfg(preset))
    tok, model_cfg = build_model(_cfg(preset, random_init=True))
    assert isinstance(tok, ByteTokenizer)
    assert model_cfg.vocab_size == get_config(preset).vocab_size
    assert pretrained_params(preset) is None


def test_the_byte_presets_stay_random_without_a_setting(monkeypatch):
    from jaxrl_orch.train import load_config

    for preset in ("tiny-byte", "small-byte"):
        tok, model_cfg = build_model(_cfg(preset))
        assert isinstance(tok, ByteTokenizer) and pretrained_params(preset) is None
        assert model_cfg.d_model == get_config(preset).d_model
    monkeypatch.chdir(ROOT)
    cfg = load_config(["configs/reverse_text.gin"], [])
    assert cfg.model.name == "tiny-byte" and cfg.model.tokenizer is None
    assert not cfg.model.random_init and tokenizer_spec(cfg.model) == "byte"
    build_model(cfg)


@pytest.mark.parametrize(
    "gin", ["configs/tpu_v5e_8.gin", "configs/tpu_v5e_8_lora.gin", "configs/tpu_v6e_8.gin"]
)
def test_the_tpu_configs_say_what_to_set_to_train(monkeypatch, gin):
    from jaxrl_orch.train import load_config

    monkeypatch.chdir(ROOT)
    cfg = load_config([gin], [])
    # What the AOT compile reads: the preset's shapes and the byte stand-in, no weights.
    assert tokenizer_spec(cfg.model) == "byte" and pretrained_params(cfg.model.name) is None
    with pytest.raises(ValueError, match="Model.random_init=True"):
        build_model(cfg)
    # Its model file says what to set, and binds no tokenizer (the checkpoint's own is the default).
    model_file = re.search(r"include '(configs/model/[\w.]+\.gin)'", (ROOT / gin).read_text())
    text = (ROOT / model_file.group(1)).read_text()
    assert "Model.random_init = True" in text and "CHECKPOINT = 'gs://" in text
    assert "Model.tokenizer" not in text


def test_the_default_tokenizer_is_recorded_as_the_one_it_names(tmp_path):
    # A run recorded 'byte' before the default existed: the same run resumes under it.
    assert identity(_cfg("tiny-byte"))["model.tokenizer"] == "byte"
    assert identity(_cfg(str(tmp_path)))["model.tokenizer"] == str(tmp_path)
    explicit = dataclasses.replace(_cfg(str(tmp_path)).model, tokenizer="byte")
    assert identity(TrainConfig(model=explicit))["model.tokenizer"] == "byte"


@pytest.mark.slow
def test_an_unreachable_gs_checkpoint_is_one_line_before_any_work(tmp_path):
    """No storage answers at the endpoint: after the client's own retries the train command
    exits 2 naming the URL, with nothing written to the workdir but its owner's claim."""
    import subprocess
    import sys

    from support.checkout import subprocess_env
    from support.gcs_emulator import free_port

    env = subprocess_env()
    env.update(
        STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{free_port()}",  # nothing listens there
        GOOGLE_AUTH_TOKEN_FOR_TESTING="test-token",
        GOOGLE_CLOUD_PROJECT="test-project",
    )
    url = f"gs://{BUCKET}/Qwen2.5-0.5B-Instruct"
    files = ["model/checkpoint", "slice/cpu", "env/reverse_text", "tune/full", "algo/grpo"]
    cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={tmp_path / 'run'}"]
    cmd += [f"--gin_file=configs/{f}.gin" for f in files]
    cmd += [f"--gin_param=CHECKPOINT = '{url}'"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot reach checkpoint '{url}': "), proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]
