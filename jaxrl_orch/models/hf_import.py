"""Hugging Face checkpoints <-> the NNX ``Transformer``.

Owns the translation between a Hugging Face causal-LM directory of the Llama / Qwen2 / Qwen3
families (``config.json`` plus ``model.safetensors`` or a sharded set indexed by
``model.safetensors.index.json``) and this package's ``ModelConfig`` + ``Transformer`` params:

- ``config_from_hf(dict) -> ModelConfig`` and ``config_to_hf(ModelConfig) -> dict``;
- ``hf_to_params`` / ``params_to_hf``: pure name/layout maps between HF tensors (``nn.Linear``
  weights are ``[out, in]``) and our pure-dict params (kernels ``[in, ...out]``, heads split
  out as their own axis);
- ``param_names(config)``: our param path -> (HF tensor name, layout kind), the one name map
  (``models.hf_sharded`` reads each device's shard through it and ``_to_ours``);
- ``checkpoint_files(path)``: the safetensors files of a directory (local or ``gs://``);
- ``load_hf_checkpoint(path, dtype=...) -> (config, model)`` (every tensor read whole, onto the
  default device: small models and a reference for ``hf_sharded``) and
  ``save_hf_checkpoint(model, config, path, max_shard_size=...)``.

Invariants: export then import gives bit-identical params (transposes and reshapes only); every
tensor the model needs must be present and of the exact shape; a checkpoint feature this model
does not implement (o-proj / MLP bias, sliding window, a RoPE type other than default / llama3,
a non-SiLU activation) is refused naming it. RoPE needs no permutation: these families use the
rotate-half pairing of ``rope.apply_rope``. Reads and writes files only; ``load_hf_checkpoint``'s
arrays land on the default device (a run reads through ``hf_sharded`` instead, onto its mesh).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_orch.models.configs import ModelConfig, RopeScaling
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.paths import as_path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
STORAGE_DTYPES = ("float32", "bfloat16", "float16")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _unsupported(what: str, value: Any) -> ValueError:
    return ValueError(f"unsupported checkpoint feature: {what}={value!r}")


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """``ModelConfig`` from a parsed HF ``config.json`` (old or transformers-5 rope keys)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    family = SUPPORTED_ARCHITECTURES.get(arch) if arch else None
    if family is None:
        family = {v: v for v in SUPPORTED_ARCHITECTURES.values()}.get(hf.get("model_type"))
    if family is None:
        raise ValueError(
            f"unsupported architecture {arch or hf.get('model_type')!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"])
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", True)
    if family == "llama" and hf.get("attention_bias"):
        raise _unsupported("attention_bias (Llama biases o_proj too)", True)
    if hf.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", True)

    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise _unsupported("rope_type", rope_type)

    n_heads = int(hf["num_attention_heads"])
    fields = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
        d_ff=int(hf["intermediate_size"]),
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=family == "qwen3",
        # Qwen2 hard-codes q/k/v bias; Qwen3 exposes it as attention_bias (off in releases).
        qkv_bias=family == "qwen2" or (family == "qwen3" and bool(hf.get("attention_bias"))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_scaling=scaling,
    )
    fields.update(overrides)
    # Recorded only where it differs from the params' dtype (None means "the params' dtype").
    store = _storage_dtype(hf.get("torch_dtype") or hf.get("dtype"))
    if store is not None and jnp.dtype(store) != jnp.dtype(fields.get("param_dtype", "float32")):
        fields.setdefault("checkpoint_dtype", store)
    return ModelConfig(**fields)


def _storage_dtype(name: Any) -> str | None:
    """The checkpoint's ``torch_dtype`` as a dtype name (None when the config.json has none)."""
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in STORAGE_DTYPES:
        raise _unsupported("torch_dtype", name)
    return name


