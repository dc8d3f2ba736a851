"""WandbWriter against a real offline W&B run: the rows land in the run's transaction log.

W&B offline (``WANDB_MODE=offline``, ``WANDB_DIR`` in tmp_path) writes everything a sync would
upload to ``wandb/offline-run-*/run-<id>.wandb``: a log of protobuf ``Record``s in LevelDB log
framing (a 7-byte file header; 32 KiB blocks; per chunk a CRC-32 of type byte + data, a length
and a type: full, first, middle, last). The test reads that file back with W&B's own protobuf
classes and checks every history row the writer logged, and the run's name, config and step
axis.
"""

from __future__ import annotations

import glob
import json
import math
import struct
import sys
import zlib

import pytest
from wandb.proto import wandb_internal_pb2 as pb  # the dev extra has wandb: no skip

from jaxrl_orch.orchestrator.metrics.wandb import STEP_KEY, WandbWriter
from jaxrl_orch.types import MetricsWriter

_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(name, value)
    return tmp_path


def _records(path: str) -> list:
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B", raw[:8]
    pos, buf, out = 7, b"", []
    while pos + _CHUNK.size <= len(raw):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, n, kind = _CHUNK.unpack_from(raw, pos)
        if n == 0 and kind == 0:
            break
        data = raw[pos + _CHUNK.size : pos + _CHUNK.size + n]
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == crc, f"bad chunk at {pos}"
        pos += _CHUNK.size + n
        buf += data
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
        else:
            assert kind in (_FIRST, _MIDDLE), kind
    return out


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_rows_land_in_the_offline_run(offline):
    writer = WandbWriter("jaxrl-test", run_name="tiny", config={"rl_steps": 3, "lr": 1e-6})
    assert isinstance(writer, MetricsWriter)
    rows = [
        (1, {"train/reward_mean": 0.25, "trainer/loss": 1.5}),
        (1, {"eval/reverse_text/reward_mean": 0.5}),  # an eval row repeats the step
        (2, {"train/reward_mean": 0.75, "trainer/loss": float("nan")}),
        (1, {"train/reward_mean": 0.3}),  # a resumed run goes back a step
        (2, {"step": 2.0, "orch/version": 1.0}),  # a step row names its own step
    ]
    for step, metrics in rows:
        writer.write(step, metrics)
    with pytest.raises(ValueError, match=r"'step' \(1.0\) is the W&B step axis .* step 3"):
        writer.write(3, {"step": 1.0})
    with pytest.raises(ValueError, match="must be a real number"):
        writer.write(3, {"x": "high"})
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="is closed"):
        writer.write(4, {"x": 1.0})
    assert writer.rows == len(rows)

    (path,) = glob.glob(str(offline / "wandb" / "offline-run-*" / f"run-{writer.run_id}.wandb"))
    records = _records(path)
    history = [_items(r.history.item) for r in records if r.HasField("history")]
    assert len(history) == len(rows)
    for got, (step, metrics) in zip(history, rows, strict=True):
        assert got[STEP_KEY] == step
        for key, value in metrics.items():
            assert got[key] == value or (math.isnan(value) and math.isnan(got[key])), key
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.project, run.display_name, run.run_id) == ("jaxrl-test", "tiny", writer.run_id)
    assert {"rl_steps": 3, "lr": 1e-6}.items() <= _items(run.config.update).items()
    metrics = [r.metric for r in records if r.HasField("metric")]
    assert any(m.glob_name == "*" and m.step_metric == STEP_KEY for m in metrics)


def test_explicit_offline_mode_and_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    writer = WandbWriter("p", mode="offline", directory=tmp_path / "run" / "wandb_files")
    writer.write(7, {"a": 1.0})
    writer.close()
    (path,) = glob.glob(str(tmp_path / "run" / "wandb_files" / "wandb" / "offline-run-*/*.wandb"))
    history = [_items(r.history.item) for r in _records(path) if r.HasField("history")]
    assert [(h[STEP_KEY], h["a"]) for h in history] == [(7, 1.0)]


def test_bad_settings_are_named(offline):
    with pytest.raises(ValueError, match="wandb project must be a non-empty string, got ''"):
        WandbWriter("")
    with pytest.raises(ValueError, match=r"wandb mode must be one of \(None, 'online'"):
        WandbWriter("p", mode="cloud")


def test_a_missing_wandb_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # ``import wandb`` raises ImportError
    with pytest.raises(ImportError, match=r"jaxrl-orch\[wandb\]"):
        WandbWriter("p")
