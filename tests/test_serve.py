"""``python -m jaxrl_orch.serve`` as a user runs it: a checkpoint served over HTTP.

The checkpoint is an HF directory written from a seeded tiny-byte model; the served greedy
tokens and log-probs must be that checkpoint's (the in-process driver on the same weights gives
the same), the official ``openai`` client must get text back, SIGTERM must end the server
cleanly, and a non-loopback bind without a key must be refused before anything is built. A
train command's workdir serves its newest checkpoint: for a finished run, the same weights as
its export.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import jax
import numpy as np
import openai
import pytest
from flax import nnx
from jax.sharding import SingleDeviceSharding
from support.checkout import ROOT, subprocess_env
from support.runs import prepare, run
from support.toy_rl import toy_config

from jaxrl_orch.compose.engines import to_engine
from jaxrl_orch.compose.model import build_model, pretrained_params
from jaxrl_orch.config.load import make_config
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.byte_hf import save_byte_tokenizer
from jaxrl_orch.models.configs import get_config
from jaxrl_orch.models.hf_import import save_hf_checkpoint
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.serve import checkpoint_bindings, workdir_params
from jaxrl_orch.types import SamplingParams

SETTINGS = ["Engine.warmup = False", "Engine.slots = 4", "Engine.max_target_length = 96"]
PROMPT = [10, 20, 30, 40, 50]
STARTUP_S = 300  # building and compiling on a busy 2-core machine


def _serve(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxrl_orch.serve", "--gin_file=configs/reverse_text.gin"]
    cmd += [f"--gin_param={s}" for s in SETTINGS] + list(args)
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _url(proc: subprocess.Popen) -> tuple[str, list[str]]:
    """The URL the server prints once it answers (its output so far, for a failure message)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("serving http://"):
            return line.split()[1], lines
    raise AssertionError("the server exited before serving:\n" + "".join(lines))


def _in_process(ckpt: Path) -> tuple[list[int], list[float]]:
    """The checkpoint decoded in this process, with the model config a run would build (its
    logits limited to the byte tokenizer's ids)."""
    _, cfg = build_model(make_config({"Model.name": str(ckpt)}))
    limits = EngineLimits(max_concurrent_decodes=4, max_target_length=96)
    engine = DecodeEngine(cfg, limits=limits)
    driver = InferenceDriver(engine, to_engine(pretrained_params(str(ckpt)), engine), 0)
    driver.start()
    try:
        (f,) = driver.submit(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
        out = f.result(timeout=120)
    finally:
        driver.stop()
    return out.token_ids, out.logprobs


@pytest.mark.slow
def test_a_served_checkpoint_answers_the_token_endpoint_and_the_openai_client(tmp_path):
    preset = get_config("tiny-byte")
    save_hf_checkpoint(Transformer(preset, rngs=nnx.Rngs(3)), preset, tmp_path / "hf")
    save_byte_tokenizer(tmp_path / "hf")  # as an export writes it: the server reads it from there
    proc = _serve(f"--checkpoint={tmp_path / 'hf'}", "--port=0")
    try:
        url, _ = _url(proc)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(tmp_path / "hf")]
        body = {
            "model": models[0]["id"],
            "token_ids": PROMPT,
            "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 1},
        }
        choice = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()
        choice = choice["choices"][0]
        ids, logprobs = _in_process(tmp_path / "hf")
        assert choice["token_ids"] == ids  # the checkpoint's weights, not a fresh init
        got = [x["logprob"] for x in choice["logprobs"]["content"]]
        np.testing.assert_allclose(got, logprobs, atol=1e-5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        out = client.completions.create(
            model=models[0]["id"], prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 4 and isinstance(out.choices[0].text, str)
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_a_wider_bind_without_a_key_is_refused_before_any_work(tmp_path):
    proc = _serve("--host=0.0.0.0", "--port=0")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "refusing to bind '0.0.0.0' without an API key" in out
    assert "Traceback" not in out and "serving http" not in out  # one line, before any build


@pytest.mark.slow
def test_a_workdir_serves_its_newest_checkpoint_which_is_the_policy_it_exported(tmp_path):
    """An unfinished run has only orbax checkpoints: ``workdir_params`` restores the newest as a
    resume does. Here the run finished, so its HF export must hold the very same weights."""
    cfg = toy_config({"RL.steps": 2, "Outputs.export_hf": True, "Engine.warmup": False})
    run(prepare(cfg, tmp_path))
    export = tmp_path / "export"  # a byte-tokenizer run exports its tokenizer beside the weights
    assert checkpoint_bindings(str(tmp_path)) == [
        f"Model.name = '{export}'",
        f"Model.tokenizer = '{export}'",
    ]
    restored = jax.tree.leaves(workdir_params(cfg, str(tmp_path)))
    _, model_cfg = build_model(cfg)
    ckpt = pretrained_params(str(export))  # read onto one device, in the run's param dtype
    abstract = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))[1]
    exported = jax.tree.leaves(ckpt.load(abstract, SingleDeviceSharding(jax.devices()[0])))
    assert len(restored) == len(exported) > 0
    for a, b in zip(restored, exported, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_gs_checkpoint_or_workdir_is_served_where_it_lies(gcs, tmp_path):
    """A run on a TPU VM exports to its gs:// workdir: the server names that export (or the
    checkpoint directory itself) and reads its weights and tokenizer from there."""
    from argparse import Namespace

    from support.gcs_emulator import BUCKET

    from jaxrl_orch.paths import copy_tree
    from jaxrl_orch.serve import build_host

    preset = get_config("tiny-byte")
    export = tmp_path / "run" / "export"
    save_hf_checkpoint(Transformer(preset, rngs=nnx.Rngs(3)), preset, export)
    save_byte_tokenizer(export)
    workdir = f"gs://{BUCKET}/served-{tmp_path.name}"
    copy_tree(tmp_path / "run", workdir)
    bindings = [f"Model.name = '{workdir}/export'", f"Model.tokenizer = '{workdir}/export'"]
    assert checkpoint_bindings(workdir) == bindings
    assert checkpoint_bindings(f"{workdir}/export") == bindings
    with pytest.raises(ValueError, match="does not exist; name an HF checkpoint directory"):
        checkpoint_bindings(f"gs://{BUCKET}/no-such-run")
    args = Namespace(
        gin_file=["configs/reverse_text.gin"],
        gin_param=SETTINGS,
        checkpoint=workdir,
        weight_source=None,
        served_model_name="policy",
        host="127.0.0.1",
    )
    host, _ = build_host(args, None)
    try:  # the engine serves the export's very weights, read from the bucket
        engine = host.driver.engine
        want = jax.tree.leaves(to_engine(pretrained_params(str(export)), engine))
        got = jax.tree.leaves(host.driver._swap.params)
    finally:
        host.stop()
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
