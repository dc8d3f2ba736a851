"""Seeded generator of small integer arithmetic problems for the arithmetic/calculator tasks.

A problem is ``{"question": "12+7", "answer": 19}``: ``num_operands`` integers in
``[0, max_operand]`` joined by operators drawn from ``ops`` (a subset of ``+-*``), evaluated
with the usual precedence (``*`` before ``+``/``-``, left to right). No division, so every
answer is an exact integer and the environments' exact-match reward is well defined.

``generate_problems`` returns distinct questions in generation order, deterministic in
``(count, seed, max_operand, num_operands, ops)`` via ``random.Random``. Distinctness is what
lets the dataset builder cut disjoint train/eval splits from one pool. Asking for more
problems than the space holds raises rather than looping forever.
"""

from __future__ import annotations

import random

ALLOWED_OPS = "+-*"


def evaluate_chain(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter."""
    terms = [operands[0]]
    signs: list[int] = []
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            signs.append(1 if op == "+" else -1)
            terms.append(x)
    return terms[0] + sum(s * t for s, t in zip(signs, terms[1:], strict=True))


def problem_space(max_operand: int, num_operands: int, ops: str) -> int:
    return (max_operand + 1) ** num_operands * len(ops) ** (num_operands - 1)


def generate_problems(
    count: int,
    seed: int = 0,
    *,
    max_operand: int = 99,
    num_operands: int = 2,
    ops: str = ALLOWED_OPS,
) -> list[dict[str, int | str]]:
    """``count`` distinct problems; see the module docstring for the distribution."""
    bad_ops = sorted(set(ops) - set(ALLOWED_OPS))
    if not ops or bad_ops:
        raise ValueError(f"ops must be a non-empty subset of {ALLOWED_OPS!r}, got {ops!r}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand!r}")
    if num_operands < 2:
        raise ValueError(f"num_operands must be >= 2, got {num_operands!r}")
    space = problem_space(max_operand, num_operands, ops)
    # Rejection sampling slows down near the space size; keep well under it.
    if not 1 <= count <= space // 2:
        raise ValueError(
            f"count must be in [1, {space // 2}] (half of the {space} possible problems for "
            f"max_operand={max_operand}, num_operands={num_operands}, ops={ops!r}), got {count}"
        )
    rng = random.Random(seed)
    out: dict[str, int] = {}
    while len(out) < count:
        operands = [rng.randint(0, max_operand) for _ in range(num_operands)]
        chosen = [rng.choice(ops) for _ in range(num_operands - 1)]
        question = "".join(f"{o}{x}" for o, x in zip(["", *chosen], operands, strict=True))
        out.setdefault(question, evaluate_chain(operands, chosen))
    return [{"question": q, "answer": a} for q, a in out.items()]
