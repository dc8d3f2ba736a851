"""A demonstrator that is right only part of the time: the SFT warm-up's mixed-quality targets.

What it owns: choosing, for each example, which behaviour the warm-up imitates, and rendering
that behaviour's completion. ``mix`` names worse behaviours and their shares, e.g.
``(("word_order", 0.6),)``; the rest of the examples get the env's reference completion (the
behaviour the verifier rewards fully). The choice is a pure function of the example (CRC-32 of
its canonical JSON, mapped to [0, 1)), so it is the same on every epoch, every run and every
seed, and about ``share`` of any large set of examples gets each behaviour.

Why it exists: on clean demonstrations a small model's greedy answer already is the best
behaviour it knows, leaving RL nothing to select. A warm-up that imitates a demonstrator who is
right only some of the time produces a policy that holds the right behaviour at a minority
probability; RL from the verifier's reward must learn to prefer it. This is the demo's premise,
stated as what it is: RL here *selects* a behaviour present in the warm-up; it does not teach a
new skill.

Invariants: it changes only the warm-up's targets. The environment's reward, its prompts and
RL are untouched (the env is only asked to render a completion). An env offers worse behaviours
through ``demonstration(example, behaviour)`` and lists them in ``demo_behaviours``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

from jaxrl_orch.types import Environment

REFERENCE = "reference"


def example_fraction(example: dict[str, Any]) -> float:
    """A stable pseudo-uniform number in [0, 1) for ``example`` (same in every process)."""
    key = json.dumps(example, sort_keys=True, default=str).encode()
    return zlib.crc32(key) / 2**32


def check_mix(
    mix: Sequence[tuple[str, float]], known: Sequence[str], env_name: str = "env"
) -> tuple[tuple[str, float], ...]:
    """Validate ``mix`` against the env's ``known`` behaviours; shares in (0, 1], sum <= 1."""
    out = []
    for item in mix:
        if not (isinstance(item, Sequence) and len(item) == 2):
            raise ValueError(
                f"Warmup.demonstrations entries are (behaviour, share) pairs, got {item!r}"
            )
        name = item[0]
        share = float(item[1])
        if not known:
            raise ValueError(
                f"env {env_name!r} offers no worse behaviours for a mixed warm-up, but "
                f"Warmup.demonstrations names {name!r}; set Warmup.demonstrations = ()"
            )
        if name not in known:
            raise ValueError(
                f"unknown demonstration behaviour {name!r}; this env offers {sorted(known)}"
            )
        if not 0.0 < share <= 1.0:
            raise ValueError(
                f"share of demonstration behaviour {name!r} must be in (0, 1], got {share}"
            )
        out.append((str(name), share))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"a demonstration behaviour is named twice in {names}")
    total = sum(s for _, s in out)
    if total > 1.0 + 1e-9:
        raise ValueError(f"demonstration shares sum to {total:g} > 1 in {out}")
    return tuple(out)


class MixedDemonstrator:
    """Completions for the warm-up: ``env.demonstration(ex, b)`` for the behaviour ``b`` that
    the example's fraction falls into, else ``env.reference_completion(ex)``."""

    def __init__(self, env: Environment, mix: Sequence[tuple[str, float]] = ()) -> None:
        self.env = env
        known = tuple(getattr(env, "demo_behaviours", ()))
        self.mix = check_mix(mix, known, getattr(env, "name", "env")) if mix else ()
        if not hasattr(env, "reference_completion"):
            raise ValueError(
                f"env {getattr(env, 'name', env)!r} has no reference completion to warm up on; "
                "set Warmup.steps = 0 or start from another run's warm-up (Warmup.from_workdir)"
            )

    def behaviour(self, example: dict[str, Any]) -> str:
        u = example_fraction(example)
        edge = 0.0
        for name, share in self.mix:
            edge += share
            if u < edge:
                return name
        return REFERENCE

    def completion(self, example: dict[str, Any]) -> str:
        b = self.behaviour(example)
        if b == REFERENCE:
            return self.env.reference_completion(example)
        return self.env.demonstration(example, b)
