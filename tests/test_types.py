"""The package type-checks clean under mypy and the tree is ruff clean, with the settings in pyproject.toml."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[dev]')")
def test_packages_type_check_clean() -> None:
    # No arguments: the packages, the overrides and the cache directory come from [tool.mypy].
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mypy found type errors:\n{proc.stdout}{proc.stderr}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_the_tree_is_ruff_clean() -> None:
    # The rules come from [tool.ruff] in pyproject.toml: the package, the tests and the benchmarks.
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"
