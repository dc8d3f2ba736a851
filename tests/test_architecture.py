"""The boundaries of docs/design.md section 2, enforced: import-linter contracts from
pyproject.toml.

Orchestrator components never import each other (only the loop drives them); layers only import
downwards; sharding/ knows nothing of models or RL; inference/ knows nothing of orchestration;
algorithms/ are pure. The run's parts are built once, typed: every part a stage or a builder
takes is annotated with its class or Protocol (never ``Any``), no class name is defined twice,
nothing is attached to a part after it is built, and no constructor takes
what is built from it (no construction cycle). And the repository stands alone: its design
notes are docs/design.md, no file cites a document outside the repository, and every docs page a
file cites exists.
"""

import ast
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
import typing
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(root: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run(
        [exe, str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold():
    result = _lint_imports()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


PLANTS = {
    # a component importing another: only the loop drives them
    "independent": ("orchestrator/gate.py", "from jaxrl_orch.orchestrator import store"),
    # the orchestrator reaching for JAX or an engine module instead of a types Protocol
    "no engine, trainer": ("orchestrator/gate.py", "import jax"),
    # a helper module reaching for a component
    "helpers hold no component": (
        "orchestrator/ledger.py",
        "from jaxrl_orch.orchestrator import gate",
    ),
    # the settings climbing above the orchestrator
    "layering": ("config/train.py", "from jaxrl_orch.orchestrator import loop"),
    # the mesh layer learning about models
    "sharding knows nothing": ("../sharding/rules.py", "from jaxrl_orch.models import configs"),
    # the engine reaching for a loss
    "inference knows nothing": (
        "inference/sampling.py",
        "from jaxrl_orch.algorithms import losses",
    ),
    # a loss holding optimizer state
    "algorithms are pure": ("algorithms/losses.py", "import optax"),
    # a replica's client reaching for the trainer
    "distributed knows no trainer": (
        "distributed/replica_client.py",
        "from jaxrl_orch.trainer import step",
    ),
}


@pytest.mark.parametrize("contract", sorted(PLANTS))
def test_contracts_catch_a_planted_violation(tmp_path, contract):
    """Each contract really is checked: a planted import in a copy of the tree breaks it."""
    for name in ("jaxrl_orch", "sharding"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module, line = PLANTS[contract]
    target = tmp_path / "jaxrl_orch" / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    # Contract names wrap in the report: compare on collapsed whitespace.
    report = " ".join(result.stdout.split())
    names = [
        c["name"]
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
            "contracts"
        ]
    ]
    (name,) = [n for n in names if contract in n]
    assert f"{' '.join(name.split())} BROKEN" in report
    others = [n for n in names if n != name]
    assert all(f"{' '.join(n.split())} KEPT" in report for n in others)


def test_ruff_is_clean():
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run(
            [exe, *args, "jaxrl_orch", "sharding", "tests", "benchmarks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stdout[-3000:]


def test_every_contract_has_a_plant():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    names = [c["name"] for c in contracts["contracts"]]
    planted = {n for n in names for key in PLANTS if key in n}
    assert planted == set(names)


def _sources() -> list[Path]:
    return sorted(p for d in ("jaxrl_orch", "sharding") for p in (ROOT / d).rglob("*.py"))


def test_top_level_holds_only_the_bottom_layer_and_the_entry_point():
    modules = sorted(p.name for p in (ROOT / "jaxrl_orch").glob("*.py"))
    assert len(modules) <= 8, modules


def test_modules_stay_small_by_design():
    """Under 400 lines each, without packing lines to get there."""
    for path in _sources():
        text = path.read_text()
        assert len(text.splitlines()) <= 400, path
        assert "fmt: skip" not in text and "fmt: off" not in text, path


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_functions_stay_short_and_constructors_narrow():
    """No function over 80 lines; no ``__init__`` over 10 parameters (self not counted)."""
    long, wide = [], []
    for path in _sources():
        for fn in _functions(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}"
            if fn.end_lineno - fn.lineno + 1 > 80:
                long.append(where)
            a = fn.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - 1
            if fn.name == "__init__" and n > 10:
                wide.append(f"{where} ({n} parameters)")
    assert not long, long
    assert not wide, wide


def test_no_untyped_experiment_object():
    for path in _sources():
        text = path.read_text()
        assert "exp: Any" not in text and ": Any = exp" not in text, path


# Parts are built once, typed (docs/design.md section 2.2): a stage or a builder names the class or
# Protocol of every part it takes, so a reader (and a checker) knows what it may ask of it.
PART_PARAMS = frozenset(
    {
        "trainer",
        "engine",
        "env",
        "envs",
        "tokenizer",
        "driver",
        "side",
        "pool",
        "orch",
        "ckpt",
        "staging",
        "schedule",
        "parts",
        "placement",
        "built",
        "model_cfg",
        "publisher",
        "offer",
        "channel",
    }
)
STAGE_PACKAGES = ("compose", "run")


def _is_part(name: str) -> bool:
    return name in PART_PARAMS or name.removesuffix("s") in PART_PARAMS  # engines, sides


def _is_any(annotation: object) -> bool:
    """``Any``, or ``Any`` as an arm of a union (``Any | None``, ``Optional[Any]``). Under
    ``from __future__ import annotations`` an annotation is the string it was written as."""
    if not isinstance(annotation, str):
        return annotation is typing.Any
    arms, todo = [], [ast.parse(annotation, mode="eval").body]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            todo += [node.left, node.right]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(
            ("Optional", "Union")
        ):
            todo += node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        else:
            arms.append(ast.unparse(node))
    return any(arm in ("Any", "typing.Any") for arm in arms)


def _own_functions(module: types.ModuleType):
    """The functions ``module`` defines, and every method of the classes it defines (a
    dataclass's generated ``__init__`` too)."""
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield obj
        elif inspect.isclass(obj):
            for attr in vars(obj).values():
                if isinstance(attr, property):
                    attr = attr.fget
                fn = getattr(attr, "__func__", attr)  # staticmethod, classmethod
                if inspect.isfunction(fn):
                    yield fn


def _untyped_parts(module: types.ModuleType) -> list[str]:
    """Each parameter named like a part, in ``module``'s own functions and methods, that has no
    annotation or is annotated ``Any``: read from the annotations, not from the source text."""
    found = []
    for fn in _own_functions(module):
        for name, param in inspect.signature(fn).parameters.items():
            empty = param.annotation is inspect.Parameter.empty
            if _is_part(name) and (empty or _is_any(param.annotation)):
                shown = "unannotated" if empty else param.annotation
                found.append(f"{module.__name__}.{fn.__qualname__}({name}: {shown})")
    return found


def _stage_modules() -> list[types.ModuleType]:
    paths = [p for pkg in STAGE_PACKAGES for p in sorted((ROOT / "jaxrl_orch" / pkg).glob("*.py"))]
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths]
    return [importlib.import_module(n.removesuffix(".__init__")) for n in names]


def test_every_part_a_stage_or_builder_takes_is_typed():
    """Every function and constructor of compose/ and run/ annotates each parameter named like
    a part (``PART_PARAMS``) with its class or Protocol, never ``Any``."""
    modules = _stage_modules()
    assert len(modules) >= 25, [m.__name__ for m in modules]
    untyped = [where for module in modules for where in _untyped_parts(module)]
    assert not untyped, "\n".join(untyped)


PLANTED_PARTS = """
from __future__ import annotations

import dataclasses
from typing import Any, Optional


def stage(parts: RunParts, trainer: Any, engine, side: EngineSide | None = None) -> None: ...


def publish(publisher: Any | None, offer: Optional[Any], version: int, params: Any) -> None: ...


class Built:
    def __init__(self, pool: InferencePool, ckpt: Any, engines) -> None: ...

    @classmethod
    def of(cls, driver: InferenceDriver, staging: Any) -> Built: ...


@dataclasses.dataclass(frozen=True)
class Record:
    tokenizer: Tokenizer
    env: Any
"""


def test_the_parts_check_catches_a_planted_any(monkeypatch):
    """A planted module: every part typed ``Any`` (alone or in a union), or not at all, is found
    in its functions, methods and a dataclass's fields; typed parts and non-parts are not."""
    module = types.ModuleType("planted_parts")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # what dataclasses looks up
    exec(compile(PLANTED_PARTS, "planted_parts.py", "exec"), module.__dict__)
    found = [where.removeprefix("planted_parts.") for where in _untyped_parts(module)]
    assert sorted(found) == [
        "Built.__init__(ckpt: Any)",
        "Built.__init__(engines: unannotated)",
        "Built.of(staging: Any)",
        "Record.__init__(env: Any)",
        "publish(offer: Optional[Any])",
        "publish(publisher: Any | None)",
        "stage(engine: unannotated)",
        "stage(trainer: Any)",
    ], found


def _class_names(files: list[tuple[str, str]]) -> dict[str, list[str]]:
    """Where each class name is defined (top level or nested), over ``(where, text)`` pairs."""
    defined = defaultdict(list)
    for where, text in files:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                defined[node.name].append(f"{where}:{node.lineno}")
    return defined


def test_every_class_name_is_defined_once():
    """One class per name in the package: a reader who meets a class name knows which it is."""
    files = [(str(p.relative_to(ROOT)), p.read_text()) for p in _sources()]
    twice = {name: at for name, at in _class_names(files).items() if len(at) > 1}
    assert not twice, twice


def test_the_class_name_check_catches_a_planted_twin():
    """A name defined in two files, at the top level or nested (in a class, in a function), is
    found at each place; a name defined once is not."""
    files = [
        ("a.py", "class Launcher:\n    class Settings:\n        pass\n"),
        ("b.py", "def f():\n    class Settings:\n        pass\n\n\nclass Launcher: ...\n"),
        ("c.py", "class Other: ...\n"),
    ]
    twice = {name: at for name, at in _class_names(files).items() if len(at) > 1}
    assert twice == {"Launcher": ["a.py:1", "b.py:6"], "Settings": ["a.py:2", "b.py:2"]}


# Construction has no cycle (docs/design.md section 2.2): if class A's constructor takes a B,
# B's constructor may not take an A, directly or through other classes, or one of them would have
# to be built half-way and finished later.
DATACLASS = re.compile(r"(dataclasses\.)?dataclass\b")


def _constructor_annotations(cls: ast.ClassDef) -> list[ast.expr]:
    """The annotations of what building ``cls`` takes: its ``__init__``'s parameters, or a
    dataclass's fields (class-level annotated names without ``ClassVar``)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            a = node.args
            return [p.annotation for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.annotation]
    if any(DATACLASS.match(ast.unparse(d)) for d in cls.decorator_list):
        return [
            n.annotation
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)
        ]
    return []


def _construction_graph(files: list[tuple[str, str]]) -> dict[str, set[str]]:
    """For each class defined in ``files``, the other classes of ``files`` its constructor names
    in an annotation (``A | None``, ``Sequence[A]`` and quoted names count; a class naming itself,
    a tree built bottom-up, does not)."""
    classes = {
        node.name: node
        for _, text in files
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
    }
    graph = {}
    for name, cls in classes.items():
        named = set()
        for annotation in _constructor_annotations(cls):
            named |= set(re.findall(r"\b\w+\b", ast.unparse(annotation)))
        graph[name] = (named & classes.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of ``graph`` (a depth-first search that reports
    each back edge's loop), each starting from its smallest name."""
    found, state, path = {}, {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                loop = path[path.index(nxt) :]
                start = loop.index(min(loop))
                found.setdefault(frozenset(loop), loop[start:] + loop[:start])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return sorted(found.values())


def test_no_class_takes_in_its_constructor_what_is_built_from_it():
    """The package's construction graph (class -> the classes its constructor takes) has no
    cycle: the run is built in one order (docs/design.md section 2.2)."""
    files = [(str(p.relative_to(ROOT)), p.read_text()) for p in _sources()]
    graph = _construction_graph(files)
    assert sum(map(len, graph.values())) >= 50, "the graph lost its edges"
    assert not _cycles(graph), _cycles(graph)


PLANTED_CYCLE = """
import dataclasses


class Trainer:
    def __init__(self, hooks: "Side | None", params: dict) -> None: ...


class Side:
    def __init__(self, trainer: Trainer, pool: "Pool") -> None: ...


class Pool:
    def __init__(self, clients: list["Client"]) -> None: ...


@dataclasses.dataclass
class Client:
    url: str
    parent: Pool | None = None


@dataclasses.dataclass
class Node:
    children: list["Node"]
"""


def test_the_cycle_check_catches_a_planted_loop():
    """A planted module: a two-phase pair (the trainer takes the side built from it) and a
    dataclass closing a loop through a list are found; a self-referential tree is not."""
    graph = _construction_graph([("planted.py", PLANTED_CYCLE)])
    assert graph["Side"] == {"Trainer", "Pool"} and graph["Node"] == set()
    assert _cycles(graph) == [["Client", "Pool"], ["Side", "Trainer"]]


ATTACHING = re.compile(r"(attach(_\w+)?|set_hooks|set_\w+_hooks?)")
SETTERS = ("setattr", "object.__setattr__")


def _attribute_root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _patched_after_build(where: str, text: str) -> list[str]:
    """Each function that writes an attribute onto one of its own parameters other than
    ``self`` / ``cls`` (``p.x = ...``, ``p.x.y += ...``, ``setattr(p, ...)``), and each one named
    to attach something to a built object (``attach``, ``set_hooks``, ``set_*_hook``)."""
    found = []
    for fn in _functions(ast.parse(text)):
        at = f"{where}:{fn.lineno} {fn.name}"
        if ATTACHING.fullmatch(fn.name):
            found.append(f"{at}: named to attach")
        a = fn.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p}
        params -= {"self", "cls"}
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in SETTERS and node.args:
                root = _attribute_root(node.args[0])
                if isinstance(root, ast.Name) and root.id in params:
                    found.append(
                        f"{at}: {ast.unparse(node.func)}({ast.unparse(node.args[0])}, ...)"
                    )
            while targets:
                t = targets.pop(0)
                if isinstance(t, ast.Tuple | ast.List):
                    targets += t.elts
                elif isinstance(t, ast.Starred):
                    targets.append(t.value)
                elif isinstance(t, ast.Attribute):
                    root = _attribute_root(t)
                    if isinstance(root, ast.Name) and root.id in params:
                        found.append(f"{at}: writes {ast.unparse(t)}")
    return found


def test_nothing_is_attached_to_a_part_after_it_is_built():
    """No function writes an attribute onto an object it was handed (only an object's own
    methods write its attributes), and none is named to attach a hook to a built part: a part
    gets what it needs in its constructor (docs/design.md section 2.2)."""
    patched = [
        finding
        for path in _sources()
        for finding in _patched_after_build(str(path.relative_to(ROOT)), path.read_text())
    ]
    assert not patched, "\n".join(patched)


PLANTED_PATCHES = """
import dataclasses


def build(trainer, hooks):
    trainer.hooks = hooks


def wire(side, *, pool):
    setattr(side, "pool", pool)


def plan(engine, n):
    def later():
        engine.config.steps += n

    return later


def fill(rollout, trace):
    rollout.token_ids, rollout.loss_mask = trace


class Trainer:
    def __init__(self, hooks):
        self.hooks = hooks

    def attach(self, side): ...

    def set_step_hook(self, hook): ...


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str

    def __post_init__(self):
        object.__setattr__(self, "name", self.name.strip())
"""


def test_the_attach_check_catches_a_planted_patch():
    """A planted module: a part patched by assignment, by ``setattr``, from a closure and through
    a tuple target, and methods named to attach, are found; an object writing its own
    attributes (``self``, a dataclass normalising its own field) is not."""
    found = _patched_after_build("planted.py", PLANTED_PATCHES)
    assert found == [
        "planted.py:5 build: writes trainer.hooks",
        "planted.py:9 wire: setattr(side, ...)",
        "planted.py:13 plan: writes engine.config.steps",
        "planted.py:20 fill: writes rollout.token_ids",
        "planted.py:20 fill: writes rollout.loss_mask",
        "planted.py:28 attach: named to attach",
        "planted.py:30 set_step_hook: named to attach",
    ], found


# The repository stands alone: a clone has nothing beside it, so its files may cite only what it
# holds. The patterns are spelled so that this file does not match them itself.
DESIGN_NOTES = ROOT / "docs" / "design.md"
TEXT_FILES = ("*.py", "*.md", "*.toml", "*.gin", "*.sh", "*.yaml", "*.yml")
SECTION_HEADING = re.compile(r"^##(#?) (\d+(?:\.\d+)?)\.? \S", re.MULTILINE)
LEAKS = {
    "cites the team's guidance outside the repository": re.compile(r"\bDESIGN\b"),
    "points into the shared folder beside the checkout": re.compile(r"\.\./shared\b"),
    "names an absolute path of the machine it was written on": re.compile(r"(?<![\w.~-])/w[o]rk/"),
}
RELATIVE_PATH = re.compile(r"(?<![\w./])((?:\.\./)+[\w./-]*)")
DOCS_PAGE = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)\b")
MD_LINK = re.compile(r"\]\(([^)#\s:]+\.md)(?:#[^)]*)?\)")
DESIGN_SECTION = re.compile(r"design\.md\S{0,2}\s+section\s+(\d+(?:\.\d+)?)")


def _text_files() -> list[Path]:
    """The repository's text files: tracked, plus new ones git does not ignore."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *TEXT_FILES],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return [ROOT / p for p in listed.split("\0") if p and (ROOT / p).is_file()]


def _leaks(path: Path, text: str) -> list[str]:
    """Where ``text`` (the file at ``path``) reaches outside the repository, one entry each."""
    found = []
    for line_no, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{line_no}"
        found += [f"{where} {why}: {line.strip()}" for why, p in LEAKS.items() if p.search(line)]
        for rel in RELATIVE_PATH.findall(line):
            target = os.path.normpath(path.parent / rel)
            if os.path.commonpath([ROOT, target]) != str(ROOT):
                found.append(f"{where} leaves the repository ({rel}): {line.strip()}")
    return found


def test_design_notes_are_in_the_repository_with_numbered_sections():
    """docs/design.md exists, and its sections are numbered 1, 2, ... so code can cite one."""
    text = DESIGN_NOTES.read_text()
    numbers = [int(n) for sub, n in SECTION_HEADING.findall(text) if not sub]
    assert len(numbers) >= 10, numbers
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_nothing_cites_a_document_outside_the_repository():
    """No text file cites the team's guidance, the folder beside the checkout, an absolute path
    of the machine or a relative path that climbs out of the repository."""
    leaks = [leak for path in _text_files() for leak in _leaks(path, path.read_text())]
    assert not leaks, "\n".join(leaks)


def test_the_leak_check_catches_a_planted_citation():
    """Each kind of leak is found in a planted page (spelled in pieces: see LEAKS)."""
    planted = "\n".join(
        [
            "See " + "../" + "shared/notes.md for the rest.",
            "The rules are in " + "DES" + "IGN.md section 4.",
            "Copied from /" + "work/main/README.md.",
            "[up](" + "../" * 3 + "elsewhere.md), but [here](../README.md) is fine.",
        ]
    )
    leaks = _leaks(ROOT / "docs" / "planted.md", planted)
    assert [int(leak.split(":")[1].split()[0]) for leak in leaks] == [1, 2, 3, 4], leaks
    assert not _leaks(ROOT / "tests" / "planted.py", "('../sharding/rules.py', '.../x')")


def test_every_cited_docs_page_and_design_section_exists():
    """Every ``docs/<name>.md`` a file names, every ``.md`` link of a page and every
    ``design.md section N`` a file cites exists."""
    sections = {n for _, n in SECTION_HEADING.findall(DESIGN_NOTES.read_text())}
    missing = []
    for path in _text_files():
        text, where = path.read_text(), path.relative_to(ROOT)
        pages = [ROOT / "docs" / name for name in DOCS_PAGE.findall(text)]
        if path.suffix == ".md":
            pages += [path.parent / link for link in MD_LINK.findall(text)]
        missing += [f"{where}: {page.relative_to(ROOT)}" for page in pages if not page.is_file()]
        missing += [
            f"{where}: docs/design.md section {n}"
            for n in DESIGN_SECTION.findall(text)
            if n not in sections
        ]
    assert not missing, missing
