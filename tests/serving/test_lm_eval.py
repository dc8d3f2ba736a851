"""lm-evaluation-harness itself (``python -m lm_eval``, pinned in the dev extra) against the
server ``jaxrl-serve`` builds, on a checkpoint this module exports, offline.

The checkpoint: a tiny random model (weights scaled, as ``support.openai_server``'s, so its
greedy text is not one repeated token) saved as an HF directory (``config.json`` + safetensors)
beside a Qwen-style tokenizer with its jinja chat template (``support.chat_checkpoints``). It is
served as ``python -m jaxrl_orch.serve --checkpoint=DIR`` serves it: ``serve.build_host`` on the
same flags, then ``make_app`` + ``HttpServer`` on loopback (``support.openai_server.serve``), in a
thread of this process so the references below can read the served host's driver.

lm-eval runs in a subprocess with ``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE``, on task YAML
files and jsonl data written here (``--include_path``, ``dataset_path: json``); its tokenizer is
the export's own files. It runs as the docs tell a user to run it (docs/serving.md):

- ``local-completions``: a multiple-choice task and a perplexity task (log-likelihoods: each
  request is ``echo`` + ``logprobs: 1`` over the whole sequence) and a ``generate_until`` task;
- ``local-chat-completions`` with ``--apply_chat_template``: a ``generate_until`` task.

References: a log-likelihood must equal the trainer's log-probs of the same tokens
(``trainer.logprobs.token_stats`` at T = 1 over the export read as the trainer reads it, with
the run's model config), and "is greedy" the argmax of the trainer's logits. Tolerance: 2e-5
per scored token, summed over the tokens lm-eval adds up. Both sides are float32, but the
server scores through the engine's prefill program (its own attention over a padded bucket and
its own reduction order) and the trainer through a full-sequence forward, so the two differ by
float32 rounding (about 1e-6 per token here); ``tests/inference/test_prompt_scoring.py`` holds
the same 2e-5 per token. A generation must be the served engine's greedy decode in process
(``driver.submit``) of the prompt lm-eval logged, its text cut at the task's stop string.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from flax import nnx
from jax.sharding import SingleDeviceSharding
from support.chat_checkpoints import tiny_chat_config, write_qwen_tokenizer
from support.checkout import ROOT

from jaxrl_orch.compose.model import build_model, pretrained_params
from jaxrl_orch.config.load import load_config
from jaxrl_orch.models.hf_import import save_hf_checkpoint
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.models.transformer import Transformer
from jaxrl_orch.serve import build_host, checkpoint_bindings
from jaxrl_orch.trainer.logprobs import token_stats
from jaxrl_orch.types import SamplingParams

pytestmark = pytest.mark.slow  # two lm-eval runs and the engine's first compiles: ~70 s

GIN = [str(ROOT / "configs" / "reverse_text.gin")]
# The server's max_model_len; its longest prompt is half of it (one prefill: 96 tokens), which
# holds the chat prompts (the template's default system turn is ~60 tokens of this tiny BPE).
MAX_MODEL_LEN = 192
# lm-eval's max_length as docs/serving.md says to set it: the server's longest prompt. lm-eval
# left-truncates a log-likelihood request to max_length - 1 tokens, a generation's context to
# max_length - 1 - max_gen_toks; left at its default (2048) it would send prompts the server
# refuses.
MAX_LENGTH = MAX_MODEL_LEN // 2
SETTINGS = [
    "Engine.warmup = False",
    "Engine.slots = 4",
    f"Engine.max_target_length = {MAX_MODEL_LEN}",
]
MODEL = "tiny-export"
PER_TOKEN_ATOL = 2e-5
MAX_GEN_TOKS = 16
MC_DOCS = [
    ("Question: what does the cat sit on? Answer:", [" the mat", " the moon", " a dog"]),
    ("the quick brown fox", [" jumps", " sleeps"]),
    # longer than MAX_LENGTH: lm-eval scores the answer after the context's last tokens only
    ("Read: " + "the quick brown fox jumps over the lazy dog. " * 3 + "Who jumps?", [" fox"]),
]
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world"]
PROMPTS = ["Reverse: the cat sat", "the lazy dog"]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lm_eval") / "export"
    tokenizer = load_tokenizer(write_qwen_tokenizer(directory))
    cfg = tiny_chat_config(tokenizer.vocab_size)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: x * 4, nnx.state(model, nnx.Param)))
    save_hf_checkpoint(model, cfg, directory)
    return directory


@pytest.fixture(scope="module")
def host(export):
    args = Namespace(
        gin_file=GIN,
        gin_param=SETTINGS,
        checkpoint=str(export),
        weight_source=None,
        served_model_name=MODEL,
        host="127.0.0.1",
    )
    host, _ = build_host(args, None)
    yield host
    host.stop()


@pytest.fixture(scope="module")
def trainer_model(export):
    """The export as the trainer reads it: the run's model config (logits limited to the
    tokenizer's ids, as the served engine's) on the checkpoint's weights."""
    config = load_config(GIN, SETTINGS + checkpoint_bindings(str(export)))
    _, cfg = build_model(config)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = pretrained_params(str(export)).load(abstract, SingleDeviceSharding(jax.devices()[0]))
    return nnx.merge(graphdef, params)


