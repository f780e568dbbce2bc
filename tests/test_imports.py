"""The core and the model stay device-agnostic: no backend, Triton, CuPy or torch_npu imports, no plugin loading and
no device initialisation at import, and probing touches no device."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"deepinfer_cuda_sm100", "deepinfer_ascend", "triton", "cupy", "torch_npu"}


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_and_model_import_no_vendor_code():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_modules(p) & FORBIDDEN)
        for folder in ("core", "model")
        for p in (ROOT / folder).rglob("*.py")
        if _imported_modules(p) & FORBIDDEN
    }
    assert not offenders, offenders


def test_backends_do_not_import_each_other():
    packages = {"cuda_sm100": "deepinfer_cuda_sm100", "ascend": "deepinfer_ascend"}
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_modules(p) & (set(packages.values()) - {own}))
        for folder, own in packages.items()
        for p in (ROOT / "backends" / folder).rglob("*.py")
        if _imported_modules(p) & (set(packages.values()) - {own})
    }
    assert not offenders, offenders


def test_the_model_takes_platform_facts_from_the_backend_spec():
    """Process-group backends and free device memory come from ``BackendSpec`` (``dist_backend``, ``free_memory``):
    the model names no collective library and asks no vendor module for memory."""
    words = ("nccl", "hccl", "mem_get_info", "torch.npu")
    offenders = {
        str(p.relative_to(ROOT)): [w for w in words if w in p.read_text()]
        for p in (ROOT / "model").rglob("*.py")
        if any(w in p.read_text() for w in words)
    }
    assert not offenders, offenders


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_loads_no_plugin_and_touches_no_device():
    code = (
        "import sys, torch, deepinfer\n"
        "from deepinfer import registry\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(loaded, registry._REGISTRY is None, torch.cuda.is_initialized())\n"
    )
    assert _run(code) == "[] True False"


def test_probing_every_backend_initialises_no_device():
    code = (
        "import torch, deepinfer\n"
        "from deepinfer import registry, selection\n"
        "reg = registry.get()\n"
        "[reg.probe(n) for n in reg.backends]\n"
        "selection.describe_backends()\n"
        "print(torch.cuda.is_initialized())\n"
    )
    assert _run(code) == "False"
