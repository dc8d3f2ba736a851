"""``python -m jaxrl_orch.tools.aot``: the TPU configs fit (deviceless compile for v5e / v6e), the
report's contract, and the errors and exit codes.

The TPU compositions (``RUNS``) take minutes each to compile for TPU on 2 CPU cores, so when
``test_tpu_configs_fit`` is selected, ``tests/conftest.py`` starts them, one after the other,
in one background process right after collection (``start_background``): the compiles overlap
the rest of the run, and the test waits for them. A run that deselects the test (the default
``-m "not slow"``) starts nothing; the process group is killed at exit if still running.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest
from support.checkout import ROOT

from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.configs import get_config
from jaxrl_orch.tools import aot, aot_report

CONFIGS = {"v5e": "configs/tpu_v5e_8.gin", "v6e": "configs/tpu_v6e_8.gin"}


def composed(model: str, slice_: str, env: str, tune: str, algo: str = "grpo") -> str:
    """The aot command's arguments for one file of each concern (configs/<concern>/*.gin)."""
    concerns = ("model", "slice", "env", "tune", "algo")
    files = zip(concerns, (model, slice_, env, tune, algo), strict=True)
    return " ".join(f"--gin_file=configs/{c}/{name}.gin" for c, name in files)


# Every compile the slow tests read: name -> the command's arguments. The 8B runs are the
# composition a user trains their own verifiers taskset with.
RUNS = {name: f"--gin_file={cfg}" for name, cfg in CONFIGS.items()}
RUNS["lora"] = composed("llama3.1_8b", "v5e_8", "verifiers", "lora")
RUNS["lora_off"] = composed("llama3.1_8b", "v5e_8", "verifiers", "full")
RUNS["qlora"] = composed("llama3.1_8b", "v5e_8", "verifiers", "qlora")
RUNS["v5e16"] = composed("qwen2.5_0.5b", "v5e_16", "reverse_text", "full")
_OUT = Path(tempfile.mkdtemp(prefix="aot_test_"))
_script = " && ".join(
    f"{sys.executable} -m jaxrl_orch.tools.aot {args} --json > {_OUT / name}.json "
    f"2> {_OUT / name}.err; echo $? > {_OUT / name}.rc; true"
    for name, args in RUNS.items()
)
_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # no 8 fake CPU devices needed
_BG: subprocess.Popen | None = None


def start_background() -> subprocess.Popen:
    """Start both compiles once (idempotent); returns the background process."""
    global _BG
    if _BG is None:
        _BG = subprocess.Popen(["sh", "-c", _script], cwd=ROOT, env=_env, start_new_session=True)
        atexit.register(_stop_background)
    return _BG


def _stop_background() -> None:
    # The shell leads its own session: kill the whole group, or its compiler child outlives it.
    if _BG is not None and _BG.poll() is None:
        os.killpg(_BG.pid, signal.SIGKILL)


PROGRAMS = ("train_step", "prefill", "decode_step", "reshard")


@pytest.mark.slow
def test_tpu_configs_fit():
    """Both configs compile for their topology without a TPU and every program fits within
    90% of the chip's HBM; the JSON carries the documented keys."""
    start_background().wait(timeout=3600)
    for name, cfg in CONFIGS.items():
        rc = int((_OUT / f"{name}.rc").read_text())
        err = (_OUT / f"{name}.err").read_text()
        assert rc == 0, f"{cfg}: exit {rc}\n{err[-3000:]}"
        r = json.loads((_OUT / f"{name}.json").read_text())
        assert r["topology"] == f"{name}:2x4" and r["fits"] is True
        assert r["hbm_bytes_per_chip"] == aot_report.CHIPS[name].hbm_bytes
        assert set(PROGRAMS) <= set(r["programs"])
        for prog, p in r["programs"].items():
            for key in ("bytes_per_chip", "flops", "bytes_accessed", "est_seconds"):
                assert p[key] > 0, (cfg, prog, key)
            assert p["bytes_per_chip"] <= 0.9 * r["hbm_bytes_per_chip"], (cfg, prog)
            # Donated params / optimizer state are counted once, not as argument + output.
            assert p["bytes_per_chip"] >= p["argument_bytes"]
        # The trainer's params + Adam moments (fp32) are donated by the train step.
        assert r["programs"]["train_step"]["alias_bytes"] > 0
        assert r["model_config"]["dtype"] == "bfloat16"
        assert r["model_config"]["attention"] == "splash"
        assert r["engine_param_dtype"] == "bfloat16"
        assert 0 < r["decode"]["fraction_of_hbm_roofline"] <= 1.0


