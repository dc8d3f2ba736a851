"""HF checkpoints: logits parity with transformers (Llama, Qwen2, Qwen3), sharded loading,
export round trip, config mapping and errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the dev extra has torch and transformers: a missing one fails, never skips
import transformers
from flax import nnx

from jaxrl_orch.models import hf_import
from jaxrl_orch.models.hf_import import (
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    read_safetensors,
    save_hf_checkpoint,
)
from jaxrl_orch.models.transformer import Transformer, get_config

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
FAMILIES = {
    # Llama 3 rope scaling with a short original context so the scaled band is exercised.
    "llama": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e4),
    # head_dim decoupled from hidden/heads, as in the real Qwen3 models.
    "qwen3": lambda: transformers.Qwen3Config(
        **TINY, head_dim=32, tie_word_embeddings=True, rope_theta=1e6
    ),
}
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def make_hf_model(family: str):
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    cfg._attn_implementation = "eager"
    model = getattr(transformers, MODEL_CLASSES[family])(cfg).eval()
    with torch.no_grad():
        # O(1) weights (and non-zero biases): the default init hides layout mistakes.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p))
    return np.asarray(fwd(state, jnp.asarray(tokens), jnp.asarray(positions)))


TOKENS = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 24)).astype(np.int32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, tmp_path):
    hf = make_hf_model(family)
    # Shard the Qwen2 one: loading through model.safetensors.index.json is the same path.
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if family == "qwen2" else "1GB")
    if family == "qwen2":
        assert (tmp_path / "model.safetensors.index.json").exists()
    config, model = load_hf_checkpoint(tmp_path)
    assert config.qk_norm == (family == "qwen3") and config.qkv_bias == (family == "qwen2")
    assert (config.rope_scaling is not None) == (family == "llama")
    want = hf_logits(hf, TOKENS)
    got = our_logits(model, TOKENS)
    assert np.abs(want).max() > 1.0  # non-degenerate logits, so the tolerance means something
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_export_round_trip_is_bit_exact_and_loads_in_transformers(family, tmp_path):
    hf = make_hf_model(family)
    hf.save_pretrained(tmp_path / "src")
    config, model = load_hf_checkpoint(tmp_path / "src")
    files = save_hf_checkpoint(model, config, tmp_path / "out", max_shard_size="60KB")
    assert "model.safetensors.index.json" in files and len(files) > 3
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files[1:-1])
    config2, model2 = load_hf_checkpoint(tmp_path / "out")
    assert config2 == config
    a = jax.tree.leaves(nnx.state(model))
    b = jax.tree.leaves(nnx.state(model2))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # A bare params State (what the trainer publishes) exports to the same bytes.
    save_hf_checkpoint(nnx.state(model2), config, tmp_path / "out2", max_shard_size="60KB")
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()
    # transformers itself accepts the export and computes the same function.
    reloaded = getattr(transformers, MODEL_CLASSES[family]).from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    np.testing.assert_allclose(hf_logits(reloaded, TOKENS), hf_logits(hf, TOKENS), atol=1e-5)


def test_bf16_checkpoint_loads_in_requested_dtype(tmp_path):
    hf = make_hf_model("qwen3").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    config, model = load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)
    assert config.param_dtype == jnp.bfloat16 and config.dtype == jnp.bfloat16
    emb = model.embed[...]
    assert emb.dtype == jnp.bfloat16
    want = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(emb, np.float32), want)


def test_config_mapping_of_published_shapes():
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "hidden_act": "silu",
    }
    assert config_from_hf(qwen3) == get_config("qwen3-0.6b")
    for name in ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"):
        cfg = get_config(name)
        assert config_from_hf(config_to_hf(cfg)) == cfg
    # transformers-5 style nested rope parameters are read as well.
    nested = dict(qwen3, rope_parameters={"rope_type": "default", "rope_theta": 5.0})
    assert config_from_hf(nested).rope_theta == 5.0


def test_unsupported_inputs_name_the_problem(tmp_path):
    base = config_to_hf(get_config("tiny-byte"))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        config_from_hf(dict(base, architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        config_from_hf(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf(dict(base, mlp_bias=True))
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        load_hf_checkpoint(tmp_path / "no-such-dir")
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="max_shard_size"):
        hf_import._parse_size("lots")
    assert hf_import._parse_size("2KB") == 2000 and hf_import._parse_size("1KiB") == 1024


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    tensors = hf_import.read_safetensors(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_import.hf_to_params(tensors, config)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    cfg_json["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.\w+_proj: checkpoint shape"):
        load_hf_checkpoint(tmp_path)


def test_torch_dtype_is_honoured_on_import_and_export(tmp_path):
    """A bf16 checkpoint loads into fp32 master params exactly and exports as bf16 again (the
    same bytes on disk); an fp32 checkpoint stays fp32."""
    import ml_dtypes

    cfg = get_config("tiny-byte", n_layers=1)
    hf = dict(config_to_hf(cfg), torch_dtype="bfloat16")
    assert config_from_hf(hf).checkpoint_dtype == "bfloat16"
    assert config_from_hf(hf, param_dtype="bfloat16").checkpoint_dtype is None
    assert config_from_hf(config_to_hf(cfg)).checkpoint_dtype is None
    with pytest.raises(ValueError, match="torch_dtype='int8'"):
        config_from_hf(dict(hf, torch_dtype="int8"))

    rng = np.random.default_rng(0)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    bf = jax.tree.map(
        lambda x: np.asarray(rng.normal(size=x.shape), np.float32).astype(ml_dtypes.bfloat16),
        state,
    )
    src = tmp_path / "src"
    save_hf_checkpoint(bf, dataclasses.replace(cfg, param_dtype="bfloat16"), src)
    assert json.loads((src / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded_cfg, model = load_hf_checkpoint(src)  # fp32 master params
    assert loaded_cfg.checkpoint_dtype == "bfloat16"
    params = nnx.state(model)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    out = tmp_path / "out"
    save_hf_checkpoint(params, loaded_cfg, out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    a, b = read_safetensors(src), read_safetensors(out)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == ml_dtypes.bfloat16 and np.array_equal(a[k], b[k]), k
