"""Helpers of the Gluon kernels' CPU tests: compiling for SM90 without a GPU and reading what ptxas says."""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

MAX_SHARED = 227 * 1024  # an SM90 block's shared memory


def descriptor_type(tensor: torch.Tensor, block: list[int], dtype) -> str:
    """The signature type of a TMA descriptor of ``tensor`` in ``block``s with the default NVMMA layout."""
    desc = TensorDescriptor.from_tensor(tensor, block, gl.NVMMASharedLayout.get_default_for(block, dtype))
    return native_specialize_impl(BaseBackend, desc, False, True, True)[0]


def compile_sm90(kernel, signature: dict, constants: dict, options: dict):
    """``kernel`` compiled for SM90; pointer arguments are taken as 16-byte aligned, as launches on the GPU see them."""
    signature = signature | dict.fromkeys(constants, "constexpr")
    names = kernel.arg_names
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items() if kind[0] == "*"}
    source = GluonASTSource(kernel, signature, constants, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def assemble(ptx: str, sass: bool = True) -> tuple[str, str]:
    """What the ptxas Triton compiles SM90 kernels with says (``-v``) when it assembles ``ptx``, and (``sass``) the
    machine code as ``cuobjdump -sass`` lists it (both tools ship with Triton; else "")."""
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(ptx)
        cubin = os.path.join(tmp, "k.cubin")
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", cubin], capture_output=True, text=True,
                              check=True)  # fmt: skip
        if not sass:
            return done.stdout + done.stderr, ""
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        listing = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return done.stdout + done.stderr, listing


def ptxas_report(ptx: str) -> str:
    """What the ptxas Triton compiles SM90 kernels with says (``-v``) when it assembles ``ptx``."""
    return assemble(ptx, sass=False)[0]


def wgmma_serialized(report: str) -> bool:
    """Whether ``ptxas_report`` says ptxas made each wgmma instruction wait for the one before, for any reason: C7514
    (registers of a product used while it may still run), C7512 (too few registers for products in flight), ... That
    cost a Gluon GEMM 1.1-1.2x of its time (benchmarks/NOTES.md, gemm: 2026-12-02 — a warp-specialized Gluon FP8
    gemm; 2026-12-04 — Gluon gemm schedules in interleaved rounds)."""
    return "wgmma.mma_async instructions are serialized" in report


def gemm_descriptor_types() -> dict[str, str]:
    """The signature types of the warp-specialized FP8 GEMMs' descriptors (``gemm_gluon._descriptors``): A in 64-row
    blocks, B in 128 x 128, the bf16 result in 64 x 128."""
    fp8 = torch.empty(384, 512, dtype=torch.float8_e4m3fn)
    return {
        "a_desc": descriptor_type(fp8, [64, 128], gl.float8e4nv),
        "b_desc": descriptor_type(fp8, [128, 128], gl.float8e4nv),
        "c_desc": descriptor_type(torch.empty(256, 256, dtype=torch.bfloat16), [64, 128], gl.bfloat16),
    }


def compile_gemm_sm90(schedule, trace_tiles: int = 0):
    """``gemm_gluon``'s kernel for K = 512 in ``schedule``, compiled as ``gemm_gluon.launch`` compiles it (with a
    trace of ``trace_tiles`` tiles, as ``launch(..., trace=...)``)."""
    from deepinfer_cuda_sm100 import gemm_gluon

    signature = (
        gemm_descriptor_types()
        | {
            "as_ptr": "*fp32",
            "bs_ptr": "*fp32",
            "trace_ptr": "*i64" if trace_tiles else "*bf16",  # untraced: the output's pointer, unused
        }
        | dict.fromkeys(("M", "N"), "i32")
    )
    options = {"num_warps": 4, "enable_fp_fusion": True}
    constants = schedule.constexprs() | {"K_BLOCKS": 4, "TRACE_TILES": trace_tiles}
    return compile_sm90(gemm_gluon.fp8_gemm_ws, signature, constants, options)
