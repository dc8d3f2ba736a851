"""Every finish reason the code can give a completion is declared, and classified, in one place.

``types.FINISH_REASONS`` says which reasons are whole (trainable) and which end a completion
short; ``finish_trainable`` refuses any other, naming it. Here the package's sources are read
with ``ast`` for every value a finish reason is given or compared with (``finish_reason=``, a
``"finish_reason":`` entry, an assignment to ``.finish_reason``, ``Completion``'s fourth
argument, a comparison with ``.finish_reason``, the returns of ``requests.finish_reason``),
following names to the module constants, local assignments, call-site arguments and function
returns they come from. A reason the code can produce that the table does not classify fails
here, before a run trains on it; a planted one shows the scan finds each kind of site.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxrl_orch.types import FINISH_REASONS, Completion, finish_trainable

PACKAGE = Path(__file__).resolve().parents[1] / "jaxrl_orch"
FIELD = "finish_reason"


class Scan:
    """The string values finish reasons take in ``modules`` (``{name: ast.Module}``)."""

    def __init__(self, modules: dict[str, ast.Module]) -> None:
        self.modules = modules
        self.found: dict[str, set[str]] = {}  # value -> where
        self.constants: dict[str, set[str]] = {}
        self.functions: dict[str, list[tuple[str, ast.FunctionDef]]] = {}
        for name, tree in modules.items():
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                    for t in node.targets:
                        if isinstance(t, ast.Name) and isinstance(node.value.value, str):
                            self.constants.setdefault(t.id, set()).add(node.value.value)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef):
                    self.functions.setdefault(node.name, []).append((name, node))
        for name, tree in modules.items():
            self._visit(name, tree, None)

    def _visit(self, module: str, node: ast.AST, fn: ast.FunctionDef | None) -> None:
        if isinstance(node, ast.FunctionDef):
            fn = node
        for value in self._sites(node, fn):
            for text in self.resolve(value, module, fn, depth=0):
                self.found.setdefault(text, set()).add(f"{module}:{value.lineno}")
        for child in ast.iter_child_nodes(node):
            self._visit(module, child, fn)

    def _sites(self, node: ast.AST, fn: ast.FunctionDef | None) -> list[ast.expr]:
        """The expressions a finish reason is given, or compared with, at ``node``."""
        if isinstance(node, ast.keyword) and node.arg == FIELD:
            return [node.value]
        if isinstance(node, ast.Dict):
            keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
            return [v for k, v in zip(keys, node.values, strict=True) if k == FIELD]
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_names_field(t) for t in targets):
                return [node.value]
        if isinstance(node, ast.Call) and _called(node) == "Completion" and len(node.args) > 3:
            return [node.args[3]]
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_field(s) for s in sides):
                return [s for s in sides if not _names_field(s)]
        if isinstance(node, ast.Return) and fn is not None and fn.name == FIELD and node.value:
            return [node.value]
        return []

    def resolve(self, e: ast.expr, module: str, fn: ast.FunctionDef | None, depth: int) -> set:
        """The string literals ``e`` can evaluate to (names followed, see the docstring)."""
        if depth > 6:
            return set()
        if isinstance(e, ast.Constant):
            return {e.value} if isinstance(e.value, str) else set()
        if isinstance(e, ast.IfExp):
            return self.resolve(e.body, module, fn, depth) | self.resolve(
                e.orelse, module, fn, depth
            )
        if isinstance(e, ast.BoolOp | ast.Tuple | ast.List | ast.Set):
            parts = e.values if isinstance(e, ast.BoolOp) else e.elts
            return set().union(*(self.resolve(p, module, fn, depth) for p in parts))
        if isinstance(e, ast.Name):
            return self._name(e.id, module, fn, depth + 1)
        if isinstance(e, ast.Call):
            return self._returns(_called(e), depth + 1)
        return set()  # a reason read off another completion: checked where it was made

    def _name(self, name: str, module: str, fn: ast.FunctionDef | None, depth: int) -> set:
        out = set(self.constants.get(name, ()))
        if fn is None:
            return out
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                out |= self.resolve(node.value, module, fn, depth)
        params = [a.arg for a in fn.args.args]
        if name in params:
            out |= self._arguments(fn, params.index(name), module, depth)
        return out

    def _arguments(self, fn: ast.FunctionDef, index: int, module: str, depth: int) -> set:
        """What the calls of ``fn`` in its module pass as its parameter ``index``."""
        out = set()
        for caller in ast.walk(self.modules[module]):
            if not isinstance(caller, ast.FunctionDef):
                continue
            for call in ast.walk(caller):
                if not isinstance(call, ast.Call) or _called(call) != fn.name:
                    continue
                method = fn.args.args[:1] and fn.args.args[0].arg == "self"
                at = index - 1 if method and isinstance(call.func, ast.Attribute) else index
                args = [*call.args[at : at + 1]]
                args += [k.value for k in call.keywords if k.arg == fn.args.args[index].arg]
                for arg in args:
                    out |= self.resolve(arg, module, caller, depth)
        return out

    def _returns(self, name: str | None, depth: int) -> set:
        out = set()
        for module, fn in self.functions.get(name or "", []):
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and node.value is not None:
                    out |= self.resolve(node.value, module, fn, depth)
        return out


def _names_field(e: ast.expr) -> bool:
    if isinstance(e, ast.Attribute | ast.Name):
        return getattr(e, "attr", getattr(e, "id", None)) == FIELD
    return isinstance(e, ast.Subscript) and getattr(e.slice, "value", None) == FIELD


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _package() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(PACKAGE.parent)): ast.parse(p.read_text())
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_every_finish_reason_the_code_can_give_is_classified():
    found = Scan(_package()).found
    unknown = {
        reason: sorted(where) for reason, where in found.items() if reason not in FINISH_REASONS
    }
    assert not unknown, f"finish reasons not in types.FINISH_REASONS: {unknown}"
    # The scan reaches every producer: the engine's rules and its pause, the HTTP routes' and
    # the bridge's vLLM words, the text endpoints' departed client.
    assert set(found) == set(FINISH_REASONS)
    where = {reason: " ".join(sorted(sites)) for reason, sites in found.items()}
    assert "inference/requests.py" in where["stop"] and "inference/requests.py" in where["length"]
    assert "inference/slots.py" in where["abort"] and "inference/driver.py" in where["abort"]
    assert "serving/generation.py" in where["cancelled"]
    assert "serving/openai_shapes.py" in where["tool_calls"]


def test_the_scan_finds_a_planted_reason_at_each_kind_of_site():
    planted = """
LATE = "deadline"

class Slots:
    def _finish(self, slot, seq, reason):
        return Completion([], [], [], reason)

    def expire(self, seq):
        self._finish(0, seq, LATE)

def reply(c):
    out = {"finish_reason": "error" if c.lost else c.finish_reason}
    c.finish_reason = "preempted"
    return out, dict(finish_reason="timeout"), c.finish_reason == "evicted"

def finish_reason(seq):
    return "drained" if seq.empty else None
"""
    found = Scan({"planted.py": ast.parse(planted)}).found
    assert set(found) == {"deadline", "error", "preempted", "timeout", "evicted", "drained"}


def test_finish_trainable_classifies_every_declared_reason_and_refuses_any_other():
    assert {r: finish_trainable(r) for r in FINISH_REASONS} == {
        "stop": True,
        "length": True,
        "abort": False,
        "cancelled": False,
        "tool_calls": True,
    }
    with pytest.raises(ValueError, match=r"unknown finish_reason 'error'.*stop, length, abort"):
        finish_trainable("error")
    with pytest.raises(ValueError, match="unknown finish_reason 'timeout'"):
        Completion([1], [0.0], [0], "timeout")  # a completion is made with a known one only
