"""Lint is a test: ``ruff check`` and ``ruff format --check`` over the whole tree, with the settings of
``pyproject.toml``. ruff comes with the ``[test]`` extra; a missing ruff fails here rather than skipping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, f"ruff {' '.join(command)} .\n{out.stdout}{out.stderr}"