@pytest.mark.slow
def test_the_8b_lora_config_fits_and_every_weight_does_not():
    """Llama-3.1-8B shapes on a v5e-8: with LoRA every program fits (the engine's base copy
    counted), only adapters move; with LoRA off the train step does not fit, and says so."""
    start_background().wait(timeout=3600)
    rc = int((_OUT / "lora.rc").read_text())
    assert rc == 0, (_OUT / "lora.err").read_text()[-3000:]
    r = json.loads((_OUT / "lora.json").read_text())
    assert r["model"] == "llama-3.1-8b" and r["fits"] is True
    assert r["lora"]["rank"] == 16 and r["data_env"] == "verifiers"
    assert {"train_step", "prefill", "decode_step", "lora_merge"} <= set(r["programs"])
    for prog, p in r["programs"].items():
        assert p["bytes_per_chip"] <= 0.9 * r["hbm_bytes_per_chip"], prog
    assert r["programs"]["decode_step"]["resident_bytes"] > 3e9  # the bf16 base, per chip
    assert r["transfer_bytes"] < 0.02 * r["num_params"] * 2  # adapters, not the bf16 weights
    assert int((_OUT / "lora_off.rc").read_text()) == 1
    err = (_OUT / "lora_off.err").read_text()
    assert "does not fit: train_step needs" in err and "GiB over" in err


@pytest.mark.slow
def test_a_multi_host_slice_compiles_the_group_on_its_slice_and_the_engine_on_a_replicas():
    """configs/slice/v5e_16.gin: the trainer group's step SPMD over the v5e-16's 16 chips (4
    hosts), the engine on one v5e-4 replica's 4; every program fits."""
    start_background().wait(timeout=3600)
    assert int((_OUT / "v5e16.rc").read_text()) == 0, (_OUT / "v5e16.err").read_text()[-3000:]
    r = json.loads((_OUT / "v5e16.json").read_text())
    assert r["topology"] == "v5e:4x4" and r["replica_topology"] == "v5e:2x2" and r["fits"]
    assert (r["trainer_processes"], r["engine_replicas"]) == (4, 2)
    assert r["trainer_mesh"] == {"fsdp": 8, "tp": 2} and r["decode_mesh"] == {"tp": 4}
    assert r["programs"]["train_step"]["chips"] == 16
    assert r["programs"]["decode_step"]["chips"] == 4


@pytest.mark.slow
def test_an_int8_base_shrinks_the_8b_train_step_and_leaves_the_engine_as_it_was():
    """QLoRA on the same config: the trainer's base is int8, so the train step's arguments
    (the base is most of them) and its total shrink; the engine still serves bf16 weights."""
    start_background().wait(timeout=3600)
    runs = {}
    for name in ("lora", "qlora"):
        assert int((_OUT / f"{name}.rc").read_text()) == 0, (_OUT / f"{name}.err").read_text()
        runs[name] = json.loads((_OUT / f"{name}.json").read_text())
    lora, qlora = (runs[n]["programs"] for n in ("lora", "qlora"))
    assert runs["qlora"]["lora"]["quantize"] == "int8" and runs["qlora"]["fits"] is True
    bf16_base = runs["lora"]["num_params"] * 2 / 4  # per trainer chip, 4 chips
    saved = lora["train_step"]["argument_bytes"] - qlora["train_step"]["argument_bytes"]
    assert 0.35 * bf16_base < saved < 0.55 * bf16_base  # about half of the bf16 base
    assert qlora["train_step"]["bytes_per_chip"] < lora["train_step"]["bytes_per_chip"] - 1e9
    for prog in ("prefill", "decode_step", "lora_merge"):
        assert qlora[prog]["bytes_per_chip"] == lora[prog]["bytes_per_chip"], prog


def test_unknown_topology_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'v9x:2x4'.*'v5e', 'v6e'"):
        aot.topology_devices("v9x:2x4")
    rc = aot.main(["--gin_file=configs/tpu_v5e_8.gin", "--topology=v5e-8"])
    assert rc == 2


def test_missing_gin_file_is_an_input_error(capsys):
    assert aot.main(["--gin_file=configs/nope.gin"]) == 2
    assert "'configs/nope.gin' does not exist" in capsys.readouterr().err


class _FakeCompiled:
    """What ``compiled.memory_analysis()`` / ``cost_analysis()`` return, without a compile."""

    def __init__(self, temp: int):
        self.temp = temp

    def memory_analysis(self):
        return SimpleNamespace(
            argument_size_in_bytes=10**9,
            output_size_in_bytes=10**9,
            alias_size_in_bytes=10**9,
            temp_size_in_bytes=self.temp,
            generated_code_size_in_bytes=0,
        )

    def cost_analysis(self):
        return {"flops": 1e12, "bytes accessed": 1e9}


