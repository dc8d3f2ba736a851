"""A stage's event loop: it never stops for the collector, and a finished run exits whatever
environment code still hangs in a thread.

Environment code may block in a worker thread (``asyncio.to_thread``: a tool call, a grader)
and never return. The loop cancels such a rollout past ``env_timeout_s``, but nothing can stop
the thread itself, and two waits would then hang the finished run forever: ``asyncio.run``
joins the default executor's threads when its loop closes, and the interpreter joins every
non-daemon thread (executor workers are) before the process exits.

A full garbage collection scans every object the process tracks: by the RL stage that is about
a million (JAX, the model code, verifiers, the tokenizer), 0.6 s a pass on an idle core and
several seconds on a loaded one, and it runs on whichever thread allocates when it is due,
the event loop's most often. Every rollout and the trainer's feed stall meanwhile. The objects
built before a stage (modules, classes, the model's structures) live as long as the process, so
they are collected once and then frozen out of the collector (``gc.freeze``): a full pass in
the stage scans what the stage itself allocated.

The young generation is collected every ``YOUNG_GC_EVERY`` allocations, not CPython's 700. A
rollout allocates thousands of container objects that live across its awaits (a verifiers
episode's pydantic models and trace graph, the objects of its two loopback HTTP hops); each young
pass traverses those still alive and moves them on, so the older passes, a full one included,
come sooner too. Measured over ~1,500 rollouts, the collector's CPU per verifiers rollout fell
by about a third (docs/environments.md). The cost: garbage in reference cycles waits up to
10,000 allocations to be freed (tens of MB at most).

What it owns
- ``run_coroutine(coro)``: ``asyncio.run`` for a stage, except that the heap built before it is
  collected and frozen first, and that its loop's default executor is shut down without
  waiting: threads still running are left to the process's end.
- ``exit_code(rc, grace_s)``: for the train command, after its closing line: the threads that
  are not daemons get ``grace_s`` in all to end (a TensorBoard or W&B writer flushing its last
  events); if some still run, one line names them and the process ends at once with ``rc``
  (``os._exit``) instead of hanging. Checkpoints are committed before the closing line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any

EXIT_GRACE_S = 30.0
YOUNG_GC_EVERY = 10_000  # allocations net of frees between young collections (module docstring)


def run_coroutine(coro: Coroutine[Any, Any, Any]) -> Any:
    freeze_heap()
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="stage-worker")
    loop = asyncio.new_event_loop()
    loop.set_default_executor(executor)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()


def freeze_heap() -> None:
    """Collect once, then leave every object alive now out of later collections, which come
    every ``YOUNG_GC_EVERY`` allocations (the older generations' ratios are CPython's)."""
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_EVERY, mid, old)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def exit_code(rc: int, grace_s: float = EXIT_GRACE_S) -> int:
    """``rc``, once the other non-daemon threads have ended; past ``grace_s`` the process ends
    here (see the module docstring)."""
    deadline = time.monotonic() + grace_s
    for t in _others():
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in _others() if t.is_alive()]
    if not stuck:
        return rc
    print(
        f"note: {len(stuck)} thread(s) still running after the run ended ({', '.join(stuck)}): "
        f"code that never returned, e.g. an environment's blocking call; exiting with {rc}",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _others() -> list[threading.Thread]:
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
