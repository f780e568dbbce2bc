"""Build-time selection: ``DEEPINFER_ACCELERATOR=<name> pip install .`` ships only that backend and records it as
the default. Proven by building real wheels and reading what they contain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("core", "model", "backends", "setup.py", "pyproject.toml", "README.md")


def _build_wheel(tmp_path: Path, accelerator: str | None) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    for name in SOURCES:
        item = ROOT / name
        if item.is_dir():
            shutil.copytree(item, src / name, ignore=shutil.ignore_patterns("__pycache__", "_build_config.py"))
        else:
            shutil.copy(item, src / name)
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_ACCELERATOR"}
    if accelerator is not None:
        env["DEEPINFER_ACCELERATOR"] = accelerator
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path / "out"),
        ".",
    ]
    return subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)


def _read_wheel(tmp_path: Path) -> tuple[set[str], str, str, str]:
    (wheel,) = (tmp_path / "out").glob("deepinfer-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        return names, z.read("deepinfer/_build_config.py").decode(), z.read(info).decode(), z.read(entry).decode()


def _hard_requirements(metadata: str) -> set[str]:
    """Names of the unconditional requirements (no extra marker)."""
    lines = [ln.removeprefix("Requires-Dist: ") for ln in metadata.splitlines() if ln.startswith("Requires-Dist: ")]
    return {ln.split(";")[0].split(">")[0].split("=")[0].strip() for ln in lines if ";" not in ln}


def _packages(names: set[str]) -> set[str]:
    return {n.split("/")[0] for n in names if n.endswith(".py")}


@pytest.mark.slow
def test_ascend_build_ships_only_ascend_and_records_it(tmp_path):
    result = _build_wheel(tmp_path, "ascend")
    assert result.returncode == 0, result.stderr
    names, config, metadata, entry_points = _read_wheel(tmp_path)
    assert _packages(names) == {"deepinfer", "deepinfer_ascend"}
    assert "deepinfer/model/__init__.py" in names and "deepinfer/ops/gemm.py" in names
    assert "DEFAULT_ACCELERATOR = 'ascend'" in config
    assert "torch-npu" in _hard_requirements(metadata)
    assert "ascend = deepinfer_ascend.plugin" in entry_points and "cuda_sm100" not in entry_points


@pytest.mark.slow
def test_alias_build_and_default_build(tmp_path):
    result = _build_wheel(tmp_path / "cuda", "cuda")  # an alias of cuda_sm100
    assert result.returncode == 0, result.stderr
    names, config, metadata, _ = _read_wheel(tmp_path / "cuda")
    assert _packages(names) == {"deepinfer", "deepinfer_cuda_sm100"}
    assert "DEFAULT_ACCELERATOR = 'cuda_sm100'" in config
    assert "torch-npu" not in _hard_requirements(metadata) and "triton" in _hard_requirements(metadata)

    result = _build_wheel(tmp_path / "all", None)
    assert result.returncode == 0, result.stderr
    names, config, metadata, _ = _read_wheel(tmp_path / "all")
    assert _packages(names) == {"deepinfer", "deepinfer_cuda_sm100", "deepinfer_ascend"}
    assert "DEFAULT_ACCELERATOR = None" in config
    embedded = "deepinfer/model/checkpoints/tiny-py/"  # the default model ships in every wheel
    for variant in ("bf16", "fp8"):
        assert {f"{embedded}{variant}/{f}" for f in ("config.json", "model.safetensors", "tokenizer.json")} <= names
    assert {embedded + "training.json", embedded + "README.md"} <= names
    assert not {"torch-npu", "triton"} & _hard_requirements(metadata)


def test_unknown_accelerator_fails_the_build_with_the_known_names(tmp_path):
    result = _build_wheel(tmp_path, "tpu")
    assert result.returncode != 0
    assert "DEEPINFER_ACCELERATOR='tpu' is not a backend" in result.stderr + result.stdout
    assert "cuda_sm100" in result.stderr + result.stdout
