"""The FP4 expert kernel's two paths (``backends/cuda_sm100/gemm_triton.py``, ``_grouped_gemm_fp4_kernel``): bf16
activations hand the codes to ``tl.dot_scaled`` (SM90, and SM100's ``tcgen05-fp4``), and the hand path decodes them
itself (fp32 activations, SM100 while ``tcgen05-fp4`` is off). Each is compiled here for its GPU (no GPU needed);
the ``tl.dot_scaled`` path is checked against the reference through the Triton interpreter, and on the GPU by the
conformance suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deepinfer_cuda_sm100 import gemm  # noqa: E402
from deepinfer_cuda_sm100.gemm_triton import _grouped_gemm_fp4_kernel  # noqa: E402

SIGNATURE = {"a_ptr": "*bf16", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*bf16", "offsets_ptr": "*i32"}
SIGNATURE |= {"masked_ptr": "*i32"} | dict.fromkeys(("E", "N", "K", "max_m", "GRID_M", "stride_am", "stride_cm"), "i32")


def _ptx(capability: int, scaled: bool, tile: gemm.Tile) -> str:
    constants = {"MASKED": False, "FP32_DOT": False, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n}
    constants |= {"BLOCK_E": 256, "GROUP_M": 8, "SCALED": scaled, "BLOCK_K": 128}
    signature = SIGNATURE | dict.fromkeys(constants, "constexpr")
    names = _grouped_gemm_fp4_kernel.arg_names
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, kind in signature.items() if kind[0] == "*"}
    source = ASTSource(_grouped_gemm_fp4_kernel, signature, constants, aligned)
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]


def test_each_path_compiles_to_its_gpus_tensor_core_products():
    """SM100: ``tl.dot_scaled`` becomes tcgen05 products; SM90: products of codes upcast in registers (byte
    permutes), wgmma with the 64-row tile and mma.sync with the two-warp decode tile; the hand path's decoded codes
    feed wgmma products."""
    sm100 = _ptx(100, True, gemm.FP4_TILE_SM100)
    assert re.search(r"tcgen05\.mma", sm100) and "wgmma" not in sm100
    for tile, product in ((gemm.FP4_TILE, "wgmma.mma_async"), (gemm.FP4_TILE_FEW, "mma.sync")):
        sm90 = _ptx(90, True, tile)
        assert product in sm90 and "tcgen05" not in sm90 and "prmt.b32" in sm90
    hand = _ptx(90, False, gemm.FP4_TILE)
    assert "wgmma.mma_async" in hand and "tcgen05" not in hand


SCALED_AGAINST_REFERENCE = """
import functools, itertools, json, torch
from deepinfer.conformance.cases import Gen
from deepinfer.conformance.gemm import fp4_weight
from deepinfer_cuda_sm100 import gemm

gen = Gen(11, "cpu")
out = []
hand = functools.partial(gemm.grouped_gemm_fp4, scaled=False)  # SM100 while tcgen05-fp4 is off
for (experts, n, k, rows), run in itertools.product(((3, 64, 256, [2, 0, 5]), (2, 130, 96, [4, 1])),
                                                    (gemm.grouped_fp4_native, hand)):
    w = fp4_weight(gen, experts, n, k)
    ref_w = w.dequantize(torch.float32)
    offsets = torch.tensor([0] + rows, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a = torch.randn(int(offsets[-1]), k).bfloat16()
    got = run(a, w, expert_offsets=offsets, masked_m=None, out_dtype=torch.float32)
    want = torch.cat([a[offsets[e] : offsets[e + 1]].float() @ ref_w[e].T for e in range(experts)])
    out.append(((got - want).abs().max() / want.abs().max()).item())
    masked = torch.randn(experts, max(rows), k).bfloat16()
    counts = torch.tensor(rows, dtype=torch.int32)
    got = run(masked, w, expert_offsets=None, masked_m=counts, out_dtype=torch.float32)
    err = 0.0
    for e, m in enumerate(rows):
        want = masked[e, :m].float() @ ref_w[e].T
        if m:
            err = max(err, ((got[e, :m] - want).abs().max() / want.abs().max()).item())
    out.append(err)
print(json.dumps(out))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the Triton interpreter ships with Linux wheels")
def test_scaled_path_matches_the_reference_through_the_interpreter():
    """The ``tl.dot_scaled`` path and the hand decode with bf16 activations, both layouts, rows of 0 to 5 per expert,
    a K that is not a multiple of the 128-deep step: relative errors of fp32 accumulation only (the weight is upcast
    exactly)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", SCALED_AGAINST_REFERENCE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == 8 and max(errors) < 1e-5, errors
