"""Narrow decoding: run each ``generate`` over only as many slots as hold running requests.

When an engine offers ``decode_widths`` with ``generate(..., width=w)`` and ``move_slot``
(``decode_widths``), the driver runs each call at the narrowest width holding every running
request, after packing requests at or above it into free lower slots (``pack``, ``repack``). Refills
always take the lowest free slot, so packing is rare: a drain moves at most ``slots - 1``
requests. A near-empty batch then costs a fraction of a full step instead of a full one (the
tail of every finite batch). ``warm_up`` runs every program the driver can call once.

Pure host-side planning plus the engine calls the driver asks for; the driver's loop thread is
the only caller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.inference.prefixes import buckets
from jaxrl_orch.inference.requests import accepts
from jaxrl_orch.types import SamplingParams


class NarrowEngine(JetStreamEngine, Protocol):
    """An engine that decodes narrow: ``generate(..., width=w)`` runs slots ``[0, w)`` of its
    ``decode_widths``, and ``move_slot`` moves a request between two slots."""

    decode_widths: Sequence[int]

    def move_slot(self, decode_state: Any, src: int, dst: int) -> Any: ...


def decode_widths(engine: JetStreamEngine, n_slots: int) -> tuple[int, ...]:
    """The decode widths to use: the engine's ``decode_widths`` when it offers both halves of
    narrow decoding (width-limited ``generate`` and ``move_slot``), else the full width."""
    widths = getattr(engine, "decode_widths", None)
    narrow = (
        widths
        and max(widths) == n_slots
        and accepts(engine.generate, "width")
        and hasattr(engine, "move_slot")
    )
    return tuple(sorted(int(w) for w in widths)) if narrow else (n_slots,)


def pack(slots: Sequence[Any], widths: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
    """``(width, moves)``: the narrowest width holding every occupied slot, and the
    ``(src, dst)`` moves that bring every occupied slot at or above it into a free one below."""
    running = [i for i, s in enumerate(slots) if s is not None]
    width = next(w for w in widths if w >= len(running))
    free = iter([i for i in range(width) if slots[i] is None])
    return width, [(src, next(free)) for src in running if src >= width]


def repack(
    engine: NarrowEngine, slots: list[Any], state: Any, widths: Sequence[int]
) -> tuple[int, Any]:
    """``(width, state)``: ``pack``'s moves done on ``slots`` (in place) and on the engine's
    decode ``state``, and the width the next ``generate`` runs at."""
    width, moves = pack(slots, widths)
    for src, dst in moves:
        state = engine.move_slot(state, src, dst)
        slots[dst] = slots[src]
        slots[src] = None
    return width, state


def warm_up(engine: JetStreamEngine, params: Any, version: int, widths: Sequence[int]) -> float:
    """Run every program the driver can call once, on a scratch decode state: each prompt
    bucket's prefill and insert, each decode width, a slot move (JetStream's model warm-up),
    so none compiles mid-run. Returns the seconds it took."""
    t0 = time.perf_counter()
    n_slots = int(engine.max_concurrent_decodes)
    state = engine.init_decode_state()
    kwargs = {"sampling": SamplingParams()} if accepts(engine.insert, "sampling") else {}
    for b in buckets(int(engine.max_prefill_length)):
        pad = np.zeros(b, np.int32)
        prefix, _ = engine.prefill(params=params, padded_tokens=pad, true_length=1)
        state = engine.insert(prefix, state, 0, **kwargs)
    if len(widths) > 1:
        state = engine.move_slot(state, 0, 1)
    for w in widths:
        step = {"version": version} if accepts(engine.generate, "version") else {}
        step.update({"width": w} if w != n_slots else {})
        state, result = engine.generate(params, state, **step)
        result.convert_to_numpy()  # waits for the device
    return time.perf_counter() - t0
