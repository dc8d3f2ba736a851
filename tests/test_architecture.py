"""The boundaries of DESIGN.md section 2, enforced: import-linter contracts from pyproject.toml.

Orchestrator components never import each other (only loop.py wires them); layers only import
downwards; sharding/ knows nothing of models or RL; inference/ knows nothing of orchestration;
algorithms/ are pure.
"""

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
    # a component importing another: only loop.py wires them
    "independent": ("orchestrator/gate.py", "from jaxrl_orch.orchestrator import store"),
    # the orchestrator reaching for JAX or an engine module instead of a types.py Protocol
    "no engine, trainer": ("orchestrator/gate.py", "import jax"),
    # a helper module reaching for a component
    "helpers hold no component": (
        "orchestrator/step_ledger.py",
        "from jaxrl_orch.orchestrator import gate",
    ),
    # config climbing above the orchestrator
    "layering": ("config.py", "from jaxrl_orch.orchestrator import loop"),
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
