"""WeightWatcher with an in-process version source, on a real asyncio loop with short waits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxrl_orch.orchestrator.watcher import (
    InProcessPublisher,
    WatcherStallError,
    WeightWatcher,
)
from jaxrl_orch.types import PolicyHandle


class Recorder:
    """Observer + reload hook that logs what it saw, in order."""

    def __init__(self, policy: PolicyHandle, gate_reload: threading.Event | None = None):
        self.policy, self.events, self.loaded = policy, [], []
        self.gate_reload = gate_reload
        self.threads: set[int] = set()

    def reload(self, version, params):  # sync: the watcher must run it in a worker thread
        self.threads.add(threading.get_ident())
        self.events.append(("reload", version, self.policy.version))
        if self.gate_reload is not None:
            assert self.gate_reload.wait(5), "test never released the reload"
        self.loaded.append((version, params))

    def on_version(self, version):
        self.events.append(("observer", version, self.policy.version))


async def until(cond, limit_s=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


def test_publisher_path_reload_before_bump_before_observers():
    async def main():
        policy = PolicyHandle()
        pub = InProcessPublisher()
        rec = Recorder(policy)
        w = WeightWatcher(pub, rec.reload, policy, observers=[rec])
        task = asyncio.create_task(w.start())
        bumped = asyncio.create_task(policy.wait_advanced())
        pub.publish(1, "params-1")
        await asyncio.wait_for(bumped, 5)
        await w.stop()
        await task
        return rec, w

    rec, w = asyncio.run(main())
    # The reload saw the old version; the observer saw the new one already on the handle.
    assert rec.events == [("reload", 1, 0), ("observer", 1, 1)]
    assert rec.loaded == [(1, "params-1")]
    assert threading.main_thread().ident not in rec.threads, "sync reload blocked the loop"
    g = w.gauges()
    assert g["watcher/version"] == 1 and g["watcher/reloads_total"] == 1
    assert g["watcher/reload_latency_s"] >= g["watcher/reload_s"] >= 0


def test_only_newest_unconsumed_version_is_loaded():
    async def main():
        policy = PolicyHandle()
        pub = InProcessPublisher()
        release = threading.Event()
        rec = Recorder(policy, gate_reload=release)
        w = WeightWatcher(pub, rec.reload, policy, observers=[rec])
        task = asyncio.create_task(w.start())
        pub.publish(1, "p1")
        await until(lambda: rec.events)  # reload of 1 is in progress and blocked
        pub.publish(2, "p2")
        pub.publish(3, "p3")
        release.set()
        await policy.wait_for(3, 5)
        await w.stop()
        await task
        return rec, w, policy

    rec, w, policy = asyncio.run(main())
    assert rec.loaded == [(1, "p1"), (3, "p3")]
    assert policy.version == 3
    assert w.gauges()["watcher/skipped_versions_total"] == 1


def test_async_reload_and_publish_from_another_thread():
    async def main():
        policy = PolicyHandle()
        pub = InProcessPublisher()
        seen = []

        async def reload(version, params):
            seen.append((version, params, policy.version))

        w = WeightWatcher(pub, reload, policy)
        task = asyncio.create_task(w.start())
        t = threading.Thread(target=pub.publish, args=(7, {"w": 1}))
        t.start()
        t.join()
        await w.wait_for_version(7, timeout=5)
        await w.stop()
        await task
        return seen

    assert asyncio.run(main()) == [(7, {"w": 1}, 0)]


def test_publisher_rejects_non_increasing_versions():
    pub = InProcessPublisher()
    pub.publish(2, None)
    with pytest.raises(ValueError, match="last was 2, got 2"):
        pub.publish(2, None)


def test_stall_raises_a_clear_error_instead_of_halting():
    async def main():
        policy = PolicyHandle()
        pub = InProcessPublisher()
        w = WeightWatcher(pub, lambda v, p: None, policy)
        task = asyncio.create_task(w.start())
        with pytest.raises(WatcherStallError) as err:
            await w.wait_for_version(3, timeout=0.05)
        await w.stop()
        await task
        with pytest.raises(WatcherStallError, match="stopped"):
            await w.wait_for_version(3, timeout=10)
        return str(err.value)

    msg = asyncio.run(main())
    assert "policy version 3" in msg and "still 0" in msg and "InProcessPublisher" in msg


def test_dead_watcher_surfaces_its_failure_immediately():
    def bad_reload(version, params):
        raise OSError("device lost")

    async def main():
        policy = PolicyHandle()
        pub = InProcessPublisher()
        observer = Recorder(policy)
        w = WeightWatcher(pub, bad_reload, policy, observers=[observer])
        task = asyncio.create_task(w.start())
        pub.publish(1, None)
        with pytest.raises(WatcherStallError, match="died .*device lost") as err:
            await w.wait_for_version(1, timeout=1000)
        assert isinstance(err.value.__cause__, OSError)
        with pytest.raises(OSError):
            await task
        with pytest.raises(OSError):
            w.check()
        return policy, observer

    policy, observer = asyncio.run(main())
    assert policy.version == 0 and observer.events == [], "bumped without loaded weights"


def test_bad_observer_is_rejected():
    with pytest.raises(TypeError, match="on_version"):
        WeightWatcher(InProcessPublisher(), print, PolicyHandle(), observers=[object()])


def test_latency_is_measured_from_publish_on_the_loop_clock():
    from jaxrl_orch.orchestrator.vclock import VirtualTimeLoop

    async def main(loop):
        policy = PolicyHandle()
        pub = InProcessPublisher()  # stamps with the watcher's loop time: virtual here

        async def reload(version, params):
            await asyncio.sleep(3.0)

        w = WeightWatcher(pub, reload, policy, clock=loop.time)
        task = asyncio.create_task(w.start())
        await asyncio.sleep(0)  # the watcher is now waiting on the publisher
        pub.publish(1, None)  # t=0: loaded over [0, 3]
        await asyncio.sleep(1.0)
        pub.publish(2, None)  # t=1: waits for the first reload, loaded over [3, 6]
        await w.wait_for_version(2, timeout=100)
        g = w.gauges()
        await w.stop()
        await task
        return g, loop.time()

    loop = VirtualTimeLoop()
    try:
        g, now = loop.run_until_complete(main(loop))
    finally:
        loop.close()
    assert now == pytest.approx(6.0)
    assert g["watcher/reload_s"] == pytest.approx(3.0)
    assert g["watcher/reload_latency_s"] == pytest.approx(5.0)
