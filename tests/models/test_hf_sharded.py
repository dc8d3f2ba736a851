"""``HFCheckpoint``: an HF checkpoint read straight onto the trainer's mesh, each device its shard.

The checkpoint is a Llama-3-layout model (llama3 RoPE, untied head, grouped kv heads) with
random weights everywhere (norms too, so a swapped name shows), written sharded over several
files. What it must do: give ``load_hf_checkpoint``'s arrays bit for bit, each device holding
only its shard, on the trainer's shardings (``initial_params``, LoRA's base too) and on the
engine's (``to_engine``); give the same bits from ``gs://`` (the local emulator), each byte read
once, not once per device; and refuse each bad input with one line naming it, before any array
is built.
"""

from __future__ import annotations

import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from safetensors import safe_open
from safetensors.numpy import save_file
from support.gcs_emulator import BUCKET

from jaxrl_orch.compose.engines import to_engine
from jaxrl_orch.compose.model import pretrained_params
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.models import hf_sharded
from jaxrl_orch.models.configs import ModelConfig, RopeScaling
from jaxrl_orch.models.hf_import import load_hf_checkpoint, save_hf_checkpoint
from jaxrl_orch.models.hf_sharded import HFCheckpoint
from jaxrl_orch.models.lora_config import LoraConfig
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.paths import as_path, copy_tree
from jaxrl_orch.trainer import optim as optim_lib
from jaxrl_orch.trainer import step as step_lib
from jaxrl_orch.trainer.params import initial_params
from jaxrl_orch.trainer.programs import build_programs

LLAMA3 = ModelConfig(
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,  # 2 kv heads on tp 4: the rules shard head_dim instead (a cut inside a head)
    head_dim=16,
    d_ff=128,
    tie_embeddings=False,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
    ),
)
INDEX = "model.safetensors.index.json"


def _write(path, dtype=jnp.float32, seed=0):
    """A checkpoint of random weights in ``dtype``, in several files; returns its index."""
    config = dataclasses.replace(LLAMA3, dtype=dtype, param_dtype=dtype)
    state = nnx.state(Transformer(config, rngs=nnx.Rngs(seed)), nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), state)
    names = save_hf_checkpoint(state, config, path, max_shard_size="40KB")
    assert len(names) > 4  # config.json, the index and at least three files
    return json.loads((path / INDEX).read_text())["weight_map"]


def _mesh():
    """The trainer's (fsdp, tp) mesh over all 8 devices."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tp"))


def _trainer(config):
    """The trainer's abstract params and their shardings on a (fsdp 2, tp 4) mesh."""
    mesh = _mesh()
    programs = build_programs(
        config, mesh, step_lib.StepConfig(), optim_lib.OptimConfig(), row_len=16
    )
    return programs.abstract_params, programs.param_shardings


def _leaves(tree):
    """Leaves by their dict keys (a sharding tree holds them bare, a params tree in Params)."""
    flat = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, Sharding))
    dict_keys = lambda path: tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
    return {dict_keys(path): leaf for path, leaf in flat}


