"""Whether the Triton FP8 ``gemm`` kernel, unsplit, gives cuBLAS's block-scaled product bit for bit (one CUDA GPU).

    python3 benchmarks/cublas_bits.py [--rows 4096]

``cublas_invariance.py`` found cuBLAS's block-scaled FP8 product batch-invariant from 64 rows on the DeepSeek-V3
projections (RESULTS.md, twelfth session). If the Triton kernel without a split over K computes each element the
same way (128-deep tensor-core products from zero, each scaled and added in K order), then batch-invariant mode can
take cuBLAS where it is faster and the Triton kernel elsewhere, with the same bits at every row count. For each
projection this prints, per Triton launch shape and output dtype, the share of output elements equal to cuBLAS's.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.qtensor import quantize_blocks, quantize_rows

TILES = ((64, 128, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4), (16, 32, 4, 4), (128, 128, 8, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublas_bits.py needs a CUDA GPU (cuBLAS's block-scaled FP8 product)")
    from deepinfer_cuda_sm100.gemm import Tile, _launch_gemm, gemm_fp8_cublas

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for n, k in V3_PROJECTIONS:
        a = quantize_rows(torch.randn(args.rows, k, device="cuda", generator=gen), 128, "fp32")
        w = quantize_blocks(torch.randn(n, k, device="cuda", generator=gen))
        line = []
        for dtype in (torch.bfloat16, torch.float32):
            try:
                want = gemm_fp8_cublas(a, w, out_dtype=dtype, bias=None)
            except (RuntimeError, ValueError) as e:
                line.append(f"cuBLAS {dtype}: {str(e).splitlines()[0][:80]}")
                continue
            for bm, bn, warps, stages in TILES:
                out = torch.empty(args.rows, n, dtype=dtype, device="cuda")
                _launch_gemm(a.data, w.data, out, a.scale, w.scale, None, True, Tile(bm, bn, warps, stages, 1))
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                same = (out.view(bits) == want.view(bits)).float().mean().item()
                rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
                line.append(f"{str(dtype)[6:]} {bm}x{bn}: {same:.6f} equal (rel {rel:.1e})")
        print(f"N={n:>5} K={k:>5}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
