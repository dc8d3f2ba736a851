"""PEFT export of LoRA adapters (models/peft_export.py, run/export.py): real ``peft`` over real
``transformers`` computes our unmerged LoRA model's logits; the merged export and PEFT's own
merge agree with ``merge_adapters``."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch  # the dev extra has torch, transformers and peft: a missing one fails, never skips
import transformers
from etils import epath
from flax import nnx
from safetensors.numpy import load_file

from jaxrl_orch.compose.parts import RunParts
from jaxrl_orch.config.train import Lora, TrainConfig
from jaxrl_orch.config.train import ModelSettings as Model
from jaxrl_orch.config.train import WarmupSettings as Warmup
from jaxrl_orch.models.hf_import import read_safetensors, save_hf_checkpoint
from jaxrl_orch.models.lora import merge_adapters
from jaxrl_orch.models.lora_config import TARGETS, LoraConfig
from jaxrl_orch.models.peft_export import save_peft_adapter
from jaxrl_orch.models.transformer import ModelConfig, Transformer
from jaxrl_orch.run.export import export_policy

TINY = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96)
FAMILIES = {
    "llama": ModelConfig(**TINY, rope_theta=500.0, norm_eps=1e-5, tie_embeddings=True),
    "qwen2": ModelConfig(**TINY, rope_theta=1e4, qkv_bias=True, tie_embeddings=False),
    # head_dim decoupled from d_model / n_heads, as in the real Qwen3 models.
    "qwen3": ModelConfig(**{**TINY, "head_dim": 32}, rope_theta=1e6, qk_norm=True),
}
ALL = tuple(TARGETS)
TOKENS = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 24)).astype(np.int32)


def _lora_model(family: str, targets: tuple[str, ...], seed: int = 0):
    """``(cfg, graphdef, adapters, base)``: O(1) random base weights (the default init hides
    layout mistakes) and random non-zero ``A`` and ``B`` (a trained adapter)."""
    cfg = dataclasses.replace(FAMILIES[family], lora=LoraConfig(rank=4, alpha=8.0, targets=targets))
    graphdef, adapters, base = nnx.split(Transformer(cfg, rngs=nnx.Rngs(seed)), nnx.LoRAParam, ...)
    rng = np.random.default_rng(seed + 1)

    def fill(scale):
        def draw(path, x):
            noise = rng.normal(size=x.shape).astype(np.float32)
            is_norm = any("norm" in str(getattr(k, "key", "")) for k in path)
            return jnp.asarray(1.0 + 0.2 * noise if is_norm else scale * noise)

        return draw

    for state, scale in ((base, 0.3), (adapters, 0.15)):
        pure = nnx.to_pure_dict(state)
        nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill(scale), pure))
    return cfg, graphdef, adapters, base


def _our_logits(graphdef, *states) -> np.ndarray:
    positions = np.broadcast_to(np.arange(TOKENS.shape[1], dtype=np.int32), TOKENS.shape)
    fwd = jax.jit(lambda s, t, p: nnx.merge(graphdef, *s)(t, p))
    return np.asarray(fwd(states, jnp.asarray(TOKENS), jnp.asarray(positions)))


def _plain_graphdef(cfg: ModelConfig):
    plain = dataclasses.replace(cfg, lora=None)
    return nnx.split(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))))[0]


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


def _load_hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize(
    "family,targets",
    [("llama", ALL), ("qwen2", ALL), ("qwen3", ALL), ("llama", ("q", "v")), ("qwen2", ("o",))],
)
def test_peft_over_transformers_computes_our_lora_logits(family, targets, tmp_path):
    cfg, graphdef, adapters, base = _lora_model(family, targets)
    plain = dataclasses.replace(cfg, lora=None)
    ours = _our_logits(graphdef, adapters, base)
    without = _our_logits(_plain_graphdef(cfg), base)
    assert np.abs(ours).max() > 1.0  # non-degenerate logits: the tolerance means something
    assert np.abs(ours - without).max() > 0.5  # the adapters change the function

    save_hf_checkpoint(base, plain, tmp_path / "base")
    # A pure dict of the adapters exports like their State.
    pure = nnx.to_pure_dict(adapters) if family == "qwen2" else adapters
    out = save_peft_adapter(pure, cfg, tmp_path / "lora", str(tmp_path / "base"))
    assert out == tmp_path / "lora" and not (tmp_path / "lora.tmp").exists()
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == str(tmp_path / "base")

    model = peft.PeftModel.from_pretrained(_load_hf(tmp_path / "base"), out).eval()
    adapted = [n for n, _ in model.named_modules() if n.endswith(".lora_A.default")]
    assert len(adapted) == len(targets) * cfg.n_layers  # every adapter found its module
    np.testing.assert_allclose(_hf_logits(model), ours, rtol=1e-4, atol=1e-4)

    # The merged export in plain transformers, and PEFT's own merge, give the same weights.
    merged = merge_adapters(base, adapters, cfg.lora.scale)
    save_hf_checkpoint(merged, plain, tmp_path / "merged")
    np.testing.assert_allclose(
        _hf_logits(_load_hf(tmp_path / "merged")), ours, rtol=1e-4, atol=1e-4
    )
    theirs = model.merge_and_unload().state_dict()
    want = read_safetensors(tmp_path / "merged")
    for name, w in want.items():
        np.testing.assert_allclose(theirs[name].numpy(), w, rtol=1e-5, atol=1e-5, err_msg=name)
    changed = {
        n for n, w in read_safetensors(tmp_path / "base").items() if not np.array_equal(w, want[n])
    }
    hf_names = {f"model.layers.{i}.{TARGETS[t][2]}.weight" for t in targets for i in range(2)}
    assert changed == hf_names


def test_a_second_save_replaces_the_adapter_whole(tmp_path):
    cfg, _, adapters, _ = _lora_model("llama", ALL)
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "stale.bin").write_bytes(b"x")
    save_peft_adapter(adapters, cfg, tmp_path / "lora", "base")
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tensors = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert len(tensors) == 2 * len(ALL) * cfg.n_layers
    assert all(t.dtype == np.float32 for t in tensors.values())
    a = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (4, cfg.n_heads * cfg.head_dim) and b.shape == (cfg.n_heads * cfg.head_dim, 4)


def test_save_peft_adapter_refuses_a_config_without_lora(tmp_path):
    cfg, _, adapters, _ = _lora_model("llama", ALL)
    with pytest.raises(ValueError, match="lora=None"):
        save_peft_adapter(adapters, dataclasses.replace(cfg, lora=None), tmp_path / "x", "base")
    assert not (tmp_path / "x").exists()


def _parts(workdir, model_name: str, model_cfg: ModelConfig, warmup_steps: int) -> RunParts:
    """The fields of ``RunParts`` that ``export_policy`` reads; the rest belong to other stages."""
    cfg = TrainConfig(
        model=Model(name=model_name, tokenizer="byte"),  # the checkpoint holds no tokenizer
        warmup=Warmup(steps=warmup_steps),
        lora=Lora(rank=4, alpha=8.0, targets=ALL),
    )
    unused = dict.fromkeys(
        (
            "role",
            "engine_addresses",
            "tokenizer",
            "placement",
            "env",
            "demonstrator",
            "data",
            "compile_cache",
            "started",
        )
    )
    return RunParts(cfg=cfg, workdir=epath.Path(workdir), model_cfg=model_cfg, **unused)


@pytest.mark.parametrize("warmed_up", [False, True])
def test_export_policy_writes_the_merged_model_and_the_adapter_over_its_base(warmed_up, tmp_path):
    cfg, graphdef, adapters, base = _lora_model("qwen2", ALL)
    plain = dataclasses.replace(cfg, lora=None)
    ours = _our_logits(graphdef, adapters, base)
    checkpoint = tmp_path / "ckpt"  # the run's Model.name: the imported base
    save_hf_checkpoint(base, plain, checkpoint)
    run = tmp_path / "run"
    run.mkdir()
    (run / "export").mkdir()  # a previous export: replaced whole
    (run / "export" / "stale.txt").write_text("old")
    parts = _parts(run, str(checkpoint), plain, warmup_steps=3 if warmed_up else 0)
    merged = merge_adapters(base, adapters, cfg.lora.scale)
    if warmed_up:
        with pytest.raises(ValueError, match="Warmup.steps=3"):
            export_policy(parts, merged, adapters=adapters)
        assert sorted(p.name for p in run.iterdir()) == ["export"]  # refused before writing
    dest = export_policy(parts, merged, adapters=adapters, base=base)

    assert dest == epath.Path(run) / "export"
    assert sorted(p.name for p in run.iterdir()) == ["export"]  # no staging left behind
    assert not (run / "export" / "stale.txt").exists()
    np.testing.assert_allclose(_hf_logits(_load_hf(run / "export")), ours, rtol=1e-4, atol=1e-4)
    lora = run / "export" / "lora"
    named = json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"]
    want_base = (lora / "base") if warmed_up else checkpoint
    assert named == str(want_base.resolve())
    assert (lora / "base").exists() == warmed_up
    # AutoPeftModel finds the base from adapter_config.json alone.
    model = peft.AutoPeftModelForCausalLM.from_pretrained(lora, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(model), ours, rtol=1e-4, atol=1e-4)