def _family(config: ModelConfig) -> str:
    if config.qk_norm:
        if config.rope_scaling is not None:
            raise ValueError("no HF architecture has both qk_norm and llama3 rope scaling")
        return "qwen3"
    if config.qkv_bias:
        if config.rope_scaling is not None:
            raise ValueError("no HF architecture has both qkv_bias and llama3 rope scaling")
        return "qwen2"
    return "llama"


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """HF ``config.json`` dict (Qwen3 if qk_norm, Qwen2 if qkv_bias, else Llama)."""
    family = _family(config)
    arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[family]
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.d_ff,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_seq_len,
        "torch_dtype": config.checkpoint_dtype or str(jnp.dtype(config.param_dtype)),
    }
    if family != "qwen2":
        out["attention_bias"] = False
    if config.rope_scaling is not None:
        s = config.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    return out


def _layer_map(config: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """(HF suffix under model.layers.{i}., our path under layers[i], layout kind)."""
    m = [
        ("input_layernorm.weight", ("input_norm", "weight"), "copy"),
        ("post_attention_layernorm.weight", ("post_attn_norm", "weight"), "copy"),
        ("self_attn.q_proj.weight", ("attn", "q_proj"), "in_heads"),
        ("self_attn.k_proj.weight", ("attn", "k_proj"), "in_heads"),
        ("self_attn.v_proj.weight", ("attn", "v_proj"), "in_heads"),
        ("self_attn.o_proj.weight", ("attn", "o_proj"), "heads_out"),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj"), "transpose"),
        ("mlp.up_proj.weight", ("mlp", "up_proj"), "transpose"),
        ("mlp.down_proj.weight", ("mlp", "down_proj"), "transpose"),
    ]
    if config.qkv_bias:
        m += [(f"self_attn.{x}_proj.bias", ("attn", f"{x}_bias"), "heads") for x in "qkv"]
    if config.qk_norm:
        m += [(f"self_attn.{x}_norm.weight", ("attn", f"{x}_norm", "weight"), "copy") for x in "qk"]
    return m


def _to_ours(w: np.ndarray, kind: str, hd: int) -> np.ndarray:
    if kind == "copy":
        return w
    if kind == "transpose":
        return w.T
    if kind == "in_heads":  # [H*D, E] -> [E, H, D]
        return w.T.reshape(w.shape[1], -1, hd)
    if kind == "heads_out":  # [E, H*D] -> [H, D, E]
        return w.T.reshape(-1, hd, w.shape[0])
    if kind == "heads":  # [H*D] -> [H, D]
        return w.reshape(-1, hd)
    raise AssertionError(kind)


def _to_hf(w: np.ndarray, kind: str) -> np.ndarray:
    if kind == "copy":
        return w
    if kind == "transpose":
        return w.T
    if kind == "in_heads":  # [E, H, D] -> [H*D, E]
        return w.reshape(w.shape[0], -1).T
    if kind == "heads_out":  # [H, D, E] -> [E, H*D]
        return w.reshape(-1, w.shape[-1]).T
    if kind == "heads":
        return w.reshape(-1)
    raise AssertionError(kind)


def param_names(config: ModelConfig) -> dict[tuple[Any, ...], tuple[str, str]]:
    """Our param path (``nnx.to_pure_dict`` keys) -> (HF tensor name, layout kind): the one
    name map every reader and writer of HF checkpoints goes through."""
    names = {
        ("embed",): ("model.embed_tokens.weight", "copy"),
        ("final_norm", "weight"): ("model.norm.weight", "copy"),
    }
    if not config.tie_embeddings:
        names[("lm_head",)] = ("lm_head.weight", "transpose")
    for i in range(config.n_layers):
        for hf_name, path, kind in _layer_map(config):
            names[("layers", i, *path)] = (f"model.layers.{i}.{hf_name}", kind)
    return names


def hf_to_params(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, Any]:
    """Pure-dict params (``nnx.to_pure_dict`` layout) from HF-named tensors."""
    params: dict[str, Any] = {}
    for path, (name, kind) in param_names(config).items():
        if name not in tensors:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _to_ours(np.asarray(tensors[name]), kind, config.head_dim)
    return params


def params_to_hf(params: dict[str, Any], config: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named ``[out, in]`` tensors from pure-dict params (inverse of ``hf_to_params``)."""
    out = {}
    for path, (name, kind) in param_names(config).items():
        node = params
        for key in path:
            node = node[key]
        out[name] = np.ascontiguousarray(_to_hf(np.asarray(node), kind))
    return out


def read_json(path: Any) -> dict[str, Any]:
    """A JSON file of a checkpoint directory (local or ``gs://``), named when absent."""
    path = as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {os.fspath(path)!r}")
    return json.loads(path.read_text())


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors file names of a checkpoint directory (local or ``gs://``): those its
    sharded index names, else the single file; an indexed shard that is absent is refused."""
    root = as_path(path)
    if (root / _INDEX).is_file():
        files = sorted(set(read_json(root / _INDEX)["weight_map"].values()))
    elif (root / _SINGLE).is_file():
        files = [_SINGLE]
    else:
        raise FileNotFoundError(f"no {_SINGLE} or {_INDEX} in checkpoint directory {str(path)!r}")
    for name in files:
        if not (root / name).is_file():
            raise FileNotFoundError(
                f"shard {name!r} listed in {_INDEX} is missing from {str(path)!r}"
            )
    return files


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a local checkpoint directory (single file or sharded index), as NumPy."""
    tensors: dict[str, np.ndarray] = {}
    for name in checkpoint_files(path):
        with safe_open(os.path.join(path, name), framework="np") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                tensors[key] = f.get_tensor(key)
    return tensors


def load_hf_checkpoint(
    path: str | os.PathLike, dtype: Any = jnp.float32, **config_overrides: Any
) -> tuple[ModelConfig, Transformer]:
    """Load an HF checkpoint directory; params and compute in ``dtype`` unless overridden."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path!r}")
    overrides = {"dtype": dtype, "param_dtype": dtype, **config_overrides}
    config = config_from_hf(read_json(os.path.join(path, "config.json")), **overrides)
    params = hf_to_params(read_safetensors(path), config)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    expected = nnx.to_pure_dict(abstract)

    def place(key_path, want, got):
        name = ".".join(str(getattr(k, "key", k)) for k in key_path)
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(
                f"param {name}: checkpoint shape {tuple(got.shape)} != model shape "
                f"{tuple(want.shape)} for this config.json"
            )
        return jnp.asarray(got, dtype=want.dtype)

    loaded = jax.tree_util.tree_map_with_path(place, expected, params)
    nnx.replace_by_pure_dict(abstract, loaded)
    return config, nnx.merge(graphdef, abstract)


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be > 0 bytes, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r} must be bytes (int) or like '500MB', '2GB'")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3}[unit[0]]
    return int(float(m.group(1)) * base**power)


def save_hf_checkpoint(
    model: Transformer | nnx.State,
    config: ModelConfig,
    path: str | os.PathLike,
    max_shard_size: int | str = "5GB",
) -> list[str]:
    """Write ``config.json`` and safetensors (sharded with an index past ``max_shard_size``).

    ``model`` is a ``Transformer`` or its params ``nnx.State`` (sharded arrays are gathered to
    the host). Returns the written file names. Tensors are written in the checkpoint's own
    dtype (``config.checkpoint_dtype``, the imported ``torch_dtype``: a bf16 checkpoint
    trained with fp32 masters exports as bf16), else in the params' dtype.
    """
    path = os.fspath(path)
    limit = _parse_size(max_shard_size)
    state = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    os.makedirs(path, exist_ok=True)
    tensors = params_to_hf(params, config)
    if config.checkpoint_dtype is not None:
        store = jnp.dtype(config.checkpoint_dtype)
        tensors = {k: np.asarray(v).astype(store) for k, v in tensors.items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2)
    meta = {"format": "pt"}  # transformers refuses safetensors files without it
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, _SINGLE), metadata=meta)
        return ["config.json", _SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, os.path.join(path, name), metadata=meta)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    index["weight_map"] = weight_map
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return ["config.json", *names, _INDEX]
