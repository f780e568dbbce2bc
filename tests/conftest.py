"""Shared fixtures: every test starts from a fresh plugin registry and no backend selection; ``plugins`` installs
throw-away plugin distributions; the example plugin of ``tests/plugins`` is visible to every test as if installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


EXAMPLE_PLUGIN = Path(__file__).resolve().parent / "plugins" / "deepinfer_example"


@pytest.fixture(scope="session", autouse=True)
def example_plugin(tmp_path_factory):
    """Makes ``tests/plugins/deepinfer_example`` visible to this process and its subprocesses as an installed
    distribution, so the tests need no ``pip install`` of it: its ``*.dist-info`` (``METADATA``,
    ``entry_points.txt``), written by setuptools from the plugin's own ``pyproject.toml``, goes into a temporary
    directory, and that directory and the plugin's source go on ``sys.path`` and ``PYTHONPATH``. The registry then
    finds ``example_cpu`` and ``example_buggy`` through the ``deepinfer`` entry-point group, as it finds a vendor's
    plugin. Nothing is done if the plugin is installed already."""
    try:
        importlib.metadata.distribution("deepinfer-example")
        yield
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    site = tmp_path_factory.mktemp("example_plugin")
    scratch = tmp_path_factory.mktemp("example_plugin_build")
    build = (
        "import sys\n"
        "from setuptools.build_meta import prepare_metadata_for_build_wheel\n"
        "print(prepare_metadata_for_build_wheel(sys.argv[1]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(scratch)], cwd=EXAMPLE_PLUGIN, capture_output=True, text=True
    )
    assert done.returncode == 0, f"the example plugin's metadata could not be built:\n{done.stderr}"
    info = done.stdout.strip().splitlines()[-1]
    shutil.move(str(scratch / info), site / info)  # the dist-info alone: the egg-info beside it would count twice
    paths = [str(site), str(EXAMPLE_PLUGIN)]
    old_path, old_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [old_env])])
    importlib.invalidate_caches()
    yield
    sys.path[:] = old_path
    if old_env is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old_env
    importlib.invalidate_caches()


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
