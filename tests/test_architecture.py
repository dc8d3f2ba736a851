"""The boundaries of DESIGN.md section 2, enforced: import-linter contracts from pyproject.toml.

Orchestrator components never import each other (only the loop drives them); layers only import
downwards; sharding/ knows nothing of models or RL; inference/ knows nothing of orchestration;
algorithms/ are pure.
"""

import ast
import os
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
