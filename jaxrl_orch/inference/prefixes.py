"""Prefills for the driver: prompt buckets, an LRU cache of prefixes by ``(tokens, version)``.

``Prefixes.get(prompt, params, version)`` returns ``(prefix, first)``: the engine's prefix of the
prompt computed with params of that version (KV to insert into slots), and the token a
JetStream-style engine sampled at prefill, if any. A prompt asked for again under the same
version (a group re-queued, an identical prompt of another group) reuses the prefix; a new
version never does (its KV would come from other weights). ``prepare(group, params, version)``
gives a queued ``PrefillGroup`` the prefix of the version about to decode, recomputing one
computed under an older version (a swap landed while the group waited for slots). Prompts are
padded to power-of-two buckets (``bucket``) so prefill compiles once per bucket; ``buckets``
lists every bucket a prompt may take, for the driver's warm-up. ``score(prompt, params,
version)`` runs the engine's scoring prefill (``scoring``) on the same buckets and keeps the
prefix it also computed, so a prompt both scored and decoded is prefilled once.

Called from the driver's loop thread only; it counts prefills and their seconds for the gauges.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from jaxrl_orch.inference.engine_api import JetStreamEngine
from jaxrl_orch.inference.requests import PrefillGroup, first_token

_SMALLEST = 8


def bucket(length: int, max_prefill: int) -> int:
    """The padded length of a ``length``-token prompt: a power of two >= 8, at most max_prefill."""
    size = _SMALLEST
    while size < length:
        size *= 2
    return min(size, max_prefill)


def buckets(max_prefill: int) -> list[int]:
    return sorted({bucket(n, max_prefill) for n in range(1, max_prefill + 1)})


class Prefixes:
    def __init__(self, engine: JetStreamEngine, cache_size: int) -> None:
        if cache_size < 0:
            raise ValueError(f"prefix_cache_size must be >= 0, got {cache_size!r}")
        self.engine = engine
        self.cache_size = cache_size
        self.max_prefill = int(engine.max_prefill_length)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self.count = 0  # prefills run (cache hits excluded)
        self.seconds = 0.0
        self.scored = 0  # prompts scored (``score``)
        self.score_seconds = 0.0

    def get(self, prompt: np.ndarray, params: Any, version: int) -> tuple[Any, Any]:
        key = (prompt.tobytes(), version)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        t0 = time.perf_counter()
        prefix, result = self.engine.prefill(
            params=params, existing_prefix=None, **self._padded(prompt)
        )
        entry = (prefix, first_token(result))
        self.seconds += time.perf_counter() - t0
        self.count += 1
        self._keep(key, entry)
        return entry

    def score(self, prompt: np.ndarray, params: Any, version: int) -> dict[str, np.ndarray]:
        """The engine's scores of ``prompt`` under ``version`` (``scoring.prompt_scores``'
        arrays, on the host); the prefix the same forward computed is kept for a later
        ``get`` of that prompt and version."""
        t0 = time.perf_counter()
        prefix, scores = self.engine.score(params=params, **self._padded(prompt))
        scores = {name: np.asarray(a) for name, a in scores.items()}
        self.score_seconds += time.perf_counter() - t0
        self.scored += 1
        self._keep((prompt.tobytes(), version), (prefix, None))
        return scores

    def _padded(self, prompt: np.ndarray) -> dict[str, Any]:
        padded = np.zeros(bucket(prompt.size, self.max_prefill), dtype=np.int32)
        padded[: prompt.size] = prompt
        return {"padded_tokens": padded, "true_length": int(prompt.size)}

    def _keep(self, key: tuple[bytes, int], entry: tuple[Any, Any]) -> None:
        if self.cache_size:
            self._cache[key] = entry
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def prepare(self, group: PrefillGroup, params: Any, version: int) -> None:
        """Set ``group``'s prefix (and first token) to its prompt's under ``version``."""
        if group.prefix is not None and group.prefix_version == version:
            return
        group.use_prefix(self.get(group.prompt, params, version), version)
