"""Shared fixtures: every test starts from a fresh plugin registry and no backend selection; ``plugins`` installs
throw-away plugin distributions."""

from __future__ import annotations

import importlib
import sys

import pytest
from fake_plugins import install_plugin

from deepinfer import registry, selection

SELECTION_VARS = (
    "DEEPINFER_ACCELERATOR",
    "DEEPINFER_PLUGINS",
    "DEEPINFER_STRICT",
    "DEEPINFER_BATCH_INVARIANT",
    "DEEPINFER_VALUE_CHECKS",
)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    for var in SELECTION_VARS:
        monkeypatch.delenv(var, raising=False)
    registry.reload()
    yield
    del selection._explicit[:]
    registry.reload()


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Returns an installer of fake plugin distributions visible to the next registry load."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        install_plugin(tmp_path, dist, entry_points, modules)
        importlib.invalidate_caches()
        registry.reload()

    yield install
    for mod in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[mod]
