"""The boundaries of docs/design.md section 2, enforced: import-linter contracts from
pyproject.toml.

Orchestrator components never import each other (only the loop drives them); layers only import
downwards; sharding/ knows nothing of models or RL; inference/ knows nothing of orchestration;
algorithms/ are pure. And the repository stands alone: its design notes are docs/design.md, no
file cites a document outside the repository, and every docs page a file cites exists.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
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
    # the orchestrator reaching for JAX or an engine module instead of a types.py Protocol
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
