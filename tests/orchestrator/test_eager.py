"""eager.start_eagerly: finish in the first step without a Task, else a Task that behaves like
one created from the start (results, exceptions, cancellation at the current await)."""

import asyncio

import pytest

from jaxrl_orch.orchestrator.dispatcher.eager import start_eagerly


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_finishing_coroutine_returns_its_value_without_a_task():
    async def instant():
        return 42

    async def main():
        before = len(asyncio.all_tasks())
        task, value = start_eagerly(instant())
        assert task is None and value == 42
        assert len(asyncio.all_tasks()) == before

    run(main)


def test_exception_before_the_first_suspension_propagates():
    async def boom():
        raise KeyError("early")

    async def cancelled():
        raise asyncio.CancelledError

    async def main():
        with pytest.raises(KeyError, match="early"):
            start_eagerly(boom())
        with pytest.raises(asyncio.CancelledError):
            start_eagerly(cancelled())

    run(main)


def test_suspending_coroutine_continues_under_a_task():
    steps = []

    async def two_awaits(fut):
        steps.append("first step")
        await asyncio.sleep(0)  # a bare yield (None) to the task
        steps.append("after sleep(0)")
        value = await fut  # a real future
        return value * 2

    async def main():
        fut = asyncio.get_running_loop().create_future()
        task, value = start_eagerly(two_awaits(fut))
        assert steps == ["first step"] and task is not None and value is None
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert steps == ["first step", "after sleep(0)"] and not task.done()
        fut.set_result(21)
        assert await task == 42

    run(main)


def test_exception_after_suspension_is_the_tasks_exception():
    async def late():
        await asyncio.sleep(0)
        raise ValueError("late")

    async def main():
        task, _ = start_eagerly(late())
        with pytest.raises(ValueError, match="late"):
            await task

    run(main)


def test_cancel_reaches_the_coroutine_at_its_current_await():
    seen = []

    async def waits_forever(fut):
        try:
            await fut
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            raise
        finally:
            seen.append("finally")

    async def swallows(fut):
        try:
            await fut
        except asyncio.CancelledError:
            return "recovered"

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        task, _ = start_eagerly(waits_forever(fut))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled() and fut.cancelled()
        assert seen == ["cancelled inside", "finally"]
        task2, _ = start_eagerly(swallows(loop.create_future()))
        await asyncio.sleep(0)
        task2.cancel()
        assert await task2 == "recovered"

    run(main)
