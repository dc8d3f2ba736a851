"""run.restart: the first rollout's and the first step's seconds, kept once, and whether the
start was cold or warm, on a fake clock and fake cache counts."""

from __future__ import annotations

from jaxrl_orch.run.restart import RestartClock


class _Counted:
    """A cache view (``CompileCache``'s surface) whose counts the test sets; off."""

    def __init__(self) -> None:
        self.now = (0, 0)  # the compile cache's (hits, misses)
        self.loaded = 0  # programs the executable store loaded whole: no cache event

    def counts(self) -> tuple[int, int]:
        return self.now

    def reused(self) -> tuple[int, int]:
        return self.now[0] + self.loaded, self.now[1]

    def summary(self) -> dict:
        return {"dir": None, "hits": self.now[0], "misses": self.now[1]}


def test_the_clock_keeps_the_first_rollout_and_step_and_says_it_once(capsys):
    cache = _Counted()
    ticks = iter([12.0, 16.5])  # a later call would read a third: none may
    clock = RestartClock(10.0, cache, clock=lambda: next(ticks))
    assert clock.summary()["restart"]["first_step_s"] is None
    clock.landed()
    clock.landed()
    cache.now = (40, 2)  # by the first step, most programs came from the cache
    clock.trained()
    clock.trained()
    cache.now = (40, 90)  # what compiles after it does not change what the start was
    assert clock.summary() == {
        "restart": {"cold": False, "first_rollout_s": 2.0, "first_step_s": 6.5, "rollouts": None}
    }
    lines = [line for line in capsys.readouterr().out.splitlines() if "restart" in line]
    assert lines == [
        "== restart: warm start: first rollout 2 s, first train step 6.5 s after the command "
        "started; compile cache off"
    ]


def test_what_the_journal_gave_back_is_said_at_once_and_kept_in_the_summary(capsys):
    clock = RestartClock(10.0, _Counted(), clock=lambda: 11.0)
    counts = {"kept": 13, "trained_before": 2, "reissued": 11, "future": 10, "bad_line": 1}
    clock.recovered(counts, ["epoch_000001.jsonl line 7: ValueError: unknown record kind 'x'"])
    assert clock.summary()["restart"]["rollouts"] == counts
    assert capsys.readouterr().out.splitlines() == [
        "== journal: rollouts kept 13 (+2 trained before, with their groups), sent again 11; "
        "not trusted: 10 from lost versions, 1 bad lines",
        "== journal: not trusted: epoch_000001.jsonl line 7: ValueError: unknown record kind 'x'",
    ]


def test_a_start_with_no_more_hits_than_misses_is_cold():
    cache = _Counted()
    cache.now = (1, 38)  # a program compiled twice in one process loads its own entry
    clock = RestartClock(0.0, cache, clock=lambda: 1.0)
    clock.trained()
    assert clock.summary()["restart"]["cold"] is True


def test_a_start_whose_programs_came_whole_from_the_store_is_warm():
    """Loaded from the executable store, a program never reaches the compile cache: the cache
    view counts it as reused (``CompileCache.reused``), and that decides."""
    cache = _Counted()
    cache.loaded = 17  # no cache hit and no miss: every program loaded whole
    clock = RestartClock(0.0, cache, clock=lambda: 1.0)
    clock.trained()
    assert clock.summary()["restart"]["cold"] is False
