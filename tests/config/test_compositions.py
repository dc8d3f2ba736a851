"""Configs compose by concern: every shipped model x slice x env x tune x algo file builds a
valid config in any order, each file binds only its own concern's settings, and a combination
that cannot work is refused before any work, naming the files and the setting."""

from __future__ import annotations

import itertools
import re

import pytest
from support.checkout import ROOT

from jaxrl_orch.config.concerns import CONCERNS, concern_of
from jaxrl_orch.tools.aot import TOPOLOGY_RE
from jaxrl_orch.train import load_config

FILES = {
    c: sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs" / c).glob("*.gin"))
    for c in CONCERNS
}
NAMED = ["CHECKPOINT = 'gs://bucket/Qwen2.5-0.5B-Instruct'"]  # what model/checkpoint.gin reads


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    import gin

    monkeypatch.chdir(ROOT)  # includes are relative to the repository root
    yield
    gin.clear_config()


def test_every_concern_ships_its_files():
    names = {c: {f.rsplit("/", 1)[1] for f in files} for c, files in FILES.items()}
    assert {"tiny_byte.gin", "checkpoint.gin", "llama3.1_8b.gin", "qwen3_8b.gin"} <= names["model"]
    assert {"cpu.gin", "v5e_8.gin", "v6e_8.gin", "v5e_16.gin"} <= names["slice"]
    assert {"reverse_text.gin", "verifiers.gin"} <= names["env"]
    assert {"full.gin", "lora.gin", "qlora.gin"} <= names["tune"]
    assert names["algo"]
    for files in FILES.values():
        for f in files:
            assert (ROOT / f).read_text().startswith("#"), f  # each says what it holds and why


def test_every_combination_composes_in_any_order():
    combos = list(itertools.product(*FILES.values()))
    assert len(combos) >= 6 * 4 * 2 * 3 * 2
    for combo in combos:
        files = list(combo)
        named = NAMED if combo[0].endswith("checkpoint.gin") else []
        cfg = load_config(files, named)
        # each concern's file decided what it owns, whatever the order
        assert cfg == load_config(files[::-1], named), combo
        tune = combo[3]
        assert (cfg.lora.rank > 0) == ("lora" in tune), combo
        assert (cfg.lora.quantize == "int8") == tune.endswith("qlora.gin"), combo
        assert (cfg.data.env == "verifiers") == combo[2].endswith("verifiers.gin"), combo
        assert cfg.rl.max_new_tokens < cfg.trainer.row_len, combo


@pytest.mark.parametrize("path", [f for files in FILES.values() for f in files])
def test_a_concern_file_binds_only_its_own_concern(path):
    from gin import config as gin_config
    from gin import config_parser

    concern = path.split("/")[1]
    text = (ROOT / path).read_text()
    for s in config_parser.ConfigParser(text, gin_config.ParserDelegate(True)):
        if isinstance(s, config_parser.BindingStatement):
            name = f"{s.selector}.{s.arg_name}" if s.arg_name else s.selector
            assert concern_of(name) == concern, (path, name)


def test_a_slice_file_fills_its_topology():
    """The meshes of every slice file use exactly its chips: a v5e-8 host's 8 split between
    trainer and engine; a multi-host slice's all for the trainer group, a replica's all for
    its engine."""
    for path in FILES["slice"]:
        cfg = load_config(["configs/model/tiny_byte.gin", path], [])
        p = cfg.processes
        if p.tpu_topology is None:
            continue
        chips = lambda t: int(TOPOLOGY_RE.match(t)[2]) * int(TOPOLOGY_RE.match(t)[3])  # noqa: E731
        size = lambda mesh: int(__import__("math").prod(n for _, n in mesh))  # noqa: E731
        if p.engine_replicas:
            assert size(cfg.trainer.mesh) == chips(p.tpu_topology), path
            assert size(cfg.engine.mesh) == chips(p.replica_topology or p.tpu_topology), path
        else:
            assert size(cfg.trainer.mesh) + size(cfg.engine.mesh) == chips(p.tpu_topology), path


