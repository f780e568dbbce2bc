"""One op's launches on cuda_sm100, for a profiler to read (one CUDA GPU).

    ncu --clock-control none -k regex:KERNEL --launch-skip 3 --launch-count 1 --section SourceCounters \
        -o REPORT python3 benchmarks/profile_launch.py CASE
    ncu --import REPORT.ncu-rep --page source --csv --print-source sass > REPORT.csv

CASE is one of
- ``mla`` / ``mla-fp8``: ``mla_decode``, bf16 / fp8_ds_mla cache, H=128, B=64, context 4096 (kernel ``mla_split``);
- ``mla-invariant-b1``: batch-invariant ``mla_decode``, bf16 cache, H=128, B=1, context 4096, whose scores come first
  (kernels ``_mla_scores_kernel`` and ``_mla_span_kernel``);
- ``gemm-invariant``: batch-invariant FP8 ``gemm``, M=1, (N, K) = (2112, 7168) (kernels ``_gemm_swapped_kernel``,
  ``_chain_blocks_kernel``);
- ``gemm-invariant-wo``: the same at (N, K) = (7168, 16384), unsplit (kernel ``_gemm_swapped_kernel``);
- ``gemm-4096``: FP8 ``gemm`` at M=4096, (N, K) = (4096, 7168), which cuBLAS serves;
- ``gemm-ws``: the same product by ``gemm_gluon``'s kernel, A streamed (kernel ``fp8_gemm_ws``);
- ``gemm-wkv``: FP8 ``gemm`` at M=4096, (N, K) = (32768, 512), which ``gemm_gluon`` serves with resident A;
- ``gemm-wkv-cublas``: the same product by cuBLAS.
Each launches six times on fresh random inputs after one warm-up (compilation) launch; ``benchmarks/stall_ledger.py``
sums the per-instruction stall samples of the CSV.
"""

from __future__ import annotations

import sys

import torch
from tile_variants import make

import deepinfer
from deepinfer import ops
from deepinfer.dispatch import batch_invariant
from deepinfer.qtensor import quantize_blocks, quantize_rows


def mla_inputs(seed: int, fmt: str = "bf16") -> dict:
    return make(64, 4096, fmt, seed)


def gemm_inputs(seed: int, m: int = 1, n: int = 2112, k: int = 7168) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = quantize_rows(torch.randn(m, k, device="cuda", generator=gen), 128, "fp32")
    w = quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5)
    return {"a": a, "w": w, "out_dtype": torch.bfloat16}


def gemm_ws(a, w, out_dtype):
    from deepinfer_cuda_sm100.gemm_gluon import STREAMED, launch

    return launch(a, w, STREAMED)


def gemm_cublas(a, w, out_dtype):
    from deepinfer_cuda_sm100.gemm_cublas import gemm_fp8_cublas

    return gemm_fp8_cublas(a, w, out_dtype=out_dtype, bias=None)


CASES = {
    "mla": (ops.mla_decode, mla_inputs, False),
    "mla-fp8": (ops.mla_decode, lambda seed: mla_inputs(seed, "fp8_ds_mla"), False),
    "mla-invariant-b1": (ops.mla_decode, lambda seed: make(1, 4096, "bf16", seed), True),
    "gemm-invariant": (ops.gemm, gemm_inputs, True),
    "gemm-invariant-wo": (ops.gemm, lambda seed: gemm_inputs(seed, 1, 7168, 16384), True),
    "gemm-4096": (ops.gemm, lambda seed: gemm_inputs(seed, 4096, 4096), False),
    "gemm-ws": (gemm_ws, lambda seed: gemm_inputs(seed, 4096, 4096), False),
    "gemm-wkv": (ops.gemm, lambda seed: gemm_inputs(seed, 4096, 32768, 512), False),
    "gemm-wkv-cublas": (gemm_cublas, lambda seed: gemm_inputs(seed, 4096, 32768, 512), False),
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        raise SystemExit(f"usage: profile_launch.py {{{'|'.join(CASES)}}}")
    op, inputs, invariant = CASES[sys.argv[1]]
    deepinfer.use("cuda_sm100")
    with batch_invariant(invariant):
        for seed in range(7):
            op(**inputs(seed))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
