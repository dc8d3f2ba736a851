"""A run from a checkpoint directory prompts the engine with the checkpoint's own chat template.

Each test writes a small HF checkpoint directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a jinja ``chat_template``), runs
``python -m jaxrl_orch.train`` from it for two RL steps with its own tokenizer, and checks the
prompt ids of every rollout trained on (the trace before the model's first token, which is
what the engine was given) against ``transformers.apply_chat_template`` on the same files, for
the messages the environment builds from the run's train examples. Qwen-style (a default
system turn the built-in ChatML layout lacks) and Llama-3-style (bos from the template, turns
trimmed) checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers  # the dev extra has it: a missing one fails, never skips
from support.chat_checkpoints import (
    tiny_chat_config,
    write_llama3_tokenizer,
    write_qwen_tokenizer,
)
from support.checkout import xla_flags

pytestmark = pytest.mark.slow

INSTRUCTION = "Reverse:"
TRAIN = ["hello world", "the lazy dog", "brown fox jumps", "reverse the text", "quick wörld ✓"]
EVAL = ["over the fox", "text please"]


def _write_checkpoint(directory: Path, family: str) -> None:
    from flax import nnx

    from jaxrl_orch.models.hf_import import save_hf_checkpoint
    from jaxrl_orch.models.transformer import Transformer

    writer = {"qwen": write_qwen_tokenizer, "llama3": write_llama3_tokenizer}[family]
    writer(directory)  # a 300-id BPE: the model's 320 rows pad past it
    qwen = family == "qwen"  # config.json: Qwen2ForCausalLM; else LlamaForCausalLM
    cfg = tiny_chat_config(320, qkv_bias=qwen, tie_embeddings=qwen, max_seq_len=256)
    save_hf_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, directory)


def _run(ckpt: Path, workdir: Path, data: Path) -> subprocess.CompletedProcess:
    params = [
        f"Model.name = '{ckpt}'",
        f"Model.tokenizer = '{ckpt}'",
        f"Data.dataset = 'text:{data / 'train.txt'}'",
        f"Data.eval_dataset = 'text:{data / 'eval.txt'}'",
        f"Data.instruction = '{INSTRUCTION}'",
        "Warmup.steps = 0",
        "Warmup.demonstrations = ()",
        "RL.steps = 2",
        "RL.lr_warmup_steps = 0",
        "RL.prompts_per_step = 2",
        "RL.group_size = 2",
        "RL.max_new_tokens = 4",
        "Trainer.row_len = 128",
        "Engine.max_target_length = 192",
        "Engine.slots = 4",
        "RL.eval_examples = 2",
        "RL.eval_every = 100",
        "Outputs.checkpoint_every = 100",
        "RL.dynamic_sampling = False",
    ]
    cmd = [sys.executable, "-m", "jaxrl_orch.train", f"--workdir={workdir}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags(1)
    return subprocess.run(
        cmd + [f"--gin_param={p}" for p in params],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _prompts_seen(workdir: Path) -> list[tuple[int, ...]]:
    prompts = []
    for step in (1, 2):
        path = workdir / "rollouts" / f"step_{step:08d}.jsonl"
        for line in path.read_text().splitlines():
            record = json.loads(line)
            first_model_token = record["loss_mask"].index(True)
            prompts.append(tuple(record["token_ids"][:first_model_token]))
    return prompts


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_two_rl_steps_prompt_with_the_checkpoints_own_template(tmp_path, family):
    from jaxrl_orch.envs.reverse_text import ReverseTextEnv
    from jaxrl_orch.models.tokenizer import chatml, llama3_chat, load_tokenizer

    ckpt = tmp_path / "ckpt"
    _write_checkpoint(ckpt, family)
    (tmp_path / "train.txt").write_text("\n".join(TRAIN) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(EVAL) + "\n")
    res = _run(ckpt, tmp_path / "run", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]

    hf = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    env = ReverseTextEnv(load_tokenizer(ckpt), instruction=INSTRUCTION)
    expected, built_in = {}, {"qwen": chatml, "llama3": llama3_chat}[family]
    for text in TRAIN:
        messages = env.build_messages({"text": text})
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected[tuple(ids if isinstance(ids, list) else ids["input_ids"])] = text
        # The checkpoint's template differs from the fallback layout on these very prompts.
        assert hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) != built_in(messages)
    seen = _prompts_seen(tmp_path / "run")
    assert len(seen) == 2 * 2 * 2  # two steps of 2 prompts x 2 rollouts
    unknown = [hf.decode(list(p)) for p in seen if p not in expected]
    assert not unknown, f"prompts not rendered by the checkpoint's template: {unknown}"
    assert len({expected[p] for p in seen}) >= 2  # several train examples, not one repeated
    # The export carries the checkpoint's template with its tokenizer: it renders the same.
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "run" / "export"))
    messages = env.build_messages({"text": TRAIN[0]})
    assert exported.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