def trainer_scores(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per token after the first: its log-prob by the trainer's function at T = 1, and whether
    it is the argmax of the trainer's logits there."""
    tokens = np.asarray(ids, np.int32)[None]
    positions = np.arange(len(ids), dtype=np.int32)[None]
    hidden = model.hidden_states(tokens, positions)[:, :-1]
    ones = np.ones((1, len(ids) - 1), np.float32)
    lp, _ = token_stats(model.logits_from_hidden, hidden, tokens[:, 1:], ones, entropy=False)
    greedy = np.argmax(np.asarray(model.logits_from_hidden(hidden)[0]), -1) == tokens[0, 1:]
    return np.asarray(lp[0], np.float64), greedy


def greedy_choice(model, tokenizer, context: str) -> str:
    """Text whose tokens are the trainer's greedy continuation of ``context`` (up to 3 tokens,
    the longest that decodes whole and encodes back to the same tokens): an answer lm-eval must
    report as greedy."""
    ids = tokenizer.encode(context)
    greedy = []
    for _ in range(3):
        tokens = np.asarray(ids + greedy, np.int32)[None]
        positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
        greedy.append(int(np.argmax(np.asarray(model(tokens, positions)[0, -1]))))
    for n in range(3, 0, -1):
        text = tokenizer.decode(greedy[:n])
        if "\ufffd" not in text and tokenizer.encode(context + text) == ids + greedy[:n]:
            return text
    raise AssertionError(f"no greedy continuation of {context!r} round-trips: {greedy}")


def engine_text(host, ids: list[int], until: str | None) -> str:
    """The served engine's greedy reply to ``ids`` in process, as text cut at ``until``."""
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_GEN_TOKS, stop_token_ids=host.tokenizer.stop_ids
    )
    out = host.driver.submit(ids, sp)[0].result(timeout=120)
    ids = out.token_ids
    if out.finish_reason == "stop" and ids and ids[-1] in host.tokenizer.stop_ids:
        ids = ids[:-1]
    text = host.tokenizer.decode(ids, skip_special_tokens=True)
    return text if until is None or until not in text else text[: text.index(until)]


