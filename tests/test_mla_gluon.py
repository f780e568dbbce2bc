"""The Hopper split kernel of ``mla_decode`` in Gluon (``backends/cuda_sm100/mla_gluon.py``), compiled for SM90 on the
CPU. Gluon has no interpreter, so its results are proven on the GPU (conformance at full shapes, RESULTS.md); here CI
checks that it still compiles with the installed Triton and that its tensor-core work has the intended shape: each
block's scores computed once, by one warpgroup, and P x V split between the two warpgroups."""

from __future__ import annotations

import re

import pytest
import torch
import triton

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from deepinfer_cuda_sm100 import mla_gluon

MAX_SHARED = 227 * 1024  # an SM90 block's shared memory


def _descriptor(records: torch.Tensor, cols: int):
    layout = gl.NVMMASharedLayout.get_default_for([64, cols], gl.bfloat16)
    return TensorDescriptor.from_tensor(records, [64, cols], layout)


def test_split_kernel_compiles_for_sm90_with_scores_once_and_values_split():
    records = torch.empty(4096, 576, dtype=torch.bfloat16)
    signature = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    signature |= {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32"}
    signature |= dict.fromkeys(("S_q", "H", "stride_qb", "stride_qs", "stride_qh", "stride_table", "n_splits"), "i32")
    for name, cols in (("lat_desc", 256), ("rope_desc", 64)):
        signature[name] = native_specialize_impl(BaseBackend, _descriptor(records, cols), False, True, True)[0]
    constants = {"PAGE": 64, "WIDTH": 576, "SPLIT": 1024, "RIGHT_REGS": mla_gluon.RIGHT_REGS}
    signature |= dict.fromkeys(constants, "constexpr")
    source = GluonASTSource(mla_gluon._mla_split_kernel, signature, constants)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

    ptx = kernel.asm["ptx"]
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)
    # scores: [64 heads, 64 tokens] over 576 = 36 steps of k16, at two call sites (first block, then each next one);
    # P x V: 64 tokens = 4 steps of k16 per warpgroup, each warpgroup on its own 256 latent columns
    assert {shape: shapes.count(shape) for shape in set(shapes)} == {"m64n64k16": 72, "m64n256k16": 8}
    assert "setmaxnreg" in ptx  # the two warpgroups are specialised
    assert kernel.metadata.shared <= MAX_SHARED
