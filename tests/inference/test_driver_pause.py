"""The driver's pause modes (vLLM's keep / wait / abort) and its per-token listener, on the
hand-calculable ToyEngine: greedy tokens count upwards shifted by the params version, so which
weights produced each token shows in the token itself as well as in its version stamp."""

import threading

import pytest
from support.toy_engine import ToyEngine, expected_tokens

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.types import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=60)
VOCAB = 1000


@pytest.fixture
def driver():
    d = InferenceDriver(ToyEngine(slots=2, vocab=VOCAB, cache_len=128), 0, 0)
    d.start()
    yield d
    d.stop()


class Listener:
    """Records the tokens as the driver reports them. At the ``hold``-th token it holds the
    driver's loop thread inside that decode step until the test calls ``release()``: the toy
    engine decodes a whole request in milliseconds, so this is how a test acts mid-request."""

    def __init__(self, hold: int) -> None:
        self.tokens: list[tuple[int, float, int]] = []
        self.hold = hold
        self._held = threading.Event()
        self._go = threading.Event()

    def __call__(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append((token, logprob, version))
        if len(self.tokens) == self.hold:
            self._held.set()
            assert self._go.wait(timeout=30)

    def holding(self) -> None:
        assert self._held.wait(timeout=30), self.tokens

    def release(self) -> None:
        self._go.set()


def test_keep_holds_the_request_and_tokens_after_resume_carry_the_new_version(driver):
    seen = Listener(hold=4)
    (fut,) = driver.submit([5], LONG, on_token=seen)
    seen.holding()
    paused = driver.pause("keep")
    seen.release()
    assert paused.result(timeout=30) is True and driver.paused
    held = len(seen.tokens)
    assert driver.swap_params(1, 1).result(timeout=30) == 1  # lands while paused
    # Paused: several idle turns of the loop go by and the request does not move.
    for _ in range(5):
        driver.swap_params(1, 1).result(timeout=30)
    assert len(seen.tokens) == held and not fut.done()
    driver.resume()
    out = fut.result(timeout=30)

    assert out.finish_reason == "length" and len(out.token_ids) == LONG.max_tokens
    before = expected_tokens([5], held, VOCAB)  # the undisturbed run's first tokens
    assert out.token_ids[:held] == before
    after = expected_tokens([before[-1]], LONG.max_tokens - held, VOCAB, version=1)
    assert out.token_ids[held:] == after  # continued from its kept state, with the new weights
    assert out.versions == [0] * held + [1] * (LONG.max_tokens - held)
    assert seen.tokens == list(zip(out.token_ids, out.logprobs, out.versions, strict=True))


def test_abort_ends_running_and_queued_requests_with_what_they_have(driver):
    seen = Listener(hold=2)
    running = [driver.submit([i], LONG, on_token=seen)[0] for i in (10, 20)]  # both slots
    (queued,) = driver.submit([30], LONG)
    seen.holding()
    paused = driver.pause("abort")
    seen.release()
    assert paused.result(timeout=30) is True
    outs = [f.result(timeout=30) for f in running]
    assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < 60 for o in outs)
    assert outs[0].token_ids == expected_tokens([10], len(outs[0].token_ids), VOCAB)
    late = queued.result(timeout=30)
    assert late.finish_reason == "abort" and late.token_ids == []
    # Still paused: a new request waits for resume, then runs in full.
    (fut,) = driver.submit([40], SamplingParams(temperature=0.0, max_tokens=3))
    assert driver.paused and not fut.done()
    driver.resume()
    assert fut.result(timeout=30).token_ids == [41, 42, 43]


def test_wait_lets_running_requests_finish_and_admits_nothing_new(driver):
    seen = Listener(hold=1)
    (running,) = driver.submit([5], LONG, on_token=seen)
    seen.holding()
    paused = driver.pause("wait")
    (later,) = driver.submit([7], SamplingParams(temperature=0.0, max_tokens=2))
    seen.release()
    assert paused.result(timeout=30) is True
    assert running.done() and running.result().finish_reason == "length"  # it ran to the end
    assert not later.done()  # submitted after the pause: waits for resume
    driver.resume()
    assert later.result(timeout=30).token_ids == [8, 9]


def test_a_stronger_pause_replaces_a_pending_weaker_one_and_bad_modes_are_named(driver):
    seen = Listener(hold=1)
    (running,) = driver.submit([5], LONG, on_token=seen)
    seen.holding()
    wait = driver.pause("wait")
    abort = driver.pause("abort")
    seen.release()
    assert abort.result(timeout=30) and wait.result(timeout=30)
    assert running.result().finish_reason == "abort"
    with pytest.raises(ValueError, match="keep, wait, abort.*'sleep'"):
        driver.pause("sleep")
    driver.resume()
    assert not driver.paused


def test_a_listener_that_raises_does_not_stop_decoding(driver):
    def broken(token, logprob, version):
        raise RuntimeError("listener bug")

    (fut,) = driver.submit([3], SamplingParams(temperature=0.0, max_tokens=4), on_token=broken)
    assert fut.result(timeout=30).token_ids == [4, 5, 6, 7]
