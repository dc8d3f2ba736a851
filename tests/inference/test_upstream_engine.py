"""An engine with upstream JetStream's surface (no log-probs, no versions, 2-D slot rows, no
per-request sampling) through the driver: it decodes the same tokens as the built-in engine,
its completions carry NaN log-probs (for the trainer to recompute) and the driver's version."""

from __future__ import annotations

import numpy as np
import pytest
from support.upstream_engines import UpstreamShapedEngine

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.transformer import ModelConfig
from jaxrl_orch.types import SamplingParams

CFG = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128
)
LIMITS = EngineLimits(
    max_concurrent_decodes=2, max_target_length=48, max_prefill_length=16, steps_per_call=3
)


def _decode(engine, params, prompts, version):
    driver = InferenceDriver(engine, params, version, prefix_cache_size=0)
    driver.start()
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=7)
        futures = [driver.submit(p, sampling) for p in prompts]
        return [f[0].result(timeout=120) for f in futures]
    finally:
        driver.stop()


@pytest.mark.slow
def test_upstream_results_decode_like_ours_with_nan_logprobs_and_the_drivers_version():
    ours = DecodeEngine(CFG, limits=LIMITS)
    params = ours.load_params(seed=0)
    upstream = UpstreamShapedEngine(CFG, limits=LIMITS, temperature=0.0)
    prompts = [[5, 17, 99, 3], [200, 201], [7] * 11]
    want = _decode(ours, params, prompts, version=3)
    got = _decode(upstream, params, prompts, version=3)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 7  # greedy: same tokens
        assert np.isnan(g.logprobs).all() and np.isfinite(w.logprobs).all()
        assert g.versions == [3] * 7
