"""StalenessGate: the admission-side bound on how off-policy training data may get.

Owns three counters and one formula (AReaL's form, docs/design.md section 4):

    capacity = min(max_concurrent - running, (S + version + 1) * B - (accepted + running))

S is the max staleness in policy versions, B the batch size in rollouts, ``running`` the train
rollouts admitted and not yet finished, ``accepted`` the train rollouts finished and accepted
for training since the start of the run (not since the last step), ``version`` the current
policy version. With uniform completion times no rollout is trained more than S versions after
the version it was admitted under; with varying completion times the observed age overshoots
(completions land out of admission order), which is why the loop reports observed ages.

Resume is where the formula bites: a restored run sets ``version = V`` while ``accepted`` would
restart at 0, opening ``(S + V + 1) * B`` slots at once. ``on_version_recovered(v)`` restores
``accepted = v * B``. ``resume(v)`` does that and arms the check: while the version is still
``v``, ``on_admit`` fails loudly (``ResumeBurstError``) once more than ``pending_limit() =
(S + 1) * B`` rollouts are in the system since the resume (running, plus accepted beyond the
recovered count: discarded flat groups are legitimately replaced, so they do not count).

Pure state machine: no asyncio, no clock, no imports from other components. Driven by the
orchestrator loop through callbacks (the dispatcher calls ``capacity``/``on_admit``/
``on_finish``; the weight watcher's observer calls ``on_version``). Eval rollouts never pass
through the gate. It must never block or sleep: a closed gate simply reports capacity <= 0.
"""

from __future__ import annotations


class ResumeBurstError(RuntimeError):
    """The first step after a resume admitted more than (S + 1) * B rollouts."""


class StalenessGate:
    def __init__(self, max_staleness: int, batch_size: int, max_concurrent: int) -> None:
        for name, value, lo in (
            ("max_staleness", max_staleness, 0),
            ("batch_size", batch_size, 1),
            ("max_concurrent", max_concurrent, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self.version = 0
        self.accepted = 0
        self.running = 0
        # Admissions since the last version change: the "admissions per step" signal.
        self.admitted_this_version = 0
        self.admitted_total = 0
        self._resumed: tuple[int, int] | None = None  # (version, accepted) at the resume

    def resume(self, version: int, *, recover: bool = True) -> None:
        """A run restored at ``version``: recover ``accepted`` (``recover=False`` only to
        demonstrate the alarm) and check the first step's admissions."""
        if recover:
            self.on_version_recovered(version)
        else:
            self.on_version(version)
        self._resumed = (version, self.accepted)

    def capacity(self) -> int:
        concurrency_slack = self.max_concurrent - self.running
        staleness_slack = (self.max_staleness + self.version + 1) * self.batch_size - (
            self.accepted + self.running
        )
        return min(concurrency_slack, staleness_slack)

    def pending_limit(self) -> int:
        """The most rollouts one step may admit at steady state: (S + 1) * B."""
        return (self.max_staleness + 1) * self.batch_size

    def on_admit(self, n: int = 1) -> None:
        if n < 0:
            raise ValueError(f"on_admit needs n >= 0, got {n}")
        self.running += n
        self.admitted_this_version += n
        self.admitted_total += n
        if self._resumed is not None and self.version == self._resumed[0]:
            in_system = self.running + self.accepted - self._resumed[1]
            if in_system > self.pending_limit():
                raise ResumeBurstError(
                    f"first step after resuming at version {self.version} put {in_system} "
                    f"rollouts in the system, more than (S + 1) * B = {self.pending_limit()}: "
                    "the admission gate's accepted counter was not recovered"
                )

    def on_finish(self, n: int = 1, accepted: bool = True) -> None:
        if n < 0:
            raise ValueError(f"on_finish needs n >= 0, got {n}")
        if n > self.running:
            raise ValueError(f"on_finish({n}) but only {self.running} rollouts are running")
        self.running -= n
        if accepted:
            self.accepted += n

    def on_discard(self, n: int = 1) -> None:
        """Rollouts accepted at finish but dropped later (a flat group under dynamic sampling,
        a filter, a non-finite reward) stop counting as accepted, so replacements may start.
        Without this a dropped group would hold its slots until the next version forever."""
        if not 0 <= n <= self.accepted:
            raise ValueError(f"on_discard({n}) but only {self.accepted} rollouts are accepted")
        self.accepted -= n

    def on_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"version must not go backwards: {self.version} -> {version}")
        if version != self.version:
            self.admitted_this_version = 0
        self.version = version

    def on_version_recovered(self, version: int) -> None:
        """Resume at ``version``: the accepted counter is restored as if every earlier step had
        consumed exactly one batch, so the staleness term opens at most (S + 1) * B slots."""
        if version < 0:
            raise ValueError(f"recovered version must be >= 0, got {version}")
        self.version = version
        self.accepted = version * self.batch_size
        self.admitted_this_version = 0

    def state(self) -> dict[str, int]:
        return {"version": self.version, "accepted": self.accepted}

    def gauges(self) -> dict[str, float]:
        return {
            "gate/capacity": float(self.capacity()),
            "gate/running": float(self.running),
            "gate/accepted": float(self.accepted),
            "gate/version": float(self.version),
            "gate/admitted_this_version": float(self.admitted_this_version),
        }
