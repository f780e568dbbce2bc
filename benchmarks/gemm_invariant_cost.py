"""What batch-invariant mode costs FP8 ``gemm`` on cuda_sm100, row count by row count (one CUDA GPU).

    python3 benchmarks/gemm_invariant_cost.py OUT.json

For each DeepSeek-V3 projection and M = 1 ... 4096: the graph time of ``ops.gemm`` in the default mode and in
batch-invariant mode (FP8 activations, rotated input sets), which implementation each ran, and whether the
batch-invariant rows of an M-row product equal, bit for bit, the same rows of the 4096-row product. Batch-invariant
mode twice: as configured, and with no split over K at all (``BLOCK_PARTS_MAX_SHARE = 0``, the ``unsplit``
columns). From 64 rows
also cuBLAS's block-scaled product called directly (``gemm_fp8_cublas``; batch-invariant mode takes it only from
``CUBLAS_FP8_MIN_M`` rows): its graph time and whether its rows equal the same rows of the 4096-row product.
"""

from __future__ import annotations

import argparse
import json

import torch

import deepinfer
from deepinfer import QTensor, ops
from deepinfer.bench import time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.dispatch import batch_invariant, last_resolution
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm
from deepinfer_cuda_sm100.gemm_cublas import gemm_fp8_cublas

ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 4096)
SETS = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    args = p.parse_args()
    share = gemm.BLOCK_PARTS_MAX_SHARE
    modes = (("default", False, share), ("invariant", True, share), ("unsplit", True, 0))
    deepinfer.use("cuda_sm100")
    report = []
    for n, k in V3_PROJECTIONS:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        whole = [
            quantize_rows(torch.randn(max(ROWS), k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)
        ]
        w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
        with batch_invariant():
            ref = ops.gemm(whole[0], w[0], out_dtype=torch.bfloat16)
        for m in ROWS:
            a = [QTensor(x.data[:m], x.scale[:m], x.block, x.scale_format) for x in whole]
            row = {"N": n, "K": k, "M": m}
            for mode, invariant, parts_share in modes:
                gemm.BLOCK_PARTS_MAX_SHARE = parts_share
                with batch_invariant(invariant):
                    out = ops.gemm(a[0], w[0], out_dtype=torch.bfloat16)
                    impl = last_resolution("gemm")[0].provider
                    row[f"{mode}_ms"] = time_graph_ms(
                        lambda i, a=a, w=w: ops.gemm(a[i], w[i], out_dtype=torch.bfloat16), sets=SETS
                    )
                row[f"{mode}_impl"] = impl
                if invariant:
                    row[f"{mode}_equal_4096"] = bool(torch.equal(out.view(torch.int16), ref[:m].view(torch.int16)))
            row["cost"] = row["invariant_ms"] / row["default_ms"]
            row["unsplit_cost"] = row["unsplit_ms"] / row["default_ms"]
            line = (
                f"N={n:>5} K={k:>5} M={m:>4}: default {row['default_ms']:.4f} ms ({row['default_impl']}), "
                f"invariant {row['invariant_ms']:.4f} ms ({row['invariant_impl']}): {row['cost']:.2f}x, "
                f"unsplit {row['unsplit_ms']:.4f} ms: {row['unsplit_cost']:.2f}x; rows equal at 4096: "
                f"{row['invariant_equal_4096']}, {row['unsplit_equal_4096']}"
            )
            if m >= 64:
                cublas = lambda i, a=a, w=w: gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)
                row["cublas_ms"] = time_graph_ms(cublas, sets=SETS)
                row["cublas_equal_4096"] = bool(torch.equal(cublas(0).view(torch.int16), ref[:m].view(torch.int16)))
                line += f"; cuBLAS {row['cublas_ms']:.4f} ms ({row['cublas_ms'] / row['default_ms']:.2f}x), "
                line += f"rows equal at 4096: {row['cublas_equal_4096']}"
            report.append(row)
            print(line, flush=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
