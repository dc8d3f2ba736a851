"""The loop watchdog names the code that stalls the loop, and only that code."""

from __future__ import annotations

import asyncio
import time

from jaxrl_orch.orchestrator.faults import LoopWatchdog


def _stalled(stall) -> list[str]:
    reports: list[str] = []

    async def main():
        watchdog = asyncio.create_task(LoopWatchdog(0.2, report=reports.append).run())
        await asyncio.sleep(0.1)
        await stall()
        await asyncio.sleep(0.3)
        watchdog.cancel()

    asyncio.run(main())
    return [r for r in reports if "has not turned" in r]


def test_a_coroutine_blocking_the_loop_is_named_by_its_file_and_line():
    async def blocks():
        time.sleep(0.6)

    (named,) = _stalled(blocks)
    assert "it is running blocks (" in named and "test_faults.py:" in named


def test_a_stall_with_no_coroutine_running_names_asyncio_not_the_frame_that_started_the_loop():
    async def between_callbacks():
        # A C function as a callback: the loop stalls with no Python frame of anyone's above
        # asyncio's own, which is where a collection or another thread holding the GIL stops it.
        asyncio.get_running_loop().call_soon(time.sleep, 0.6)
        await asyncio.sleep(0)

    (named,) = _stalled(between_callbacks)
    assert "asyncio's own machinery, no coroutine" in named
    assert "test_faults.py" not in named  # the frame that ran asyncio.run did not stall it


def test_an_import_stalling_the_loop_is_named_by_the_code_that_imported(tmp_path, monkeypatch):
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(0.6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    async def imports_lazily():
        import slow_to_import  # noqa: F401

    (named,) = _stalled(imports_lazily)
    assert "it is running <module> (" in named and "slow_to_import.py:2" in named
    assert ", imported by imports_lazily (" in named and "test_faults.py:" in named
    assert "frozen" not in named


def test_each_function_holding_one_stall_is_named_once():
    def first():
        for _ in range(6):  # several lines' worth of one function: still one name
            time.sleep(0.1)

    def second():
        time.sleep(0.8)

    async def two_in_a_row():
        first()
        second()

    named = _stalled(two_in_a_row)
    assert [n.split(" (")[0].rsplit(" ", 1)[-1] for n in named] == ["first", "second"], named