def stop_string(text: str) -> str:
    """Two printable ASCII characters from the second half of ``text``: a stop string the reply
    holds, so the server has to cut it (cut at its first occurrence)."""
    pairs = (text[i : i + 2] for i in range(len(text) // 2, len(text) - 1))
    return next(p for p in pairs if p.isascii() and p.isprintable())


def write_task(directory: Path, name: str, rows: list[dict], **spec) -> str:
    """A task YAML on a jsonl file of ``rows``, both in ``directory`` (lm-eval's include path)."""
    directory.mkdir(exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        **spec,
    }
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return name


def generation_task(directory: Path, name: str, until: str, targets: list[str]) -> str:
    rows = [{"prompt": p, "target": t} for p, t in zip(PROMPTS, targets, strict=True)]
    spec = {
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "generation_kwargs": {"until": [until], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    return write_task(directory, name, rows, **spec)


def lm_eval(tmp: Path, model: str, model_args: dict, tasks: list[str], *flags: str):
    """``python -m lm_eval`` as a user runs it, offline; its results and logged samples (in
    doc order) per task."""
    out = tmp / "out"
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args]
    cmd += ["--tasks", ",".join(tasks), "--include_path", str(tmp / "tasks")]
    cmd += ["--log_samples", "--output_path", str(out), *flags]
    env = dict(
        os.environ,
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp / "hf"),  # the json datasets' cache, not the user's
        NO_PROXY="127.0.0.1,localhost",  # the server is on loopback, whatever the proxy
        no_proxy="127.0.0.1,localhost",
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (results,) = out.glob("*/results_*.json")
    samples = {}
    for task in tasks:
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda s: s["doc_id"])
    return json.loads(results.read_text())["results"], samples


@pytest.fixture(scope="module")
def completions(tmp_path_factory, host, url, export, trainer_model):
    """One lm-eval run through ``local-completions``: a multiple-choice task (its first answer
    of each question the trainer's greedy continuation), a perplexity task and a generation
    task whose stop string the first reply holds."""
    tmp = tmp_path_factory.mktemp("completions")
    tok = host.tokenizer
    mc_rows = [
        {"question": q, "choices": [greedy_choice(trainer_model, tok, q), *rest], "answer": i}
        for i, (q, rest) in enumerate(MC_DOCS)
    ]
    mc = write_task(
        tmp / "tasks",
        "jaxrl_mc",
        mc_rows,
        output_type="multiple_choice",
        doc_to_text="{{question}}",
        doc_to_choice="choices",
        doc_to_target="answer",
        target_delimiter="",  # each choice is the exact continuation (its own leading space)
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    )
    ppl = write_task(
        tmp / "tasks",
        "jaxrl_ppl",
        [{"text": t} for t in TEXTS],
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
    )
    until = stop_string(engine_text(host, tok.encode(PROMPTS[0]), None))
    first = engine_text(host, tok.encode(PROMPTS[0]), until)
    gen = generation_task(tmp / "tasks", "jaxrl_gen", until, [first, "no such reply"])
    model_args = {
        "model": MODEL,
        "base_url": f"{url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": export,
        "max_length": MAX_LENGTH,
    }
    results, samples = lm_eval(tmp, "local-completions", model_args, [mc, ppl, gen])
    return results, samples, until


def loglikelihood(resp) -> tuple[float, bool]:
    """One logged loglikelihood response: lm-eval writes ``(logprob, is_greedy)`` as strings."""
    value, greedy = resp
    return float(value), {"True": True, "False": False}[greedy]


def test_multiple_choice_log_likelihoods_are_the_trainers_log_probs(
    completions, host, trainer_model
):
    results, samples, _ = completions
    tok = host.tokenizer
    expected_acc = []
    greedy_seen = []
    truncated = []
    for sample, (question, _) in zip(samples["jaxrl_mc"], MC_DOCS, strict=True):
        doc = sample["doc"]
        reference = []
        for i, choice in enumerate(doc["choices"]):
            args = sample["arguments"][f"gen_args_{i}"]
            assert (args["arg_0"], args["arg_1"]) == (question, choice)
            context = tok.encode(question)
            whole = tok.encode(question + choice)
            assert whole[: len(context)] == context  # lm-eval's split: the context's tokens
            n = len(whole) - len(context)
            lp, greedy = trainer_scores(trainer_model, whole[-(MAX_LENGTH - 1) :])
            truncated.append(len(whole) > MAX_LENGTH - 1)
            want = (float(lp[-n:].sum()), bool(greedy[-n:].all()))
            got = loglikelihood(sample["resps"][i][0])
            assert got[0] == pytest.approx(want[0], abs=PER_TOKEN_ATOL * n), (question, choice)
            assert got[1] == want[1], (question, choice)
            reference.append(want[0])
            greedy_seen.append(got[1])
        expected_acc.append(float(np.argmax(reference) == doc["answer"]))
    # The greedy answers came back greedy (and the others not), so both branches of lm-eval's
    # is-greedy test ran on the server's top-1 alternatives.
    assert any(greedy_seen) and not all(greedy_seen)
    assert any(truncated)  # a request cut to MAX_LENGTH - 1 tokens: the server took it
    assert results["jaxrl_mc"]["acc,none"] == pytest.approx(np.mean(expected_acc))


def test_perplexity_is_the_trainers_log_prob_of_the_text(completions, host, trainer_model):
    _, samples, _ = completions
    tok = host.tokenizer
    # lm-eval's rolling window starts with a prefix token: the tokenizer's bos, else its eos.
    (prefix,) = tok.encode("<|im_end|>")
    for sample, text in zip(samples["jaxrl_ppl"], TEXTS, strict=True):
        ids = tok.encode(text)
        lp, _ = trainer_scores(trainer_model, [prefix, *ids])
        (got,) = sample["resps"][0]
        assert float(got) == pytest.approx(lp.sum(), abs=PER_TOKEN_ATOL * len(ids)), text


def test_generate_until_through_completions_is_the_engines_greedy_text(completions, host):
    results, samples, until = completions
    replies = []
    for sample, prompt in zip(samples["jaxrl_gen"], PROMPTS, strict=True):
        args = sample["arguments"]["gen_args_0"]
        assert args["arg_0"] == prompt and args["arg_1"]["until"] == [until]
        replies.append(engine_text(host, host.tokenizer.encode(prompt), until))
        assert sample["resps"] == [[replies[-1]]]
    assert until in engine_text(host, host.tokenizer.encode(PROMPTS[0]), None)  # it was cut
    assert results["jaxrl_gen"]["exact_match,none"] == 0.5  # the first target is its reply


def test_generate_until_through_chat_completions_is_the_engines_greedy_reply(tmp_path, host, url):
    tok = host.tokenizer

    def chat_ids(prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))

    until = stop_string(engine_text(host, chat_ids(PROMPTS[0]), None))
    first = engine_text(host, chat_ids(PROMPTS[0]), until)
    gen = generation_task(tmp_path / "tasks", "jaxrl_chat", until, [first, "no such reply"])
    model_args = {"model": MODEL, "base_url": f"{url}/v1/chat/completions"}
    results, samples = lm_eval(
        tmp_path, "local-chat-completions", model_args, [gen], "--apply_chat_template"
    )
    for sample, prompt in zip(samples[gen], PROMPTS, strict=True):
        (messages,) = sample["arguments"]["gen_args_0"]["arg_0"]
        assert json.loads(messages) == [{"role": "user", "content": prompt}]
        assert sample["resps"] == [[engine_text(host, chat_ids(prompt), until)]]
    assert results[gen]["exact_match,none"] == 0.5
