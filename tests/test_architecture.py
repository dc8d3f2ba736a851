"""The boundaries of DESIGN.md section 2, enforced: import-linter contracts from pyproject.toml.

Orchestrator components never import each other (only loop.py wires them); layers only import
downwards; sharding/ knows nothing of models or RL; inference/ knows nothing of orchestration;
algorithms/ are pure.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_contracts_catch_a_component_importing_another(tmp_path):
    """The independence contract really is checked: a planted import in a copy breaks it."""
    for name in ("jaxrl_orch", "sharding"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    gate = tmp_path / "jaxrl_orch" / "orchestrator" / "gate.py"
    gate.write_text(gate.read_text() + "\nfrom jaxrl_orch.orchestrator import store  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "independent" in result.stdout


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
