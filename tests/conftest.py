"""Shared fixtures: every test starts from a fresh plugin registry and no backend selection."""

from __future__ import annotations

import pytest

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
