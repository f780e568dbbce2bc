"""The READMEs a reader follows: every in-tree backend has one (what it runs, how it is selected and tested), and
every relative link in a README points at a file of the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(
    p for p in ROOT.rglob("README.md") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
)


@pytest.mark.parametrize(
    "backend", sorted(p.name for p in (ROOT / "backends").iterdir() if p.is_dir() and p.name[0] != "_")
)
def test_every_backend_has_a_readme(backend):
    readme = ROOT / "backends" / backend / "README.md"
    assert readme.is_file(), f"backends/{backend} has no README.md"
    text = readme.read_text()
    assert f"(`deepinfer_{backend}`)" in text.splitlines()[0], "the title names the backend and its package"
    assert "DEEPINFER_ACCELERATOR" in text or "deepinfer.use" in text, "says how the backend is selected"
    assert "tests/test_" in text, "says which tests check it"


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(readme):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text())
    broken = [t for t in links if "://" not in t and not (readme.parent / t).exists()]
    assert not broken, broken
