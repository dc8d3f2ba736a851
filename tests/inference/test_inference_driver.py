"""InferenceDriver + EngineClient against the hand-calculable ToyEngine (no model, no jit)."""

import asyncio
import random
import re
import threading
import time
import types

import numpy as np
import pytest
from support.toy_engine import ToyEngine, expected_tokens, greedy_logprob

from jaxrl_orch.inference.client import ClientPool, EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine_api import ResultTokens
from jaxrl_orch.types import Completion, InferenceClient, InferencePool, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


@pytest.fixture
def make_driver():
    drivers = []

    def make(engine=None, version=0, **kw):
        engine = engine or ToyEngine()
        driver = InferenceDriver(engine, version, version, **kw)
        drivers.append(driver)
        return driver, engine

    yield make
    for d in drivers:
        d.stop()


def test_single_request_is_worked_out_on_paper(make_driver):
    driver, engine = make_driver()
    driver.start()
    (fut,) = driver.submit([3, 4], GREEDY)
    out = fut.result(timeout=10)
    assert out.token_ids == [5, 6, 7, 8, 9]
    assert out.logprobs == pytest.approx([greedy_logprob(engine.vocab)] * 5, abs=1e-6)
    assert out.versions == [0] * 5
    assert out.finish_reason == "length"


def test_stop_token_is_included_and_ends_the_request(make_driver):
    driver, _ = make_driver()
    driver.start()
    (fut,) = driver.submit([3], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(7,)))
    out = fut.result(timeout=10)
    assert out.token_ids == [4, 5, 6, 7]
    assert out.finish_reason == "stop"


def test_cache_length_ends_the_request(make_driver):
    driver, _ = make_driver(ToyEngine(cache_len=6))
    driver.start()
    (fut,) = driver.submit([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=50))
    # prompt occupies positions 0..3; tokens are fed at 3, 4, 5: three tokens fit a 6-slot cache.
    out = fut.result(timeout=10)
    assert out.token_ids == [5, 6, 7]
    assert out.finish_reason == "length"