@pytest.fixture
def cache_flag_restored():
    """aot.main turns JAX's persistent cache off in its process: this one goes on after."""
    before = jax.config.jax_enable_compilation_cache
    yield
    jax.config.update("jax_enable_compilation_cache", before)


def test_a_program_that_does_not_fit_exits_1_naming_it(monkeypatch, capsys, cache_flag_restored):
    """The verdict path of main() (the real compiles are test_tpu_configs_fit's): 15 GB of
    temporaries on a 16 GB v5e chip is over 90%; the message names the program and the gap."""
    model = {"flops": 1.0, "bytes": 1.0, "min_bytes_per_step": 1.0}
    progs = [
        aot.Compiled("train_step", _FakeCompiled(15 * 10**9), 4, model),
        aot.Compiled("decode_step", _FakeCompiled(10**9), 4, model),
    ]
    info = {
        "model": "m",
        "trainer_mesh": {},
        "decode_mesh": {},
        "decode_mesh_size": 4,
        "train_rows": 1,
        "row_len": 1,
        "decode_slots": 8,
        "steps_per_call": 2,
    }
    monkeypatch.setattr(aot, "compile_all", lambda cfg, devices, replicas: (progs, info))
    rc = aot.main(["--gin_file=configs/tpu_v5e_8.gin", "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert (
        "does not fit: train_step needs 16.00 GB per chip, 1.60 GB over 90% of the v5e's 16 GB"
        in err
    )
    assert "decode_step" not in err
    report = json.loads(out)
    assert report["fits"] is False and report["programs"]["decode_step"]["bytes_per_chip"] == 2e9
    assert report["compile_s"] >= 0
    # No persistent cache for a deviceless compile: it could not load what it wrote.
    assert jax.config.jax_enable_compilation_cache is False
    assert "compiled in " in aot_report.format_text(report)


def test_a_program_xla_refuses_for_memory_is_a_shortfall_not_an_error(
    monkeypatch, capsys, cache_flag_restored
):
    """XLA refuses to compile a program whose temporaries alone exceed the chip's HBM (what an
    8B model trained on every weight hits on 4 v5e chips): that is exit 1 naming it."""

    class _Refused:
        def compile(self):
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                "HLO temporaries (17.49G) exceeds available HBM (15.75G)."
            )

    class _Broken:
        def compile(self):
            raise RuntimeError("INTERNAL: something else")

    need, usable = aot.compile_or_refusal(_Refused())
    assert (need, usable) == (17.49 * 2**30, 15.75 * 2**30)
    with pytest.raises(RuntimeError, match="something else"):
        aot.compile_or_refusal(_Broken())
    model = {"flops": 1.0, "bytes": 1.0, "min_bytes_per_step": 1.0}
    progs = [
        aot.Compiled("train_step", None, 4, model, refused=(need, usable)),
        aot.Compiled("decode_step", _FakeCompiled(10**9), 4, model),
    ]
    info = {"model": "m", "trainer_mesh": {}, "decode_mesh": {}, "decode_mesh_size": 4}
    info.update(train_rows=1, row_len=1, decode_slots=8, steps_per_call=2)
    monkeypatch.setattr(aot, "compile_all", lambda cfg, devices, replicas: (progs, info))
    assert aot.main(["--gin_file=configs/tpu_v5e_8.gin"]) == 1
    out, err = capsys.readouterr()
    assert "does not fit: train_step needs 17.49 GiB of temporaries alone, 1.74 GiB over" in err
    assert "train_step       4  refused by XLA: out of HBM" in out


def test_model_costs_count_what_the_model_computes():
    """Analytic FLOPs: 2 per matmul weight per token, x3 for forward + backward, +1 with remat."""
    m = get_config("qwen2.5-0.5b")
    cfg = make_config({"Trainer.row_len": 128, "RL.ppo_epochs": 1, "Loss.kl_beta": 0.0})
    limits = EngineLimits(max_concurrent_decodes=4, max_target_length=256, steps_per_call=2)
    c = aot_report.model_costs(m, cfg, rows=2, limits=limits)
    tokens = 2 * 128
    attn = 2 * m.n_heads * m.head_dim * 128 * 128 * 2 * m.n_layers
    assert c["train_step"]["flops"] == 3 * (2 * m.num_params * tokens + attn)
    import dataclasses

    remat = aot_report.model_costs(dataclasses.replace(m, remat="full"), cfg, 2, limits)
    assert remat["train_step"]["flops"] == 4 / 3 * c["train_step"]["flops"]
    # Decoding reads every weight once per step, plus the cache.
    assert c["decode_step"]["bytes"] >= 2 * m.num_params * 4
