"""tfds builders: array_record files, disjoint splits, build-once caching, no TensorFlow."""

import os
import subprocess
import sys
import textwrap

import pytest

from jaxrl_orch.data.builders import load_split, prepare, split_pool
from jaxrl_orch.data.sentences import read_corpus


def _all(ds):
    return [ds[i] for i in range(len(ds))]


def test_reverse_text_splits_disjoint_and_from_corpus(data_dir, tiny_reverse):
    train = [
        r["text"].decode()
        for r in _all(load_split("reverse_text", "train", data_dir, tiny_reverse))
    ]
    eval_ = [
        r["text"].decode() for r in _all(load_split("reverse_text", "eval", data_dir, tiny_reverse))
    ]
    assert (len(train), len(eval_)) == (160, 40)
    assert len(set(train)) == 160 and len(set(eval_)) == 40
    assert not set(train) & set(eval_)
    assert set(train) | set(eval_) <= set(read_corpus())


def test_arithmetic_splits_disjoint_and_correct(data_dir, tiny_arith):
    train = _all(load_split("jaxrl_arithmetic", "train", data_dir, tiny_arith))
    eval_ = _all(load_split("arithmetic", "eval", data_dir, tiny_arith))
    assert (len(train), len(eval_)) == (120, 30)
    tq = {r["question"].decode() for r in train}
    eq = {r["question"].decode() for r in eval_}
    assert len(tq) == 120 and len(eq) == 30 and not tq & eq
    for r in train[:20]:
        a, op, b = _split_binary(r["question"].decode())
        assert r["answer"] == {"+": a + b, "-": a - b, "*": a * b}[op]


def _split_binary(q):
    for i, c in enumerate(q[1:], 1):
        if c in "+-*":
            return int(q[:i]), c, int(q[i + 1 :])
    raise AssertionError(q)


def test_files_are_array_record_and_built_once(data_dir, tiny_arith):
    builder = prepare("arithmetic", data_dir, tiny_arith)
    files = sorted(p.name for p in builder.data_path.iterdir())
    assert any(".array_record-" in f and "-train." in f for f in files), files
    record_files = [p for p in builder.data_path.iterdir() if ".array_record-" in p.name]
    mtimes = {p: os.stat(p).st_mtime_ns for p in record_files}
    prepare("arithmetic", data_dir, tiny_arith)
    assert {p: os.stat(p).st_mtime_ns for p in record_files} == mtimes


def test_split_pool_disjoint_and_seeded():
    items = list(range(100))
    train, eval_ = split_pool(items, 10, seed=1)
    assert len(eval_) == 10 and sorted(train + eval_) == items
    assert split_pool(items, 10, seed=1) == (train, eval_)
    assert split_pool(items, 10, seed=2)[1] != eval_
    with pytest.raises(ValueError, match="num_eval must be in \\[1, 99\\].*got 100"):
        split_pool(items, 100, seed=0)


def test_bad_names(tmp_path, tiny_arith):
    with pytest.raises(ValueError, match="unknown bundled dataset 'mnist'.*arithmetic"):
        prepare("mnist", tmp_path)
    with pytest.raises(ValueError, match="unknown config 'hard'.*easy"):
        prepare("arithmetic", tmp_path, "hard")
    with pytest.raises(ValueError, match="unknown split 'test'.*eval"):
        load_split("arithmetic", "test", tmp_path, tiny_arith)


def test_build_and_read_never_import_tensorflow(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from jaxrl_orch.data.builders import ArithmeticConfig, load_split
        cfg = ArithmeticConfig(name="no_tf", num_train=20, num_eval=5)
        ds = load_split("arithmetic", "train", {str(tmp_path)!r}, cfg)
        assert len(ds) == 20 and int(ds[3]["answer"]) == ds[3]["answer"]
        bad = sorted(m for m in sys.modules if m == "tensorflow" or m.startswith("tensorflow."))
        assert not bad, bad
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("OK")
