"""Whether cuBLAS's block-scaled FP8 product gives a row the same bits whatever batch it is in (one CUDA GPU).

    python3 benchmarks/cublas_invariance.py [--rows 4096] [--trials 3]

Batch-invariant mode runs FP8 ``gemm`` through the Triton kernel, which costs 1.20-1.74x cuBLAS at M = 4096
(RESULTS.md, seventh session); cuBLAS is left out because its heuristics pick tiles by M. A tile need not change a
row's arithmetic, though: if each output element is the K-ordered sum of scaled 128-deep partial products whatever
the tile (no split over K), cuBLAS would be batch-invariant and that mode could use it at every M. This checks it.
For each DeepSeek-V3 projection (N, K): the product of ``--rows`` fresh random FP8 rows (1 x 128 scales) with FP8
weights (128 x 128 scales) by ``gemm_fp8_cublas``, the function cuda_sm100 calls, then of ``--trials`` slices of
M rows at random offsets for each M, each compared bit for bit with the same rows of the whole product. Prints the
M values whose slices all matched and those where one did not.
"""

from __future__ import annotations

import argparse

import torch

from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.qtensor import QTensor, quantize_blocks, quantize_rows

ROW_COUNTS = (4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=3, help="slices per row count, at random offsets")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublas_invariance.py needs a CUDA GPU (cuBLAS's block-scaled FP8 product)")
    from deepinfer_cuda_sm100.gemm import gemm_fp8_cublas

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
    print("every slice matched: batch-invariant here" if all_equal else "some slice differed: not batch-invariant")


if __name__ == "__main__":
    main()
