"""The NVIDIA backend's launch rule for programmatic dependent launch, read from its source.

A kernel launched with ``launch_pdl=PDL`` may start before the previous kernel in the stream has finished; only its
``pdl_wait()`` orders it after that kernel. So every `tl` kernel must begin with ``pdl_wait()``, and only such
kernels may be launched with ``launch_pdl``: a kernel that touched memory first could read a buffer still being
written (or reuse one the allocator handed back). The interpreter runs without the flag, so the source is checked,
and a few kernels are compiled for SM90 (no GPU needed) to check that the compiler keeps the wait first. Gluon has no
wait of its own: a Gluon kernel may be launched early only if it calls ``_gluon.wait_previous`` (itself or in one of
its warp-specialized partitions); where the wait sits is checked on its compiled PTX in ``test_mla_gluon.py`` and
``test_gemm_gluon.py``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parents[1] / "backends" / "cuda_sm100"
MODULES = sorted(p for p in BACKEND.glob("*.py") if p.name != "_triton.py")


def kernels(tree: ast.Module, decorator: str, suffix: str = "_kernel") -> dict[str, ast.FunctionDef]:
    """Module-level functions named ``*{suffix}`` with a ``decorator`` (``triton.jit`` or ``gluon.jit``)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.endswith(suffix):
            names = [ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list]
            if decorator in names:
                found[node.name] = node
    return found


def first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if has_doc else body[0]


def waits(tree: ast.Module, fn: ast.FunctionDef) -> bool:
    """Whether ``fn``, or a module-level function it names (a warp-specialized partition), calls ``wait_previous``."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    named = {node.id for node in ast.walk(fn) if isinstance(node, ast.Name)} & functions.keys()
    return any(
        isinstance(node, ast.Call) and ast.unparse(node.func) == "wait_previous"
        for f in [fn, *(functions[name] for name in named)]
        for node in ast.walk(f)
    )


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
    gluon_kernels = kernels(tree, "gluon.jit", suffix="")  # Gluon kernels go by other names too (``fp8_gemm_ws``)
    for call in launches(tree):
        name = call.func.value.id
        flag = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("launch_pdl")
        if name in tl_kernels:
            assert flag == "PDL", f"{path.name}:{call.lineno}: {name} is launched without launch_pdl=PDL"
        elif name in gluon_kernels and flag is not None:
            assert waits(tree, gluon_kernels[name]), f"{path.name}:{call.lineno}: {name} is launched early, never waits"


def test_the_rule_covers_the_backend():
    """The checks above see the kernels they are meant to: the decode path's GEMMs, norms and MoE kernels."""
    names = set()
    for path in MODULES:
        names |= set(kernels(ast.parse(path.read_text()), "triton.jit"))
    assert {"_gemm_swapped_kernel", "_grouped_masked_swapped_kernel", "_rms_norm_kernel", "_route_kernel"} <= names
    assert len(names) >= 20


def test_the_compiled_wait_comes_before_any_global_memory_access():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_CUDA_PDL")}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    order = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(order) == 15
    for name, (trigger, wait, first_access) in order.items():
        assert trigger is not None and wait is not None, f"{name}: no griddepcontrol in its PTX"
        assert first_access is not None and wait < first_access, f"{name}: global memory touched before the wait"