def test_more_requests_than_slots_each_complete_exactly_once(make_driver):
    driver, engine = make_driver(ToyEngine(slots=3, vocab=1000))
    rng = random.Random(0)
    specs = [([rng.randrange(900), i], rng.randint(1, 12)) for i in range(25)]
    futures = {}
    driver.start()

    def submit_some(chunk):
        for idx in chunk:
            prompt, max_tokens = specs[idx]
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            (futures[idx],) = driver.submit(prompt, sp)

    order = list(range(len(specs)))
    rng.shuffle(order)
    threads = [threading.Thread(target=submit_some, args=(order[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    resolved = []
    for idx, fut in futures.items():
        fut.add_done_callback(lambda f, idx=idx: resolved.append(idx))
    for idx, (prompt, max_tokens) in enumerate(specs):
        out = futures[idx].result(timeout=20)
        assert out.token_ids == expected_tokens(prompt, max_tokens, engine.vocab)
    assert sorted(resolved) == list(range(len(specs)))
    assert driver.gauges()["inference/active_slots"] == 0


def test_group_is_prefilled_once_and_identical_submissions_share_it(make_driver):
    driver, engine = make_driver(ToyEngine(slots=2))
    futs = driver.submit([10, 11], GREEDY, n=3)  # 3 samples > 2 slots: the prefix is reused
    futs += driver.submit([10, 11], GREEDY)  # identical pending submission joins the group
    futs += driver.submit([10, 11], [SamplingParams(temperature=0.0, max_tokens=2)])
    driver.start()
    outs = [f.result(timeout=10) for f in futs]
    assert [o.token_ids for o in outs] == [[12, 13, 14, 15, 16]] * 4 + [[12, 13]]
    assert engine.prefill_calls == 1


def test_prefix_cache_reuses_prefill_for_the_same_version(make_driver):
    driver, engine = make_driver(prefix_cache_size=4)
    driver.start()
    driver.submit([10, 11], GREEDY)[0].result(timeout=10)
    driver.submit([10, 11], GREEDY)[0].result(timeout=10)
    assert engine.prefill_calls == 1
    driver.swap_params(1, 1)
    out = driver.submit([10, 11], GREEDY)[0].result(timeout=10)
    assert engine.prefill_calls == 2  # a new version never reuses an old prefix
    assert out.token_ids == expected_tokens([10, 11], 5, engine.vocab, version=1)


def test_swap_mid_generation_stamps_later_tokens_with_the_new_version(make_driver):
    engine = ToyEngine(slots=1, steps_per_call=2)
    driver, _ = make_driver(engine)

    def swap_after_second_call(call_index):
        if call_index == 1:
            driver.swap_params(3, 3)  # lands between generate calls 2 and 3

    engine.on_generate = swap_after_second_call
    driver.start()
    out = driver.submit([0], SamplingParams(temperature=0.0, max_tokens=7))[0].result(timeout=10)
    # Calls 1 and 2 (2 steps each) ran version 0; call 3 onwards version 3 (stride 1 + 3).
    assert out.versions == [0, 0, 0, 0, 3, 3, 3]
    assert out.token_ids == [1, 2, 3, 4, 8, 12, 16]
    assert driver.version == 3


def test_swap_future_resolves_when_the_swap_lands(make_driver):
    driver, _ = make_driver()
    superseded = driver.swap_params(4, 4)
    latest = driver.swap_params(5, 5)
    assert not latest.done()  # not started: nothing has switched yet
    driver.start()
    assert superseded.result(timeout=10) == 5 and latest.result(timeout=10) == 5
    assert driver.version == 5
    assert driver.submit([0], GREEDY)[0].result(timeout=10).versions == [5] * 5


def test_cancellation_frees_the_slot(make_driver):
    engine = ToyEngine(slots=1, cache_len=10**9)
    driver, _ = make_driver(engine)
    driver.start()
    (endless,) = driver.submit([0], SamplingParams(temperature=0.0, max_tokens=10**8))
    (queued,) = driver.submit([5], GREEDY)
    deadline = time.monotonic() + 20
    while engine.generate_calls < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not queued.done()
    assert endless.cancel()
    out = queued.result(timeout=10)
    assert out.token_ids == [6, 7, 8, 9, 10]


def test_engine_generate_error_reaches_the_future_and_the_driver_survives(make_driver):
    engine = ToyEngine()
    engine.fail_generate_at = 1
    driver, _ = make_driver(engine)
    driver.start()
    (bad,) = driver.submit([1], GREEDY)
    with pytest.raises(RuntimeError, match="toy generate failure"):
        bad.result(timeout=10)
    assert driver.submit([1], GREEDY)[0].result(timeout=10).token_ids == [2, 3, 4, 5, 6]


def test_engine_prefill_error_fails_only_that_group(make_driver):
    engine = ToyEngine()
    engine.fail_prefill_for = 99
    driver, _ = make_driver(engine)
    bad = driver.submit([99, 1], GREEDY, n=2)
    (good,) = driver.submit([1], GREEDY)
    driver.start()
    for f in bad:
        with pytest.raises(ValueError, match="toy prefill failure"):
            f.result(timeout=10)
    assert good.result(timeout=10).token_ids == [2, 3, 4, 5, 6]


class _Refusing(ToyEngine):
    """Refuses to insert a sample of ``top_k=13``, as an engine refuses a setting it cannot hold;
    with ``top_k=14`` it takes the decode state with it (donated to the failed call)."""

    def init_decode_state(self):
        return {**super().init_decode_state(), "donated": _Buffer()}

    def insert(self, prefix, decode_state, slot, sampling):
        if sampling.top_k == 14:
            decode_state["donated"].deleted = True
        if sampling.top_k in (13, 14):
            raise ValueError(f"toy insert cannot hold top_k={sampling.top_k}")
        return super().insert(prefix, decode_state, slot, sampling)


class _Buffer:
    deleted = False

    def is_deleted(self):
        return self.deleted


def test_an_insert_the_engine_refuses_fails_that_sample_alone(make_driver):
    driver, engine = make_driver(_Refusing(cache_len=10**9))
    driver.start()
    (running,) = driver.submit([20], SamplingParams(temperature=0.0, max_tokens=30))
    while engine.generate_calls == 0:  # decoding in a slot when the bad sample comes
        time.sleep(0.001)
    bad = SamplingParams(temperature=0.0, max_tokens=5, top_k=13)
    shared = driver.submit([3], [GREEDY, bad, GREEDY])  # one group: one prefill, three slots
    with pytest.raises(ValueError, match="cannot hold top_k=13"):
        shared[1].result(timeout=10)
    for f in (shared[0], shared[2]):
        assert f.result(timeout=10).token_ids == [4, 5, 6, 7, 8]
    assert running.result(timeout=10).token_ids == expected_tokens([20], 30, engine.vocab)
    assert engine.prefill_calls == 2

    async def through_the_client():  # what environments call: one request per sample
        client = EngineClient(driver)
        calls = [client.generate([7], sp) for sp in (GREEDY, bad, GREEDY)]
        return await asyncio.gather(*calls, return_exceptions=True)

    good, refused, also_good = asyncio.run(through_the_client())
    assert isinstance(refused, ValueError) and "cannot hold top_k=13" in str(refused)
    assert good.token_ids == also_good.token_ids == [8, 9, 10, 11, 12]

    # A refused insert that consumed the decode state loses what was running (the error
    # reaches each), and the driver starts over with a fresh state.
    calls = engine.generate_calls
    (lost,) = driver.submit([20], SamplingParams(temperature=0.0, max_tokens=10**6))
    while engine.generate_calls < calls + 2:  # decoding when the next sample comes
        time.sleep(0.001)
    (gone,) = driver.submit([5], SamplingParams(temperature=0.0, max_tokens=5, top_k=14))
    for f in (lost, gone):
        with pytest.raises(ValueError, match="cannot hold top_k=14"):
            f.result(timeout=10)
    assert driver.submit([1], GREEDY)[0].result(timeout=10).token_ids == [2, 3, 4, 5, 6]


P_MIN = re.escape(repr(2.0**-126))  # float32's smallest normal value, exactly
T_MIN = re.escape(repr(2.0**-100))


def test_settings_past_the_engines_slot_fields_are_refused_at_submit(make_driver):
    engine = ToyEngine()
    engine.config = types.SimpleNamespace(vocab_size=engine.vocab)  # a known vocabulary
    driver, _ = make_driver(engine)
    cases = [
        (
            [1, 50],
            GREEDY,
            r"prompt_ids\[1\]=50 is outside the vocabulary: ids must be in \[0, 50\)",
        ),
        ([-1], GREEDY, r"prompt_ids\[0\]=-1 is outside"),
        ([2**70], GREEDY, r"prompt_ids\[0\]=1180591620717411303424 is outside"),
        ([1.5], GREEDY, "integer token ids"),
        ([1], SamplingParams(top_k=2**31), r"top_k=2147483648 .* at most 2147483647"),
        ([1], SamplingParams(max_tokens=2**40), r"max_tokens=1099511627776 .* at most"),
        ([1], SamplingParams(temperature=1e39), r"temperature=1e\+39 is past float32's"),
        # Positive, but 0 once in the engine's float32 slot field: top_p 0 keeps no token.
        ([1], SamplingParams(top_p=1e-300), rf"top_p=1e-300 becomes 0 .* above 0 is {P_MIN}"),
        # Positive, but it divides the logits past float32's range.
        ([1], SamplingParams(temperature=2.0**-126), rf"temperature=1.17.* overflows .* {T_MIN}"),
        ([1], SamplingParams(stop_token_ids=(2**40,)), "outside int32"),
    ]
    for prompt, sampling, match in cases:
        with pytest.raises(ValueError, match=match):
            driver.submit(prompt, sampling)
    driver.start()  # nothing was queued; the bounds themselves are accepted
    edge = SamplingParams(temperature=0.0, top_k=2**31 - 1, max_tokens=3)
    assert driver.submit([0, 49], edge)[0].result(timeout=10).token_ids == [0, 1, 2]
    smallest = SamplingParams(temperature=2.0**-100, top_p=2.0**-126, max_tokens=3)
    assert len(driver.submit([0, 49], smallest)[0].result(timeout=10).token_ids) == 3


def test_stop_leaves_no_thread_and_fails_unfinished_requests():
    driver = InferenceDriver(ToyEngine(slots=1, cache_len=10**9), 0, 0)
    driver.start()
    (fut,) = driver.submit([0], SamplingParams(temperature=0.0, max_tokens=10**8))
    (queued,) = driver.submit([3], GREEDY)
    driver.stop()
    assert not [t for t in threading.enumerate() if t.name == "inference-driver"]
    for f in (fut, queued):
        with pytest.raises(RuntimeError, match="stopped"):
            f.result(timeout=1)
    with pytest.raises(RuntimeError, match="stopped"):
        driver.submit([1], GREEDY)


def test_bad_submissions_name_the_bad_value(make_driver):
    driver, _ = make_driver()
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        driver.submit(list(range(17)), GREEDY)
    with pytest.raises(ValueError, match="n must be >= 1"):
        driver.submit([1], GREEDY, n=0)
    with pytest.raises(ValueError, match="match the sampling list"):
        driver.submit([1], [GREEDY, GREEDY], n=3)
    with pytest.raises(ValueError, match="non-empty"):
        driver.submit([], GREEDY)
    with pytest.raises(ValueError, match="backwards"):
        driver.swap_params(0, -1)


def test_gauges_keys(make_driver):
    driver, _ = make_driver()
    driver.start()
    driver.submit([1], GREEDY)[0].result(timeout=10)
    g = driver.gauges()
    for key in ("active_slots", "queue_depth", "tokens_per_s", "prefill_s", "decode_s"):
        assert isinstance(g[f"inference/{key}"], float)
    assert g["inference/decode_s"] > 0


def test_client_multi_turn_cancel_and_pool(make_driver):
    driver, engine = make_driver(ToyEngine(slots=2, cache_len=10**9))
    driver.start()
    client = EngineClient(driver)
    assert isinstance(client, InferenceClient)

    async def scenario():
        first = await client.generate([1, 2], GREEDY)
        assert isinstance(first, Completion)
        second = await client.generate([1, 2, *first.token_ids, 40], GREEDY)
        assert second.token_ids == [41, 42, 43, 44, 45]
        task = asyncio.create_task(
            client.generate([0], SamplingParams(temperature=0.0, max_tokens=10**8))
        )
        while client.in_flight == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.in_flight == 0
        return (await client.generate([20], GREEDY)).token_ids

    assert asyncio.run(scenario()) == [21, 22, 23, 24, 25]

    other = EngineClient(driver)
    pool = ClientPool([client, other])
    assert isinstance(pool, InferencePool)
    client.in_flight = 2
    assert all(pool.select() is other for _ in range(3))
    client.in_flight = 0
    assert {id(pool.select()) for _ in range(4)} == {id(client), id(other)}
    with pytest.raises(ValueError, match="at least one client"):
        ClientPool([])


class JetStreamStyleToy(ToyEngine):
    """Plain JetStream method shape: prefill samples the first token, insert takes no
    sampling, generate takes no version and reports no log-probs or versions."""

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length):
        self.prefill_calls += 1
        first = (int(padded_tokens[true_length - 1]) + 1 + params) % self.vocab
        result = ResultTokens(np.array([[first, 1, 1]], np.int32), (0, 1), (1, 2), (2, 3))
        return (first, true_length), result

    def insert(self, prefix, decode_state, slot):
        sampling = SamplingParams(temperature=0.0, max_tokens=10**8)  # knows no request limits
        return super().insert(prefix, decode_state, slot, sampling)

    def generate(self, params, decode_state):
        state, result = super().generate(params, decode_state, params)
        k = self.steps
        data = np.asarray(result.data)[:, : 2 * k + 1]
        return state, ResultTokens(data, (0, k), (k, 2 * k), (2 * k, 2 * k + 1))


def test_plain_jetstream_engine_is_driven_with_host_side_rules(make_driver):
    driver, engine = make_driver(JetStreamStyleToy(slots=2, cache_len=10**9), version=2)
    driver.start()
    futs = driver.submit([3], [GREEDY, SamplingParams(temperature=0.0, max_tokens=1)])
    futs += driver.submit([3], SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(15,)))
    full, one, stopped = (f.result(timeout=10) for f in futs)
    assert full.token_ids == [6, 9, 12, 15, 18]  # first from prefill, then stride 1 + version
    assert one.token_ids == [6] and one.finish_reason == "length"
    assert stopped.token_ids == [6, 9, 12, 15] and stopped.finish_reason == "stop"
    assert full.versions == [2] * 5  # stamped by the driver from the params it passed
    assert np.isnan(full.logprobs).all()  # unknown behavior log-probs are NaN, never made up
    assert engine.prefill_calls == 1


def test_one_seeded_setting_for_n_samples_gives_seed_plus_i(make_driver):
    seen = []

    class Recording(ToyEngine):
        def insert(self, prefix, decode_state, slot, sampling):
            seen.append(sampling.seed)
            return super().insert(prefix, decode_state, slot, sampling)

    driver, _ = make_driver(Recording())
    driver.start()
    top = SamplingParams(temperature=0.0, max_tokens=2, seed=2**31 - 1)
    for f in driver.submit([1, 2], top, n=3):
        f.result(timeout=10)
    assert seen == [2**31 - 1, 0, 1]  # wraps into [0, 2**31)
    listed = [SamplingParams(max_tokens=2, seed=4), SamplingParams(max_tokens=2, seed=4)]
    for f in driver.submit([3], listed) + driver.submit([3], GREEDY, n=2):
        f.result(timeout=10)
    assert seen[3:] == [4, 4, None, None]  # an explicit list and unseeded ones: as given