@pytest.mark.parametrize(
    "store, params",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("bfloat16", "float32"),
        ("float32", "bfloat16"),
    ],
)
def test_the_trainer_mesh_gets_the_whole_read_bits_each_device_its_shard(tmp_path, store, params):
    _write(tmp_path, jnp.dtype(store))
    ckpt = HFCheckpoint(tmp_path)
    config = ckpt.config(dtype=params, param_dtype=params)
    abstract, shardings = _trainer(config)
    got = _leaves(ckpt.load(abstract, shardings))
    _, model = load_hf_checkpoint(tmp_path, dtype=jnp.dtype(params))
    want = _leaves(nnx.state(model, nnx.Param))
    assert got.keys() == want.keys() and len(got) == 2 + 1 + 2 * 9
    sharded = 0
    for key, sharding in _leaves(shardings).items():
        array = got[key]
        assert array.sharding == sharding and array.dtype == jnp.dtype(params), str(key)
        bits = lambda x: np.asarray(x).view(np.uint8)  # bit for bit: -0.0 is not 0.0 here
        np.testing.assert_array_equal(bits(array), bits(want[key]), err_msg=str(key))
        for shard in array.addressable_shards:
            assert shard.data.shape == sharding.shard_shape(array.shape), str(key)
        sharded += sharding.shard_shape(array.shape) != array.shape
    assert sharded >= 2 + 2 * 7  # every matrix is cut; only the norms may be whole


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=2)])
def test_a_trainer_starts_from_the_handle_model_name_gives(tmp_path, lora):
    """``Model.name`` -> ``pretrained_params`` (a handle, nothing read) -> ``initial_params``
    reads it onto the trainer's shardings (LoRA: the frozen base's)."""
    _write(tmp_path)
    handle = pretrained_params(str(tmp_path))
    assert isinstance(handle, HFCheckpoint)
    config = dataclasses.replace(handle.config(), lora=lora)
    programs = build_programs(config, _mesh(), step_lib.StepConfig(), optim_lib.OptimConfig())
    params, frozen = initial_params(programs, config, _mesh(), 0, handle)
    base = params if lora is None else frozen
    shardings = programs.param_shardings if lora is None else programs.base_shardings
    got, want = _leaves(base), _leaves(nnx.state(load_hf_checkpoint(tmp_path)[1], nnx.Param))
    assert got.keys() == want.keys()
    for key, sharding in _leaves(shardings).items():
        assert got[key].sharding == sharding, str(key)
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), str(key))


def test_the_engine_reads_the_handle_onto_its_shardings_in_its_dtype(tmp_path):
    """``serve``'s path: ``to_engine`` of the handle, on the decode mesh (tp 4) in bf16."""
    _write(tmp_path)
    handle = pretrained_params(str(tmp_path))
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    engine = DecodeEngine(handle.config(), mesh=mesh, param_dtype=jnp.bfloat16)
    got = _leaves(to_engine(handle, engine))
    want = _leaves(nnx.state(load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)[1], nnx.Param))
    assert got.keys() == want.keys()
    for key, sharding in _leaves(engine.param_shardings).items():
        assert got[key].sharding == sharding and got[key].dtype == jnp.bfloat16, str(key)
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), str(key))


def _count_reads(monkeypatch, ckpt):
    """Bytes ``ckpt`` reads per file, every read counted where the bytes come in."""
    counts: collections.Counter = collections.Counter()
    read = ckpt.files.read_range

    def counted(name, start, stop, **kwargs):
        data = read(name, start, stop, **kwargs)
        counts[name] += len(data)
        return data

    monkeypatch.setattr(ckpt.files, "read_range", counted)
    return counts


def _headers(path, files):
    """Bytes of the files' headers (the 8-byte length and the JSON)."""
    return sum(8 + int.from_bytes((path / f).read_bytes()[:8], "little") for f in files)


def test_gs_gives_the_same_bits_each_byte_read_once(gcs, tmp_path, monkeypatch):
    weight_map = _write(tmp_path, jnp.bfloat16)
    files = set(weight_map.values())
    headers = _headers(tmp_path, files)
    tensors = json.loads((tmp_path / INDEX).read_text())["metadata"]["total_size"]
    url = f"gs://{BUCKET}/ckpt-{tmp_path.name}"
    copy_tree(tmp_path, url)
    local = HFCheckpoint(tmp_path)
    config = local.config(dtype="bfloat16", param_dtype="bfloat16")
    abstract, shardings = _trainer(config)
    want = _leaves(local.load(abstract, shardings))
    remote = HFCheckpoint(url)
    counts = _count_reads(monkeypatch, remote)
    got = _leaves(remote.load(abstract, shardings))
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))
    # On (fsdp 2, tp 4) most HF tensors are cut on both axes: the devices cut from the same rows
    # share one read of them, replicated norms are read once, so every byte crosses once.
    assert set(counts) == files and sum(counts.values()) == headers + tensors

    # The embedding and lm_head, vocab over 8 devices (their first HF axis): each byte of them
    # is read once, not once per device; beyond that only the files' headers are read.
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    counts.clear()
    remote.load(
        {"embed": bf16(256, 64), "lm_head": bf16(64, 256)},
        {  # ours [E, V] is HF [V, E]: vocab is its rows too
            "embed": NamedSharding(mesh, PartitionSpec("x", None)),
            "lm_head": NamedSharding(mesh, PartitionSpec(None, "x")),
        },
    )
    assert sum(counts.values()) - headers == 2 * 256 * 64 * 2


