"""Sources: seeded epoch walk, exact cursor resume, tfds/text-file backends, bad input."""

import json

import numpy as np
import pytest

from jaxrl_orch.data.sources import (
    DatasetSource,
    EpochCursor,
    TextFileSource,
    make_source,
    text_split_of,
)
from jaxrl_orch.types import Source


def test_cursor_epochs_are_seeded_permutations():
    cur = EpochCursor(10, seed=4)
    epochs = [[cur.next_index() for _ in range(10)] for _ in range(3)]
    for e, order in enumerate(epochs):
        assert sorted(order) == list(range(10))
        assert order == np.random.default_rng([4, e]).permutation(10).tolist()
    assert epochs[0] != epochs[1]
    plain = EpochCursor(4, shuffle=False)
    assert [plain.next_index() for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="empty dataset \\(size=0\\)"):
        EpochCursor(0)


@pytest.mark.parametrize("k", [0, 1, 7, 10, 23])
def test_resume_is_exact(k):
    records = [{"text": f"s{i}"} for i in range(10)]
    src = DatasetSource(records, seed=11)
    for _ in range(k):
        src.next_example()
    state = json.loads(json.dumps(src.state()))  # checkpointable as plain JSON
    expected = [src.next_example() for _ in range(15)]
    fresh = DatasetSource(records, seed=11)
    fresh.restore(state)
    assert [fresh.next_example() for _ in range(15)] == expected


def test_restore_rejects_other_data_or_seed():
    records = [{"text": "a"}, {"text": "b"}, {"text": "c"}]
    state = DatasetSource(records, seed=1).state()
    with pytest.raises(ValueError, match="saved for .*'seed': 1.* has .*'seed': 2"):
        DatasetSource(records, seed=2).restore(state)
    with pytest.raises(ValueError, match="'size': 3"):
        DatasetSource(records[:2], seed=1).restore(state)
    with pytest.raises(ValueError, match="missing keys \\['index'\\]"):
        DatasetSource(records, seed=1).restore({k: v for k, v in state.items() if k != "index"})
    with pytest.raises(ValueError, match="bad cursor.*index=9"):
        DatasetSource(records, seed=1).restore({**state, "index": 9})


def test_bundled_source_gives_plain_examples(data_dir, tiny_arith):
    src = make_source("arithmetic", split="eval", data_dir=data_dir, config=tiny_arith, seed=3)
    assert isinstance(src, Source) and len(src) == 30
    ex = src.next_example()
    assert set(ex) == {"question", "answer"}
    assert isinstance(ex["question"], str) and type(ex["answer"]) is int
    seen = [ex] + [src.next_example() for _ in range(29)]
    assert len({e["question"] for e in seen}) == 30  # one epoch covers every record once


def test_field_mapping_and_any_prepared_tfds_dataset(data_dir, tiny_reverse):
    # Opened by its tfds name/config from data_dir, like any prepared tfds dataset.
    src = make_source(
        "jaxrl_reverse_text/tiny_test",
        split="train",
        data_dir=data_dir,
        fields={"sentence": "text"},
    )
    ex = src.next_example()
    assert set(ex) == {"sentence"} and isinstance(ex["sentence"], str)
    with pytest.raises(
        ValueError,
        match="\\['nope'\\] that 'reverse_text:train' lacks; available fields: \\['text'\\]",
    ):
        make_source("reverse_text", data_dir=data_dir, config=tiny_reverse, fields={"text": "nope"})


def test_unknown_tfds_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot open tfds dataset 'no_such_set' split 'train'"):
        make_source("no_such_set", data_dir=tmp_path)
    with pytest.raises(ValueError, match="config= applies to bundled"):
        make_source("no_such_set", data_dir=tmp_path, config="x")


def test_text_file_source(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first line\n\n  second  \nthird\n", encoding="utf-8")
    src = TextFileSource(path, shuffle=False)
    assert [src.next_example() for _ in range(4)] == [
        {"text": "first line"},
        {"text": "second"},
        {"text": "third"},
        {"text": "first line"},
    ]
    tagged = TextFileSource(path, shuffle=False, extra={"env": "reverse_text"})
    assert tagged.next_example() == {"text": "first line", "env": "reverse_text"}
    shuffled = TextFileSource(path, field="question", seed=2)
    shuffled.next_example()
    resumed = TextFileSource(path, field="question", seed=2)
    resumed.restore(shuffled.state())
    assert [resumed.next_example() for _ in range(5)] == [shuffled.next_example() for _ in range(5)]
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        TextFileSource(tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="blank.txt' has no non-empty lines"):
        TextFileSource(tmp_path / "blank.txt")
    with pytest.raises(ValueError, match="'test'"):
        TextFileSource(path, split="test")


def test_text_file_splits_are_disjoint_stable_and_reachable_by_name(tmp_path):
    lines = [f"sentence number {i}" for i in range(200)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines + lines[:20]) + "\n", encoding="utf-8")  # 20 repeats

    def texts(src):
        return {ex["text"] for ex in src.data}

    train = make_source(f"text:{path}", split="train")
    held_out = make_source(str(path), split="eval")  # a *.txt name needs no prefix
    assert texts(train).isdisjoint(texts(held_out))
    assert texts(train) | texts(held_out) == set(lines)  # every distinct line, once
    assert len(train) + len(held_out) == 200
    assert 8 <= len(held_out) <= 35  # about one in TEXT_EVAL_BUCKETS
    assert all(text_split_of(t) == "eval" for t in texts(held_out))
    # Appending lines never moves an existing line to the other side.
    path.write_text("\n".join(lines + ["a new one", "and another"]) + "\n", encoding="utf-8")
    assert texts(held_out) <= texts(make_source(str(path), split="eval"))
    assert len(make_source(str(path), split="all")) == 202

    tiny = tmp_path / "one.txt"
    tiny.write_text("just one line\n", encoding="utf-8")
    side = text_split_of("just one line")
    empty = "eval" if side == "train" else "train"
    with pytest.raises(ValueError, match=f"no line in its '{empty}' split.*eval_dataset"):
        make_source(str(tiny), split=empty)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        make_source(f"text:{tmp_path / 'nope.txt'}")
    with pytest.raises(ValueError, match="takes no config or fields"):
        make_source(str(path), fields={"text": "line"})


def test_a_text_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"one fine line\nanother\n\xff\xfebinary garbage\n")
    with pytest.raises(ValueError, match=r"mixed.txt' is not UTF-8 text: byte 22 \(line 3\)"):
        TextFileSource(path)
