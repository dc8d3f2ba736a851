"""TrainSink: finished train episodes -> tokenized, scored, filtered ``TrainBatch``es.

What it owns: everything between "a rollout finished" and "a batch is ready to ship", set by
``TrainSinkConfig``:

1. Tokenize. When its group is complete, each rollout's trace becomes one ``Sample`` (token
   ids as sampled, the loss mask, behavior log-probs and versions on model tokens, the
   sampling temperature fanned out to every token), the whole group in one vectorised pass
   (``samples.group_to_samples``). A group of at least ``OFFLOAD_MIN_TOKENS`` tokens is
   converted on a worker thread (``asyncio.to_thread``) so the event loop keeps dispatching;
   a smaller one inline, because the thread hop costs the loop more than converting a few
   thousand tokens does. Errored and untrainable rollouts are not tokenized; a rollout whose
   trace is misaligned is turned into an error rollout (``capture_error``), the deliberate
   fault tolerance docs/design.md section 7 allows.
2. Group. Rollouts are held until all ``group_size`` rollouts of their ``group_id`` (errored
   ones included: the dispatcher emits every rollout it started) have arrived.
3. Score. Errored/untrainable rollouts are dropped; the survivors' rewards go through the
   swappable ``Algorithm``. A NaN/inf reward makes the algorithm raise ``NonFiniteRewardError``;
   the sink catches exactly that, flags those rollouts ``non_finite_reward`` (counted, never
   trained on) and recomputes the group's advantages without them. A model token with a
   non-finite behavior log-prob is flagged ``non_finite_logprob`` the same way, unless
   ``engine_logprobs=False`` (an engine that reports none: the trainer recomputes them). Each
   survivor's advantage is written to ``rollout.advantage`` and onto its loss-masked tokens.
4. Filter. With ``dynamic_sampling`` (DAPO) a group whose surviving rewards are all equal (no
   signal) is flagged ``zero_variance`` and dropped; the batch waits for more groups, so it
   still holds ``batch_size`` rollouts that carry signal. The group's other survivors join
   the ready list (FIFO). Clean arrivals that never reach it are reported (``on_discard``), so
   the admission gate can admit replacements.
5. Batch. Once ``batch_size`` clean rollouts are ready, the loop takes a batch
   (``take_batch``): ``batch_size`` of them, first in arrival order or, for the ``pace``
   policy, oldest head version first. Extra ready rollouts wait for the next batch, so one
   group may straddle two batches. ``untrained_heads`` tells the ``pace`` policy the head
   versions of what is waiting here: ready, or in a group still missing rollouts.

Two lists are kept apart: the observation window (every rollout of every group completed since
the previous batch, errored and filtered too: ``TrainBatch.rollouts``, for metrics) and the
cohort (the clean rollouts trained on: ``TrainBatch.trained``, whose samples are
``TrainBatch.samples``).

Batch metrics (``train/...``): ``reward_mean``/``reward_std`` (window, non-errored, finite),
``batch_reward_mean`` (cohort), ``errors``, ``untrainable`` and ``untrainable/<reason>`` (a
rollout cut short by a pause or a departed caller, by its finish reason; ``stats.CUT_KINDS``,
always reported), ``filtered``, ``filtered/<reason>``,
``rollouts_seen``, ``groups_seen``, ``groups_with_signal``, ``effective_group_rate`` (groups with
signal / groups seen in the window; absent if the window completed no group),
``trainable_samples``, ``tokens``, ``loss_tokens``, ``ready_carryover``, and ``behaviour/<name>``
(the window's share of each behaviour its env labels, over scored rollouts).

Who drives it: the orchestrator's main loop calls ``await add(episode)`` for every train
episode and ``take_batch()`` when it may ship. Invariants: a rollout is in at most one batch;
nothing with an error, a flag or a non-finite reward is ever in ``samples``. It never imports
another orchestrator component and never writes metrics itself (the logger pulls ``gauges()``).
Pending work is not checkpointed: ``state()`` holds only the step and lifetime counters. What
it holds is in the rollout journal (``journal``: every rollout as it lands, ``on_scored`` for
every group scored); a restart brings it back through the dispatcher, with the members a step
already trained named in ``trained_before``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxrl_orch.algorithms.advantages import NonFiniteRewardError, get_algorithm
from jaxrl_orch.orchestrator.samples import GroupArrays, group_to_samples, trace_to_samples
from jaxrl_orch.orchestrator.stats import CUT_KINDS, head_versions, untrainable_kind, window_stats
from jaxrl_orch.types import Algorithm, Episode, Rollout, Sample, TrainBatch

_BATCH_ORDERS = ("arrival", "oldest")
# A group with at least this many tokens is converted on a worker thread: below it, the thread
# hop (a wake-up, a GIL hand-off and a loop turn) costs the event loop more than converting.
OFFLOAD_MIN_TOKENS = 4096
# Rewards closer than this count as equal: such a group carries no signal.
ZERO_VARIANCE_ATOL = 1e-6


@dataclasses.dataclass(frozen=True)
class TrainSinkConfig:
    """The sink's settings. ``group_size``: rollouts per prompt group; ``batch_size``: clean
    rollouts per batch; ``dynamic_sampling``: drop groups without reward variance (DAPO);
    ``engine_logprobs``: the engine reports behavior log-probs, so a non-finite one flags its
    rollout (False: the trainer recomputes them); ``batch_order``: which ready rollouts a batch
    takes first, ``arrival`` (FIFO) or ``oldest`` (lowest head version: the ``pace`` policy)."""

    group_size: int
    batch_size: int
    dynamic_sampling: bool = True
    engine_logprobs: bool = True
    batch_order: str = "arrival"

    def __post_init__(self) -> None:
        for name in ("group_size", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.batch_order not in _BATCH_ORDERS:
            raise ValueError(
                f"batch_order must be one of {_BATCH_ORDERS}, got {self.batch_order!r}"
            )


class TrainSink:
    def __init__(
        self,
        config: TrainSinkConfig,
        algorithm: Algorithm | str = "grpo",
        *,
        first_step: int = 1,
        on_discard: Callable[[int], None] | None = None,
        on_scored: Callable[[list[Rollout], list[Rollout]], None] | None = None,
    ) -> None:
        self.config = config
        self.group_size = config.group_size
        self.batch_size = config.batch_size
        self.algorithm: Algorithm = (
            get_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
        )
        self._on_discard = on_discard
        self._on_scored = on_scored
        # Rollouts a restart brought back with their group that a step before it trained
        # (recovery.Recovery.trained_before): scored with the group, never trained again.
        self.trained_before: set[tuple[int, int]] = set()
        # Groups in a row that contributed nothing trainable (the loop's empty-batch guard).
        self.consecutive_empty_groups = 0
        self._pending: dict[int, list[Rollout]] = {}
        self._ready: deque[Rollout] = deque()
        self._window: list[Rollout] = []
        self._window_counts: dict[str, int] = defaultdict(int)
        self._window_groups = 0
        self._window_signal = 0
        self._step = int(first_step)
        self._running = False
        self._totals: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """No background work: ``add`` does everything. Kept for the component contract."""
        self._running = True

    def stop(self) -> None:
        self._running = False

    @property
    def step(self) -> int:
        """Step number the next batch will carry."""
        return self._step

    # ------------------------------------------------------------------ intake

    async def add(self, episode: Episode) -> None:
        """Take one finished train episode; the loop takes batches (``take_batch``)."""
        if not episode:
            raise ValueError("episode must hold at least one rollout, got an empty list")
        pending = self._pending
        size = self.group_size
        full: list[int] = []
        for r in episode:
            if r.is_eval:
                raise ValueError(
                    f"eval rollout (env={r.env!r}, group_id={r.group_id}) sent to the train "
                    "sink; route is_eval episodes to the eval sink"
                )
            group = pending.get(r.group_id)
            if group is None:
                group = pending[r.group_id] = []
            group.append(r)
            if len(group) > size:
                raise ValueError(
                    f"group {r.group_id} (env {r.env!r}) received {len(group)} rollouts but its "
                    f"group_size is {size}"
                )
            if len(group) == size:
                full.append(r.group_id)
        for gid in full:
            group = pending.pop(gid)
            # Whatever arrived clean counted as accepted at the gate; nothing between the
            # dispatcher and here changes a rollout's flags, so count it now, before tokenizing.
            arrived_clean = sum(not r.errors and r.trainable for r in group)
            todo = [r for r in group if not r.errors and r.trainable]
            if sum(map(len, (r.token_ids for r in todo))) >= OFFLOAD_MIN_TOKENS:
                # Big groups go to a worker thread so the event loop keeps dispatching; small
                # ones are converted inline: the thread hop costs more loop time than they do.
                arrays = await asyncio.to_thread(self._tokenize, todo)
            else:
                arrays = self._tokenize(todo)
            self._process_group(group, arrays, arrived_clean)

    @property
    def ready_count(self) -> int:
        """Clean, scored rollouts waiting for a batch."""
        return len(self._ready)

    def untrained_heads(self) -> tuple[list[int], list[int]]:
        """Head versions of the rollouts here that may still be trained: the ready ones, and a
        lower bound for the clean ones of groups still waiting for the rest of their rollouts
        (the version their group started at: they are not tokenized yet)."""
        pending = [
            r.policy_version_at_start
            for group in self._pending.values()
            for r in group
            if not r.errors and r.trainable
        ]
        return head_versions(list(self._ready)), pending

    def _report_discards(self, n: int) -> None:
        if n and self._on_discard is not None:
            self._on_discard(n)

    def _tokenize(self, todo: list[Rollout]) -> GroupArrays | None:
        # May run on a worker thread: touches only these rollouts.
        arrays = group_to_samples(todo) if todo else None
        if arrays is None:
            for r in todo:
                try:
                    r.samples = trace_to_samples(r)
                except ValueError as exc:
                    r.capture_error(exc)
        return arrays

    def _flag(self, r: Rollout, reason: str) -> None:
        """Keep ``r`` out of the batch with ``reason`` (``Rollout.flag``), and count it."""
        r.flag(reason)
        self._window_counts[reason] += 1

    def _process_group(
        self, group: list[Rollout], arrays: GroupArrays | None, arrived_clean: int
    ) -> None:
        self._window.extend(group)
        self._window_groups += 1
        totals = self._totals
        survivors = []
        errors = 0
        for r in group:
            if r.errors:
                errors += 1
            elif not r.trainable:
                totals["untrainable"] += 1
                totals[f"untrainable/{untrainable_kind(r)}"] += 1
            elif not r.filtered:
                survivors.append(r)
        totals["groups_seen"] += 1
        totals["rollouts_seen"] += len(group)
        totals["errors"] += errors
        if self.config.engine_logprobs and (arrays is None or not arrays.all_logprobs_finite()):
            for r in survivors:
                if not all(np.isfinite(s.logprobs[s.loss_mask]).all() for s in r.samples):
                    self._flag(r, "non_finite_logprob")
            survivors = [r for r in survivors if not r.filtered]

        rewards = np.array([r.reward for r in survivors], np.float64)
        try:
            adv = self.algorithm.advantages(rewards)
        except NonFiniteRewardError as exc:
            bad = set(exc.indices)
            for i in sorted(bad):
                self._flag(survivors[i], "non_finite_reward")
            survivors = [r for i, r in enumerate(survivors) if i not in bad]
            rewards = np.array([r.reward for r in survivors], np.float64)
            adv = self.algorithm.advantages(rewards)
        adv = np.asarray(adv, np.float32)
        if adv.shape != rewards.shape:
            raise ValueError(
                f"algorithm {self.algorithm.name!r} returned advantages of shape {adv.shape} "
                f"for {rewards.shape[0]} rewards"
            )
        for r, a in zip(survivors, adv.tolist(), strict=True):
            r.advantage = a
        if arrays is not None and len(survivors) == len(arrays.rollouts):
            arrays.fan_out(adv)  # survivors are exactly the converted rollouts, in order
        else:
            for r, a in zip(survivors, adv, strict=True):
                for s in r.samples:
                    s.advantages[s.loss_mask] = a

        reward_list = rewards.tolist()  # max/min of a few floats: cheaper than np.ptp
        signal = len(survivors) >= 2 and max(reward_list) - min(reward_list) > ZERO_VARIANCE_ATOL
        if signal:
            self._window_signal += 1
            totals["groups_with_signal"] += 1
        elif self.config.dynamic_sampling:
            for r in survivors:
                self._flag(r, "zero_variance")
        ready = [r for r in survivors if not r.filtered and r.slot not in self.trained_before]
        if self._on_scored is not None:
            self._on_scored(group, ready)
        self._ready.extend(ready)
        self.consecutive_empty_groups = 0 if ready else self.consecutive_empty_groups + 1
        self._report_discards(arrived_clean - len(ready))
        totals["filtered"] += sum(1 for r in group if r.filtered)

    # ------------------------------------------------------------------ batching

    def take_batch(self) -> TrainBatch | None:
        """The next batch if ``batch_size`` clean rollouts are ready, else None. The loop calls
        it once ``ready_count`` reaches ``batch_size`` and its hold and age policy allow."""
        if len(self._ready) < self.batch_size:
            return None
        if self.config.batch_order == "oldest":
            # Stable: equal head versions keep arrival order.
            ready = list(self._ready)
            heads = head_versions(ready)
            self._ready = deque(ready[i] for i in sorted(range(len(ready)), key=heads.__getitem__))
        trained = [self._ready.popleft() for _ in range(self.batch_size)]
        # Every ready rollout holds its samples (tokenized, scored, unflagged): one per path.
        samples = [s for r in trained for s in r.samples]
        batch = TrainBatch(
            step=self._step,
            samples=samples,
            rollouts=list(self._window),
            metrics=self._metrics(trained, samples),
            trained=trained,
        )
        self._step += 1
        self._totals["batches"] += 1
        self._totals["samples"] += len(samples)
        self._window = []
        self._window_counts = defaultdict(int)
        self._window_groups = 0
        self._window_signal = 0
        return batch

    def _metrics(self, trained: list[Rollout], samples: list[Sample]) -> dict[str, float]:
        window = self._window
        m = {f"train/{k}": v for k, v in window_stats(window).items()}
        masks = np.concatenate([s.loss_mask for s in samples]) if samples else np.zeros(0, bool)
        groups = self._window_groups
        with_signal = self._window_signal
        m |= {
            "train/groups_seen": float(groups),
            "train/groups_with_signal": float(with_signal),
            "train/trainable_samples": float(len(samples)),
            "train/tokens": float(masks.size),
            "train/loss_tokens": float(np.count_nonzero(masks)),
            "train/ready_carryover": float(len(self._ready)),
        }
        if trained:
            m["train/batch_reward_mean"] = math.fsum(r.reward for r in trained) / len(trained)
        if groups:
            m["train/effective_group_rate"] = with_signal / groups
        for reason, n in sorted(self._window_counts.items()):
            m[f"train/filtered/{reason}"] = float(n)
        return m

    # ------------------------------------------------------------------ observability

    def gauges(self) -> dict[str, float]:
        seen = self._totals["groups_seen"]
        g = {
            "train_sink/pending_groups": float(len(self._pending)),
            "train_sink/pending_group_rollouts": float(sum(map(len, self._pending.values()))),
            "train_sink/ready_rollouts": float(len(self._ready)),
            "train_sink/window_rollouts": float(len(self._window)),
            "train_sink/step": float(self._step),
            "train_sink/running": float(self._running),
        }
        counted = ("batches", "samples", "rollouts_seen", "errors", "filtered", "groups_seen")
        for k in (*counted, "untrainable", *self._untrainable_kinds()):
            g[f"train_sink/{k}_total"] = float(self._totals[k])
        if seen:
            g["train_sink/effective_group_rate"] = self._totals["groups_with_signal"] / seen
        return g

    def _untrainable_kinds(self) -> list[str]:
        """``untrainable/<reason>`` for every way to end short and any other reason seen."""
        seen = (k for k in self._totals if k.startswith("untrainable/"))
        return sorted({*(f"untrainable/{kind}" for kind in CUT_KINDS), *seen})

    def recover(self, trained_before: set[tuple[int, int]]) -> None:
        """A restart's plan, before any rollout arrives: these slots come back with their
        groups, already trained (``recovery.Recovery.trained_before``)."""
        self.trained_before = set(trained_before)

    def state(self) -> dict[str, Any]:
        return {"step": self._step, "totals": dict(self._totals)}

    def restore(self, state: Mapping[str, Any]) -> None:
        if "step" not in state:
            raise ValueError(f"TrainSink state needs a 'step' entry, got keys {sorted(state)}")
        self._step = int(state["step"])
        self._totals = defaultdict(float, state.get("totals", {}))
