"""verifiers' own training client (the ``verifiers`` extra, 0.4.0) runs an episode against us.

One tiny engine on a Qwen-style tokenizer directory (``support.chat_checkpoints``): the project
loads it (``models.tokenizer.load_tokenizer``) for the host, and verifiers' ``TrainClient``
builds its ``renderers`` renderer from the same local directory. ``support.vf_episode`` runs one
episode through verifiers' real machinery (``SingleAgentEnv``, its interception server, the
subprocess runtime, an in-process harness, a reward function in code) with ``TrainClient``
pointed at ``make_app`` + ``HttpServer`` on loopback, greedy. The reference is the in-process
``InferenceDriver`` on the same engine and params, run after the server has stopped (one driver
on an engine at a time), on the prompt ids the trace records.

Offline by construction: ``HF_HUB_OFFLINE`` / ``HF_HUB_DISABLE_TELEMETRY`` are set, the renderer
config is explicit, and the client reads no Prime config (see ``support.vf_episode``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.chat_checkpoints import write_qwen_tokenizer

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.types import SamplingParams

# verifiers' import, the engine's compile and the tokenizer load: about 20 s on 2 cores. verifiers
# is imported by the tests themselves, so collecting this module for the fast suite costs nothing.
pytestmark = pytest.mark.slow

MODEL = "tiny-qwen"
MAX_TOKENS = 8


def _split(branch):
    """``(prompt ids, sampled ids, sampled log-probs)`` of a verifiers trace branch."""
    rows = list(zip(branch.token_ids, branch.logprobs, branch.sampled_mask, strict=True))
    prompt = [t for t, _, sampled in rows if not sampled]
    return prompt, [t for t, _, s in rows if s], [lp for _, lp, s in rows if s]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(tokenizer, engine, params, run)``: the engine served over HTTP for one verifiers
    episode, then stopped."""
    from support.vf_episode import run_episode

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    tmp = tmp_path_factory.mktemp("vf_client")
    tok_dir = write_qwen_tokenizer(tmp / "checkpoint")
    tokenizer = load_tokenizer(tok_dir)
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,  # every id the tokenizer has, nothing it cannot decode
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        # Untied: a tied tiny random model greedily repeats the prompt's last token; a separate
        # head gives a completion whose ids differ from step to step (misalignment shows).
        tie_embeddings=False,
    )
    limits = EngineLimits(
        max_concurrent_decodes=2, max_target_length=96, max_prefill_length=64, steps_per_call=4
    )
    engine = DecodeEngine(cfg, limits=limits)
    params = engine.load_params(seed=0)
    host = EngineHost(engine, model=MODEL, tokenizer=tokenizer, params=params)
    server = HttpServer(make_app(host)).start_in_thread()
    try:
        run = run_episode(server.url, MODEL, tok_dir, MAX_TOKENS, tmp / "verifiers_cache")
    finally:
        server.stop()
        host.stop()
        mp.undo()
    return tokenizer, engine, params, run


@pytest.fixture(scope="module")
def reference(served):
    """What the in-process driver produces, greedy, for the prompt ids the trace records."""
    _, engine, params, run = served
    (trace,) = run.episode.traces
    (branch,) = trace.branches
    prompt, _, _ = _split(branch)
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        stop_token_ids=tuple(run.renderer.get_stop_token_ids()),
    )
    driver = InferenceDriver(engine, params, 0)
    driver.start()
    try:
        return prompt, driver.submit(prompt, sampling)[0].result(timeout=120)
    finally:
        driver.stop()


def test_episode_ran_whole_and_its_reward_saw_the_engines_tokens(served, reference):
    run = served[3]
    episode = run.episode
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.ok and trace.is_completed and not trace.errors, trace.errors
    prompt, completion = reference
    (branch,) = trace.branches
    assert branch.token_ids == prompt + completion.token_ids
    assert branch.sampled_mask == [False] * len(prompt) + [True] * len(completion.token_ids)
    (call,) = trace.calls
    assert call.usage.completion_tokens == len(completion.token_ids)
    # The taskset's reward counts the sampled tokens on the trace it is handed.
    assert trace.rewards["sampled_tokens"].score == float(len(completion.token_ids))
    assert trace.reward == float(len(completion.token_ids))


def test_train_client_tokens_logprobs_and_finish_equal_the_in_process_driver(served, reference):
    from support.vf_episode import PROMPT, SYSTEM_PROMPT
    from verifiers.v1.dialects import FINISH_REASONS

    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": PROMPT}]
    tokenizer, _, _, run = served
    prompt, completion = reference
    # Both sides read one tokenizer directory: verifiers' renderer and the project's template
    # give the same prompt ids (the ones the trace recorded and the server was sent).
    assert prompt == run.renderer.render(messages, add_generation_prompt=True).token_ids
    assert prompt == tokenizer.encode(tokenizer.apply_chat_template(messages))
    (trace,) = run.episode.traces
    (branch,) = trace.branches
    _, got_ids, got_lps = _split(branch)
    assert got_ids == completion.token_ids
    assert len(set(got_ids)) > 1  # a shifted id or log-prob could not hide in a constant run
    assert len(got_lps) == len(got_ids) and all(math.isfinite(lp) for lp in got_lps)
    np.testing.assert_allclose(got_lps, completion.logprobs, rtol=0, atol=1e-5)
    (call,) = trace.calls
    assert call.finish_reason in FINISH_REASONS
    assert call.finish_reason == completion.finish_reason