def test_files_that_disagree_are_refused_naming_both_and_the_setting():
    # The run a user tried: the 8B LoRA recipe beside the verifiers recipe. gin alone let the
    # later file win silently (reverse-text, or the tiny model).
    for files in (
        ["configs/tpu_v5e_8_lora.gin", "configs/verifiers.gin"],
        ["configs/verifiers.gin", "configs/tpu_v5e_8_lora.gin"],
    ):
        with pytest.raises(ValueError) as err:
            load_config(files, [])
        message = str(err.value)
        assert re.search(r"^(Model.name|Data.env) is bound to", message), message
        assert "(included by configs/verifiers.gin)" in message
        assert "(included by configs/tpu_v5e_8_lora.gin)" in message
    # two files of one concern
    with pytest.raises(
        ValueError,
        match=r"Processes.tpu_topology is bound to .* by configs/slice/v5e_8.gin:\d+ and to",
    ):
        load_config(["configs/slice/v5e_8.gin", "configs/slice/v5e_16.gin"], [])
    # the command line overrides any file
    cfg = load_config(["configs/tpu_v5e_8_lora.gin"], ["Engine.slots = 8", "CHECKPOINT = '/c'"])
    assert (cfg.engine.slots, cfg.model.name) == (8, "/c")


def test_a_file_in_a_concern_directory_binding_another_concern_is_refused(tmp_path):
    (tmp_path / "slice").mkdir()
    bad = tmp_path / "slice" / "mine.gin"
    bad.write_text("Trainer.row_len = 512\nData.env = 'reverse_text'\n")
    with pytest.raises(ValueError) as err:
        load_config([str(bad)], [])
    message = str(err.value)
    assert f"{bad}:2 binds Data.env" in message and "a file in a 'slice' directory" in message
    assert "Data.env is the 'env' concern's (env/*.gin), or --gin_param's" in message


def test_a_combination_that_cannot_work_names_the_files_it_came_from(tmp_path):
    (tmp_path / "env").mkdir()
    long = tmp_path / "env" / "long_answers.gin"
    long.write_text("Data.env = 'reverse_text'\nRL.max_new_tokens = 512\n")
    with pytest.raises(ValueError) as err:
        load_config(["configs/model/tiny_byte.gin", "configs/slice/cpu.gin", str(long)], [])
    message = str(err.value)
    assert "RL.max_new_tokens (512) must be < Trainer.row_len (256)" in message
    assert f"RL.max_new_tokens = 512 ({long}:2)" in message
    assert re.search(r"Trainer.row_len = 256 \(configs/slice/cpu.gin:\d+\)", message)


def test_a_preset_without_weights_and_an_unnamed_checkpoint_say_what_to_set():
    from jaxrl_orch.compose.model import check_weights

    with pytest.raises(ValueError, match=r"reads %CHECKPOINT, which no gin file or binding sets"):
        load_config(["configs/model/checkpoint.gin"], [])
    cfg = load_config(["configs/model/llama3.1_8b.gin"], [])
    with pytest.raises(ValueError, match=r"set CHECKPOINT='/path/or/gs://bucket/dir'"):
        check_weights(cfg.model)
    cfg = load_config(["configs/model/llama3.1_8b.gin"], ["CHECKPOINT = 'gs://b/Llama'"])
    assert cfg.model.name == "gs://b/Llama"
    check_weights(cfg.model)


def test_an_include_may_be_refined_below_it_but_not_undo_a_binding_above_it(tmp_path):
    ok = tmp_path / "recipe.gin"
    ok.write_text("include 'configs/algo/grpo.gin'\nOrchestrator.max_staleness = 3\n")
    assert load_config([str(ok)], []).orchestrator.max_staleness == 3
    bad = tmp_path / "undone.gin"
    bad.write_text("Orchestrator.max_staleness = 3\ninclude 'configs/algo/grpo.gin'\n")
    with pytest.raises(
        ValueError, match=r"undone.gin:1 binds Orchestrator.max_staleness = 3 above"
    ):
        load_config([str(bad)], [])
    loop = tmp_path / "loop.gin"
    loop.write_text(f"include '{loop}'\n")
    with pytest.raises(ValueError, match="includes itself"):
        load_config([str(loop)], [])


def test_a_malformed_binding_names_where_it_is(tmp_path):
    with pytest.raises(ValueError, match=r"bad gin config in --gin_param 'RL.steps = '"):
        load_config(["configs/algo/grpo.gin"], ["RL.steps = "])
    bad = tmp_path / "bad.gin"
    bad.write_text("RL.steps = (\n")
    with pytest.raises(ValueError, match=f"bad gin config in {bad}"):
        load_config([str(bad)], [])