def compiled_order() -> dict[str, tuple[int | None, int | None, int | None]]:
    """PTX line numbers (from the entry) of launch_dependents, wait and the first global load, store, atomic or async
    copy, for the kernels compiled for SM90 with their decode-path settings (the swapped GEMM with TMA copies and
    with pointer loads, and storing its K blocks' products for the kernel that chains them), the grouped GEMM reading
    a strided operand by 3-D TMA copies, and the sparse attention kernels at DeepSeek-V3.2's shapes (which the
    interpreter runs at small ones only: this also checks that they compile for the GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer_cuda_sm100 import gemm, norm, sparse_attention

    def order(fn, types: list[str], constexprs: dict) -> tuple[int | None, int | None, int | None]:
        names = fn.arg_names
        signature = dict(zip(names, types + ["constexpr"] * (len(names) - len(types))))
        ptx = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 64)).asm["ptx"]
        lines = [line.strip() for line in ptx.split("\n")]
        body = lines[next(i for i, line in enumerate(lines) if line.startswith(".visible .entry")) :]
        at = lambda pattern: next((i for i, line in enumerate(body) if re.search(pattern, line)), None)
        return (
            at("griddepcontrol.launch_dependents"),
            at("griddepcontrol.wait"),
            at(r"^(@!?%p\d+ )?(ld\.global|st\.global|cp\.async|atom\.|red\.)"),
        )

    fp8_operands = ["*fp8e4nv", "*fp8e4nv", "*bf16", "*fp32", "*fp32"]
    tile = {"TMA": False, "FP32_DOT": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}
    return {
        "_rms_norm_kernel": order(
            norm._rms_norm_kernel, ["*bf16"] * 5 + ["i32", "i32", "fp32"], {"HAS_RES": True, "BLOCK": 8192}
        ),
        "_quantize_kernel": order(
            gemm._quantize_kernel,
            ["*bf16", "*fp8e4nv", "*fp32", "i32", "i32"],
            {"UE8M0": False, "BLOCK": 128, "ROWS": gemm.QUANTIZE_ROWS, "PREROUND": False},
        ),
        "_gemm_swapped_kernel": order(
            gemm._gemm_swapped_kernel,
            [*fp8_operands, "*bf16"] + ["i32"] * 6,
            {**tile, "HAS_BIAS": False, "SPLIT_K": 4, "BLOCK_PARTS": False},
        ),
        "_gemm_swapped_kernel, block parts": order(
            gemm._gemm_swapped_kernel,
            [*fp8_operands, "*fp32"] + ["i32"] * 6,
            {**tile, "HAS_BIAS": False, "SPLIT_K": 4, "BLOCK_PARTS": True},
        ),
        "_chain_blocks_kernel": order(
            gemm._chain_blocks_kernel,
            ["*fp32"] * 3 + ["*bf16"] * 2 + ["i32"] * 3,
            {"KB": 56, "HAS_BIAS": False, "BLOCK": 256},
        ),
        "_gemm_swapped_kernel, TMA": order(
            gemm._gemm_swapped_kernel,
            ["tensordesc<fp8e4nv[16, 128]>", "tensordesc<fp8e4nv[64, 128]>", *fp8_operands[2:], "*bf16"] + ["i32"] * 6,
            {**tile, "TMA": True, "HAS_BIAS": False, "SPLIT_K": 1, "BLOCK_PARTS": False},
        ),
        # an fp32 weight (the router's) against a bf16 activation, as the few-row and batch-invariant paths take it
        "_gemm_kernel, tf32x3 from a bf16 activation": order(
            gemm._gemm_kernel,
            ["tensordesc<bf16[64, 32]>", "tensordesc<fp32[32, 32]>"] + ["*fp32"] * 4 + ["i32"] * 6,
            {"FP8": False, "TMA": True, "HAS_BIAS": False, "FP32_DOT": False, "TF32X3": True, "BLOCK_M": 64}
            | {"BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 4},
        ),
        "_grouped_masked_swapped_kernel": order(
            gemm._grouped_masked_swapped_kernel,
            [*fp8_operands, "*i32"] + ["i32"] * 8,
            {**tile, "BLOCK_E": 256},
        ),
        # absorbed MLA's per-head products at 64 rows or more: the strided operand read by 3-D TMA copies
        "_grouped_gemm_kernel, 3-D copies of A": order(
            gemm._grouped_gemm_kernel,
            ["tensordesc<bf16[1, 64, 64]>", "tensordesc<bf16[128, 64]>"] + ["*bf16"] * 4 + ["*i32"] + ["i32"] * 10,
            {"MASKED": True, "FP8": False, "TMA": True, "A3D": True, "FP32_DOT": False, "BLOCK_M": 64}
            | {"BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_E": 128, "GROUP_M": 16},
        ),
        # DeepSeek-V3.2's sparse attention at its shapes: 64 indexer heads of 128 over an fp8_ds_index cache (132-byte
        # records), sparse MLA over 656-byte fp8_ds_mla records, 128 heads in blocks of 64.
        "_write_index_kernel": order(
            sparse_attention._write_index_kernel,
            ["*bf16", "*i64", "*u8", "*fp32", "i32"],
            {"D": 128, "BLOCK_D": 128, "GROUPS": 1, "WIDTH": 132, "FP8": True, "PREROUND": False},
        ),
        "_token_rows_kernel": order(sparse_attention._token_rows_kernel, ["*i32"] * 4, {"BLOCK": 256}),
        "_index_scores_kernel": order(
            sparse_attention._index_scores_kernel,
            ["*bf16", "*fp32", "*u8", "*fp32", "*i32", "*i32", "*i32", "*i64"] + ["i32"] * 7,
            {"D": 128, "WIDTH": 132, "PAGE": 64, "FP8": True, "SPAN": 2048, "FP32_DOT": False}
            | {k: v for k, v in sparse_attention._scores_config(64).items() if k.isupper()},
        ),
        "_topk_slots_kernel": order(
            sparse_attention._topk_slots_kernel,
            ["*i64", "*i32", "*i32", "*i32"] + ["i32"] * 5,
            {"PAGE": 64, "ROWS": 1, "BLOCK_K": 2048},
        ),
        "_sparse_mla_kernel": order(
            sparse_attention._sparse_mla_kernel,
            ["*bf16", "*u8", "*fp32", "*bf16", "*i32", "*bf16", "*fp32", "fp32"] + ["i32"] * 6,
            {"L": 512, "LH": 256, "R": 64, "BLOCK_R": 64, "WIDTH": 656, "ROPE_AT": 264, "FP8": True, "SPLIT": 2048}
            | {"BLOCK_H": 64, "BLOCK_N": 64, "LIST_CHUNK": 1024, "FP32_DOT": False},
        ),
        "_layer_norm_kernel": order(norm._layer_norm_kernel, ["*bf16"] * 4 + ["i32", "fp32"], {"BLOCK": 128}),
    }


if __name__ == "__main__":  # the subprocess of the test above: compiled without the interpreter
    print(json.dumps(compiled_order()))