def test_a_tensor_read_locally_is_read_once_per_distinct_box(tmp_path, monkeypatch):
    """Devices that hold the same box (the replicated axis) share one read: 8 devices on a
    (2, 4) mesh, the embedding cut 2 ways by rows, replicated 4 ways: 2 reads of half each."""
    _write(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    boxes = []
    read = ckpt.read
    monkeypatch.setattr(ckpt, "read", lambda n, i, box: boxes.append(box) or read(n, i, box))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    embed = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    ckpt.load({"embed": embed}, NamedSharding(mesh, PartitionSpec("a", None)))
    assert sorted(boxes) == [((0, 128), (0, 64)), ((128, 256), (0, 64))]


def test_a_local_load_reads_byte_ranges_each_once_never_mapping_a_file(tmp_path, monkeypatch):
    """Local files are read as gs:// ones are: by range, each byte once, and never mmapped
    (the mapped pages would count in the process's RSS); the bits are the files'."""
    weight_map = _write(tmp_path, jnp.bfloat16)
    files = set(weight_map.values())
    tensors = json.loads((tmp_path / INDEX).read_text())["metadata"]["total_size"]
    ckpt = HFCheckpoint(tmp_path)
    counts = _count_reads(monkeypatch, ckpt)
    mapped = []
    read = ckpt.read

    def read_box(name, info, box):
        data = read(name, info, box)
        with open("/proc/self/maps") as f:
            mapped.extend(line for line in f if str(tmp_path) in line)
        return data

    monkeypatch.setattr(ckpt, "read", read_box)
    config = ckpt.config(dtype="bfloat16", param_dtype="bfloat16")
    abstract, shardings = _trainer(config)
    got = _leaves(ckpt.load(abstract, shardings))
    want = _leaves(nnx.state(load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)[1], nnx.Param))
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), str(key))
    assert mapped == []
    assert set(counts) == files and sum(counts.values()) == _headers(tmp_path, files) + tensors


def test_rows_read_in_small_chunks_give_the_same_bits_each_byte_once(tmp_path, monkeypatch):
    """A chunk of one row (one head where rows are heads) at a time, each cut into every box of
    its group and cast there (float32 stored, bf16 params): the same bits, each byte read once,
    no read past one step of rows."""
    weight_map = _write(tmp_path)
    files = set(weight_map.values())
    tensors = json.loads((tmp_path / INDEX).read_text())["metadata"]["total_size"]
    monkeypatch.setattr(hf_sharded, "_CHUNK", 1)
    ckpt = HFCheckpoint(tmp_path)
    sizes = []
    read = ckpt.files.read_range

    def read_range(name, start, stop, **kwargs):
        data = read(name, start, stop, **kwargs)
        sizes.append((start, len(data)))
        return data

    monkeypatch.setattr(ckpt.files, "read_range", read_range)
    config = ckpt.config(dtype="bfloat16", param_dtype="bfloat16")
    abstract, shardings = _trainer(config)
    got = _leaves(ckpt.load(abstract, shardings))
    want = _leaves(nnx.state(load_hf_checkpoint(tmp_path, dtype=jnp.bfloat16)[1], nnx.Param))
    bits = lambda x: np.asarray(x).view(np.uint8)
    for key in want:
        np.testing.assert_array_equal(bits(got[key]), bits(want[key]), err_msg=str(key))
    tensor_reads = [n for start, n in sizes if start > 8]  # past each file's header length
    assert sum(n for _, n in sizes) == _headers(tmp_path, files) + tensors
    # The widest HF row is d_ff float32s (512 B), a head's rows 16 x 64 of them (4 KB); the
    # smallest matrix is 32 KB.
    assert max(tensor_reads) <= 16 * 64 * 4 < 64 * 128 * 4


