"""Whether cuBLAS's block-scaled FP8 product gives a row the same bits whatever batch it is in, and whether the
unsplit Triton FP8 kernel gives cuBLAS's bits (one CUDA GPU).

    python3 benchmarks/cublas_invariance.py [--rows 4096] [--trials 3]

If each output element is the K-ordered sum of scaled 128-deep partial products whatever the tile (no split over
K), a product is batch-invariant, and any two kernels that compute an element that way give the same bits. For
each DeepSeek-V3 projection (N, K), with ``--rows`` fresh random FP8 rows (1 x 128 scales) and FP8 weights
(128 x 128 scales):
1. slices: ``gemm_fp8_cublas`` (the function cuda_sm100 calls) on ``--trials`` slices of M rows at random offsets
   for each M, each compared bit for bit with the same rows of the whole product: the M values whose slices all
   matched and those where one did not;
2. Triton: the share of output elements (bf16 and fp32 results) where the Triton kernel without a split over K,
   for several launch shapes, equals cuBLAS on the whole product.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.qtensor import QTensor, quantize_blocks, quantize_rows

ROW_COUNTS = (4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048)
TILES = ((64, 128, 4, 3), (64, 64, 4, 3), (16, 64, 4, 4), (16, 32, 4, 4), (128, 128, 8, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=3, help="slices per row count, at random offsets")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublas_invariance.py needs a CUDA GPU (cuBLAS's block-scaled FP8 product)")
    from deepinfer_cuda_sm100.gemm import Tile, _launch_gemm, gemm_fp8_cublas

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    all_equal = True
    for n, k in V3_PROJECTIONS:
        a = quantize_rows(torch.randn(args.rows, k, device="cuda", generator=gen), 128, "fp32")
        w = quantize_blocks(torch.randn(n, k, device="cuda", generator=gen))
        whole = gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None)
        same, differ = [], []
        for m in (m for m in ROW_COUNTS if m < args.rows):
            ok = True
            for _ in range(args.trials):
                at = int(torch.randint(0, args.rows - m + 1, (1,), generator=gen, device="cuda"))
                part = QTensor(a.data[at : at + m], a.scale[at : at + m], a.block, a.scale_format)
                ok &= torch.equal(gemm_fp8_cublas(part, w, out_dtype=torch.bfloat16, bias=None), whole[at : at + m])
            (same if ok else differ).append(m)
        all_equal &= not differ
        print(f"N={n:>5} K={k:>5}: same bits at M = {same or '-'}; different at M = {differ or '-'}")
        line = []
        for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
            want = gemm_fp8_cublas(a, w, out_dtype=dtype, bias=None)
            for bm, bn, warps, stages in TILES:
                out = torch.empty(args.rows, n, dtype=dtype, device="cuda")
                _launch_gemm(a.data, w.data, out, a.scale, w.scale, None, True, Tile(bm, bn, warps, stages))
                line.append(f"{str(dtype)[6:]} {bm}x{bn}: {(out.view(bits) == want.view(bits)).float().mean():.6f}")
        print("  Triton unsplit, share of elements equal to cuBLAS: " + "; ".join(line), flush=True)
    print("every slice matched: batch-invariant here" if all_equal else "some slice differed: not batch-invariant")


if __name__ == "__main__":
    main()
