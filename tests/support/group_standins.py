"""Stand-ins for what ``compose.peer.follow`` drives on a trainer group's peer, so that only its
command loop is under test: ``StandinTrainer`` (``follow`` records each batch's tokens and counts
a step; ``params`` name the version they are the weights of) and ``StandinStaging`` (records what
it was asked to stage, and of which version). Both append to a shared ``log`` when given one, so
a test can read the order of everything the loop did."""

from __future__ import annotations

from typing import Any


class StandinTrainer:
    def __init__(self, version: int = 0, log: list | None = None) -> None:
        self.version = version
        self.batches: list[list[int]] = []
        self.log = [] if log is None else log

    @property
    def params(self) -> dict[str, int]:
        return {"version": self.version}

    def follow(self, arrays: dict[str, Any]) -> None:
        self.batches.append(arrays["tokens"].tolist())
        self.version += 1
        self.log.append(("train", self.version))


class StandinStaging:
    def __init__(self, log: list | None = None) -> None:
        self.log = [] if log is None else log

    def first(self, trainer: StandinTrainer) -> None:
        self.log.append(("stage first", trainer.params["version"]))

    def version(self, params: dict[str, int]) -> None:
        self.log.append(("stage", params["version"]))
