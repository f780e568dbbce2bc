"""The warp-specialized few-row Gluon FP8 GEMM (``gemm_gluon.fp8_gemm_few_rows``) beside the Triton launches at a
few rows (one CUDA GPU).

    python3 benchmarks/gluon_gemm_few.py OUT.json

For every DeepSeek-V3 projection and M = 1 ... 192: graph times (four input sets in turn, more bytes than L2 holds)
of ``ops.gemm`` in the default and in batch-invariant mode (with the Gluon kernel where ``gemm`` takes it), of the
unsplit Triton launch (swapped up to 16 rows), of the default mode's Triton launch (split over K where its rule
says), and of the Gluon kernel with 16, 32 and 64 rows of A per program over 1, 2 or 4 K groups (where the grid fits
the SMs); whether each Gluon result equals the unsplit launch's bit for bit.
"""

from __future__ import annotations

import json
import sys

import torch

import deepinfer
from deepinfer import QTensor, ops
from deepinfer.bench import time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.dispatch import batch_invariant
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm, gemm_gluon

ROWS = (1, 4, 8, 16, 32, 64, 128, 192)
SETS = 4


def variants(m: int, n: int, k: int, sms: int) -> dict[str, tuple[int, int]]:
    """Name -> (rows of A per program, K groups): 16 rows up to 16, else 32 and 64 rows not above 2 M; 1, 2 or 4
    K groups where they divide the K blocks and the grid fits ``sms``."""
    rows = [16] if m <= 16 else [r for r in (32, 64) if r <= 2 * m]
    k_blocks = k // 128
    return {
        f"A{r} g{g}": (r, g)
        for r in rows
        for g in (1, 2, 4)
        if k_blocks % g == 0 and (g == 1 or -(-n // 64) * -(-m // r) * g <= sms)
    }


def main() -> None:
    deepinfer.use("cuda_sm100")
    report = []
    for n, k in V3_PROJECTIONS:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        most = ROWS[-1]
        whole = [quantize_rows(torch.randn(most, k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)]
        w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
        for m in ROWS:
            a = [QTensor(x.data[:m].contiguous(), x.scale[:m].contiguous(), x.block, x.scale_format) for x in whole]

            def unsplit(i, a=a, w=w, m=m, n=n):
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                tile = gemm.SWAPPED_TILE if m <= gemm.SWAP_MAX_M else None  # None: the batch-invariant tile
                return gemm._launch_gemm(a[i].data, w[i].data, out, a[i].scale, w[i].scale, None, True, tile)

            def op(invariant, a=a, w=w):
                def call(i):
                    with batch_invariant(invariant):
                        return ops.gemm(a[i], w[i], out_dtype=torch.bfloat16)

                return call

            want = unsplit(0).view(torch.int16)
            row = {"N": n, "K": k, "M": m}

            def triton_default(i, a=a, w=w):
                return gemm.gemm_fp8(a[i], w[i], out_dtype=torch.bfloat16, bias=None)

            timed = (("default", op(False)), ("invariant", op(True)), ("unsplit", unsplit), ("triton", triton_default))
            for name, f in timed:
                row[name] = time_graph_ms(f, sets=SETS)
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            for name, (rows, groups) in variants(m, n, k, sms).items():
                f = lambda i, a=a, w=w, r=rows, g=groups: gemm_gluon.launch_few_rows(a[i], w[i], None, r, g)
                row[name] = {
                    "ms": time_graph_ms(f, sets=SETS),
                    "equal": bool(torch.equal(f(0).view(torch.int16), want)),
                }
            report.append(row)
            gluon = [key for key, v in row.items() if isinstance(v, dict)]
            print(
                f"N={n:>5} K={k:>5} M={m:>3}: default {row['default']:.4f} invariant {row['invariant']:.4f} "
                f"unsplit {row['unsplit']:.4f} triton {row['triton']:.4f}; gluon "
                + "; ".join(
                    f"{key} {row[key]['ms']:.4f}{'' if row[key]['equal'] else ' DIFFERENT BITS'}" for key in gluon
                ),
                flush=True,
            )
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
