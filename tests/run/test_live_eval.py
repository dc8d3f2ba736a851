"""An evaluation harness pointed at a training run's ``Engine.serve_port`` scores the live policy,
of the version the response names.

A real run (the train command's stages, in process, as ``support.runs`` calls them) from a tiny
HF checkpoint with its own Qwen-style tokenizer (lm-eval tokenizes with it), on the toy
lowercase reward, for up to ``MAX_STEPS`` steps: this test ends it through its stop flag once
the evaluation is done. While it trains, an outside evaluator, in a thread of its own, talks to
the run's port the way harnesses do, with nothing handed out (``Engine.serve_control`` unset):

- the official ``openai`` client scores the same prompts over and over (``echo`` +
  ``logprobs`` as lm-eval's log-likelihood request, with ``max_tokens`` 0) until it has seen three
  policy versions. Each reply's ``prompt_policy_version`` lies between ``/health``'s version
  just before the request and just after the reply (a version the run had published then, no
  snapshot and no future one); two replies at one version hold the same log-probs, at two
  versions different ones: the scores move with the policy.
- lm-eval itself (``local-completions``, offline, on a multiple-choice task file written here)
  runs against the port. Its log-likelihoods must be the live server's scores of one version,
  not the starting policy's: to compare them exactly, the evaluator holds the run's rollouts
  back in the environment for that while (``GateEnv``; the engine keeps serving, the trainer
  has no new batch, so the version stays still), scores the task's sequences with the client
  before and after lm-eval, and holds lm-eval's numbers equal to them (2e-5 per token: the same
  program on the same params; lm-eval sends ids and ``max_tokens`` 1), and unequal to the
  scores of the first version the client saw.
- ``/v1/models`` names the version decoding now and the longest prompt; ``POST /pause`` is
  refused (403) while every eval route answers 200.

The run then trains on until the stop: one row per step, none twice, the last at least the
newest version the evaluator saw.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from support.chat_checkpoints import write_qwen_tokenizer
from support.runs import prepare
from support.toy_rl import LowercaseEnv, _TextOnly, toy_config
from support.train_cmd import all_rows

from jaxrl_orch.envs.base import register_env
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.run import stages
from jaxrl_orch.run.stop import StopFlag

pytestmark = pytest.mark.slow  # the engine's and trainer's first compiles, then lm-eval: ~100 s

MAX_STEPS = 60  # an upper bound: the test stops the run once it has evaluated
MAX_MODEL_LEN = 192  # the longest prompt is half: one prefill of 96 tokens
PER_TOKEN_ATOL = 2e-5
MC_DOCS = [
    ("Question: what does the cat sit on? Answer:", [" the mat", " the moon"]),
    ("the quick brown fox", [" jumps", " sleeps"]),
]
GATE = threading.Event()  # set: rollouts return to the run; clear: held in the environment


class GateEnv(LowercaseEnv):
    """The toy reward; a finished rollout waits here while the evaluator holds the gate."""

    name = "live_eval_gate"

    async def run(self, client, example, **kw):
        rollout = await super().run(client, example, **kw)
        while not GATE.is_set():
            await asyncio.sleep(0.05)
        return rollout


register_env(GateEnv.name, lambda tokenizer, **kw: GateEnv(_TextOnly(tokenizer), **kw))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(directory: Path) -> Path:
    from flax import nnx

    from jaxrl_orch.models.configs import ModelConfig
    from jaxrl_orch.models.hf_import import save_hf_checkpoint
    from jaxrl_orch.models.transformer import Transformer

    write_qwen_tokenizer(directory)  # a 300-id BPE: the model's 320 rows pad past it
    cfg = ModelConfig(
        vocab_size=320,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        d_ff=64,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=256,
    )
    save_hf_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, directory)
    return directory


class Evaluator:
    """What an outside harness does against the run's port, and what it saw."""

    def __init__(self, port: int, checkpoint: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(trust_env=False, timeout=120)  # loopback, whatever the proxy
        self.client = openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, http_client=self.http
        )
        self.tokenizer_dir = checkpoint  # lm-eval tokenizes with the checkpoint's own files
        self.tokenizer = load_tokenizer(checkpoint)
        self.model = ""  # the run's Model.name, as /v1/models names it
        self.texts = [q + c for q, choices in MC_DOCS for c in choices]

    def version(self) -> int:
        return self.http.get(f"{self.url}/health").json()["version"]

    def wait_ready(self, training, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not training.done():
            try:
                if self.version() >= 0:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        training.result(timeout=0)  # the run's own error, if it failed
        raise AssertionError("the run's live server never answered")

    def score(self, text: str) -> tuple[int, int, list[float], int]:
        """``(version before, prompt_policy_version, token log-probs, version after)``."""
        before = self.version()
        reply = self.client.completions.create(
            model=self.model, prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
        )
        after = self.version()
        (choice,) = reply.choices
        assert choice.text == text
        values = choice.logprobs.token_logprobs
        assert values[0] is None and None not in values[1:]
        return before, reply.model_extra["prompt_policy_version"], values[1:], after

    def still_version(self, still_s: float = 4.0, timeout_s: float = 120) -> int:
        """Once the gate holds: the version, after it has not moved for ``still_s``."""
        deadline = time.monotonic() + timeout_s
        seen, since = self.version(), time.monotonic()
        while time.monotonic() - since < still_s:
            assert time.monotonic() < deadline, "the version never stood still"
            time.sleep(0.25)
            now = self.version()
            if now != seen:
                seen, since = now, time.monotonic()
        return seen


def _continuation(tokenizer, question: str, choice: str) -> int:
    """How many of ``question + choice``'s tokens lm-eval adds up (its whole-string split)."""
    context, whole = tokenizer.encode(question), tokenizer.encode(question + choice)
    assert whole[: len(context)] == context
    return len(whole) - len(context)


def _mc_task(directory: Path) -> str:
    directory.mkdir()
    data = directory / "live_mc.jsonl"
    rows = [{"question": q, "choices": c, "answer": 0} for q, c in MC_DOCS]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": "live_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "target_delimiter": "",  # each choice is the exact continuation (its own leading space)
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (directory / "live_mc.yaml").write_text(yaml.safe_dump(task))
    return "live_mc"


def _lm_eval(tmp: Path, ev: Evaluator) -> list[list[float]]:
    """``python -m lm_eval`` as docs/serving.md runs it against a live run, offline; per doc,
    its log-likelihood of each choice."""
    task = _mc_task(tmp / "tasks")
    args = f"model={ev.model},base_url={ev.url}/v1/completions,tokenizer_backend=huggingface,"
    args += f"tokenizer={ev.tokenizer_dir},max_length={MAX_MODEL_LEN // 2}"
    out = tmp / "out"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", task, "--include_path", str(tmp / "tasks")]
    cmd += ["--log_samples", "--output_path", str(out)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf"))
    env.update(NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (path,) = out.glob(f"*/samples_{task}_*.jsonl")
    samples = sorted(
        (json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"]
    )
    return [[float(resp[0][0]) for resp in s["resps"]] for s in samples]


def _scores_across_versions(ev: Evaluator, texts: list[str], versions: int = 3):
    """Rounds of scoring ``texts`` until replies of ``versions`` versions came back:
    per text, ``{version: [log-probs of each reply at it]}``."""
    seen: dict[str, dict[int, list[list[float]]]] = {t: {} for t in texts}
    deadline = time.monotonic() + 300
    while len({v for by in seen.values() for v in by}) < versions:
        assert time.monotonic() < deadline, f"versions scored: {seen[texts[0]].keys()}"
        for text in texts:
            before, version, values, after = ev.score(text)
            # a version the run had published when the reply came, not one from before the ask
            assert before <= version <= after, (before, version, after)
            seen[text].setdefault(version, []).append(values)
    return seen


def _evaluate(ev: Evaluator, tmp: Path) -> dict:
    """The evaluator's whole visit; what the run's rows are then checked against."""
    (card,) = ev.client.models.list().data
    ev.model = card.id
    assert card.model_extra["max_prompt_len"] == MAX_MODEL_LEN // 2
    assert card.model_extra["policy_version"] >= 0
    refused = ev.http.post(f"{ev.url}/pause", params={"mode": "keep"})
    assert refused.status_code == 403 and "Engine.serve_control" in refused.text

    seen = _scores_across_versions(ev, ev.texts)
    for text, by_version in seen.items():
        for replies in by_version.values():  # one version, one set of scores
            assert all(r == pytest.approx(replies[0], abs=1e-6) for r in replies), text
        firsts = [replies[0] for replies in by_version.values()]
        for a, b in itertools.pairwise(firsts):  # the next version scores the prompt otherwise
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-4, text

    GATE.clear()  # the run's next batch waits: the version stands still while lm-eval runs
    held = ev.still_version()
    before = {t: ev.score(t) for t in ev.texts}
    harness = _lm_eval(tmp, ev)
    after = {t: ev.score(t) for t in ev.texts}
    assert ev.version() == held
    GATE.set()
    first = min(v for by_version in seen.values() for v in by_version)
    assert held > first
    for (question, choices), lls in zip(MC_DOCS, harness, strict=True):
        for choice, ll in zip(choices, lls, strict=True):
            text, n = question + choice, _continuation(ev.tokenizer, question, choice)
            assert before[text][1] == after[text][1] == held
            assert before[text][2] == after[text][2]
            live = sum(before[text][2][-n:])
            assert ll == pytest.approx(live, abs=PER_TOKEN_ATOL * n), text
            start = sum(seen[text][first][0][-n:])
            assert abs(ll - start) > PER_TOKEN_ATOL * n, text  # not the starting policy's
    return {"versions": {v for by_version in seen.values() for v in by_version} | {held}}


def test_a_harness_scores_the_live_policy_of_the_version_it_names(tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt")
    port = _free_port()
    settings = {
        "Model.name": str(ckpt),
        "Model.tokenizer": str(ckpt),
        "Data.env": GateEnv.name,
        "RL.steps": MAX_STEPS,
        "RL.prompts_per_step": 2,
        "RL.group_size": 4,
        "Trainer.row_len": 128,  # the template's system turn: ~60 tokens a prompt
        "Engine.max_target_length": MAX_MODEL_LEN,
        "Engine.slots": 8,
        "Engine.serve_port": port,
        "Engine.warmup": False,
        "Outputs.export_hf": False,
        # every version moves the policy: the toy's one warm-up step trains at lr 0, and a reply
        # from version 0 then scores exactly as one from version 1
        "RL.lr_warmup_steps": 0,
    }
    parts = prepare(toy_config(settings), tmp_path / "run")
    stop = StopFlag(parts.role)
    ev = Evaluator(port, ckpt)
    GATE.set()
    with ThreadPoolExecutor(1) as pool:
        training = pool.submit(stages.run, parts, stop)
        try:
            ev.wait_ready(training)
            saw = _evaluate(ev, tmp_path)
        finally:
            GATE.set()
            stop.set()  # the run drains and ends, as after a SIGTERM
        summary = training.result(timeout=300)

    rows = [r for r in all_rows(tmp_path / "run") if "train/reward_mean" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1)) and len(rows) < MAX_STEPS
    assert summary["rl_steps"] == len(rows)
    assert max(saw["versions"]) <= len(rows)  # versions the run published, one step each