def _rewrite(path, weight_map, name, tensor=None):
    """Rewrite the file holding ``name`` with it replaced by ``tensor`` (None: without it)."""
    file = path / weight_map[name]
    with safe_open(file, framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not iterable
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})
    return weight_map[name]


def _refused(path, match, exc=ValueError):
    """Loading ``path`` onto the trainer mesh fails with ``match``, before any array is built."""
    ckpt = HFCheckpoint(path)
    ckpt._build = lambda *_: pytest.fail("an array was built before the checks")
    abstract, shardings = _trainer(LLAMA3)
    with pytest.raises(exc, match=match) as info:
        ckpt.load(abstract, shardings)
    assert "\n" not in str(info.value)


UP = "model.layers.1.mlp.up_proj.weight"


def test_a_missing_config_or_shard_file_is_named(tmp_path):
    weight_map = _write(tmp_path)
    (tmp_path / weight_map[UP]).unlink()
    _refused(tmp_path, rf"shard '{weight_map[UP]}' listed in {INDEX} is missing", FileNotFoundError)
    (tmp_path / "config.json").unlink()
    _refused(tmp_path, r"checkpoint file not found: '.*config\.json'", FileNotFoundError)
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: '.*nowhere'"):
        HFCheckpoint(tmp_path / "nowhere")


def test_a_missing_misshapen_or_non_float_tensor_is_named(tmp_path):
    weight_map = _write(tmp_path)
    _rewrite(tmp_path, weight_map, UP)
    _refused(tmp_path, rf"checkpoint '.*' is missing tensor '{UP}'", KeyError)
    file = _rewrite(tmp_path, weight_map, UP, np.zeros((128, 32), np.float32))
    _refused(
        tmp_path,
        rf"tensor '{UP}' in '{file}' has shape \(128, 32\), param "
        r"layers/1/mlp/up_proj needs \(128, 64\)",
    )
    file = _rewrite(tmp_path, weight_map, UP, np.zeros((128, 64), np.int32))
    _refused(tmp_path, rf"tensor '{UP}' in '{file}' is stored as I32; expected one of")


def test_a_missing_gs_checkpoint_is_named(gcs, tmp_path):
    with pytest.raises(
        FileNotFoundError, match=f"checkpoint directory not found: 'gs://{BUCKET}/no"
    ):
        HFCheckpoint(f"gs://{BUCKET}/no-such-checkpoint")
    _write(tmp_path)
    url = f"gs://{BUCKET}/noconfig-{tmp_path.name}"
    copy_tree(tmp_path, url)
    (as_path(url) / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"checkpoint file not found: '{url}/config.json'"):
        HFCheckpoint(url).config()


def test_a_truncated_gs_file_is_named(gcs, tmp_path):
    weight_map = _write(tmp_path)
    url = f"gs://{BUCKET}/truncated-{tmp_path.name}"
    copy_tree(tmp_path, url)
    file = weight_map[UP]
    (as_path(url) / file).write_bytes((tmp_path / file).read_bytes()[:-100])
    abstract, shardings = _trainer(LLAMA3)
    with pytest.raises(ValueError, match=rf"'{file}' in '{url}' is truncated"):
        HFCheckpoint(url).load(abstract, shardings)
