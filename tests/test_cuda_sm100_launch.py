"""The NVIDIA backend's launch rule for programmatic dependent launch, read from its source.

A kernel launched with ``launch_pdl=PDL`` may start before the previous kernel in the stream has finished; only its
``pdl_wait()`` orders it after that kernel. So every `tl` kernel must begin with ``pdl_wait()``, and only such
kernels may be launched with ``launch_pdl``: a kernel that touched memory first could read a buffer still being
written. The GPU cannot check this on the CPU (the interpreter runs without the flag), so the source is checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parents[1] / "backends" / "cuda_sm100"
MODULES = sorted(p for p in BACKEND.glob("*.py") if p.name != "_triton.py")


def kernels(tree: ast.Module, decorator: str) -> dict[str, ast.FunctionDef]:
    """Module-level functions named ``*_kernel`` with a ``decorator`` (``triton.jit`` or ``gluon.jit``)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if decorator in names:
                found[node.name] = node
    return found


def first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if has_doc else body[0]


def launches(tree: ast.Module) -> list[ast.Call]:
    """Calls of the form ``NAME[grid](...)``."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name)
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_triton_kernel_waits_for_its_predecessor_first(path):
    tree = ast.parse(path.read_text())
    for name, fn in kernels(tree, "triton.jit").items():
        assert ast.unparse(first_statement(fn)) == "pdl_wait()", f"{path.name}: {name} must begin with pdl_wait()"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_launch_pdl_only_on_kernels_that_wait(path):
    tree = ast.parse(path.read_text())
    tl_kernels = kernels(tree, "triton.jit")
    gluon_kernels = kernels(tree, "gluon.jit")
    for call in launches(tree):
        name = call.func.value.id
        flag = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("launch_pdl")
        if name in tl_kernels:
            assert flag == "PDL", f"{path.name}:{call.lineno}: {name} is launched without launch_pdl=PDL"
        elif name in gluon_kernels:  # Gluon has no griddepcontrol wait: its kernels keep the plain launch order
            assert flag is None, f"{path.name}:{call.lineno}: {name} (Gluon) must not be launched with launch_pdl"


def test_the_rule_covers_the_backend():
    """The checks above see the kernels they are meant to: the decode path's GEMMs, norms and MoE kernels."""
    names = set()
    for path in MODULES:
        names |= set(kernels(ast.parse(path.read_text()), "triton.jit"))
    assert {"_gemm_swapped_kernel", "_grouped_masked_swapped_kernel", "_rms_norm_kernel", "_route_kernel"} <= names
    assert len(names) >= 20
