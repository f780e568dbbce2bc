"""FP8 block-scaled ``gemm`` at a few rows with the operands swapped (``_gemm_swapped_kernel``; one CUDA GPU).

At a few rows the 64-row kernel gives the tensor cores 64-row tiles of the activation, nearly all of it padding at
M = 1. Swapped, the weight's rows are the product's 64 or 128 rows and the activation's rows its 16-64 columns: a
quarter of the tensor-core work at M = 1 and a 2 KB activation copy per K block instead of 8 KB. Each 128-deep
product is still accumulated from zero and scaled with one FMA, so an unsplit launch must give the unsplit 64-row
kernel's bits (and with them cuBLAS's from 256 rows): that is checked for every launch.

    python3 benchmarks/gemm_swap_ab.py OUT.json [N,K ...]

For each DeepSeek-V3 projection (or each N,K given) and M = 1 ... 64: both modes' launches (``ops.gemm``), the
launches without the swap (64-row tiles unsplit, as batch-invariant mode had them; 16-row tiles, as the default mode
had them), then every swapped launch shape (weight rows per program, stages, K spans), each checked against the
dequantised product and, unsplit, bit for bit against the 64-row unsplit launch, then timed from CUDA graphs.
Unsplit swapped launches are batch-invariant candidates, split ones default-mode candidates.
"""

from __future__ import annotations

import itertools
import json
import sys
from functools import partial

import torch

import deepinfer
from deepinfer import QTensor, ops
from deepinfer.bench import time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.dispatch import batch_invariant, last_resolution
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100.gemm import SPLIT_K_MIN_K, Tile, _fills_gpu, _launch_gemm, _unsplit_tile

ROWS = (1, 4, 8, 16, 32, 64)
SETS = 4
WIDTHS = (64, 128)  # weight rows per program (the product's M side)
STAGES = (4, 6, 8, 12)
SPLITS = (1, 2, 4)
BF16 = {"dtype": torch.bfloat16, "device": "cuda"}


def _rows16_tile(m: int, n: int, k: int) -> Tile:
    """The default mode's launch at a few rows before the swap: 16-row tiles, K split in four where they leave SMs
    idle."""
    split = 4 if k >= SPLIT_K_MIN_K and not _fills_gpu(m, n, 16, 64) else 1
    return Tile(16, 64, 4, 4, split)


def _launch(a, w, tile, outs, i):
    return _launch_gemm(a[i].data, w[i].data, outs[i], a[i].scale, w[i].scale, None, False, tile)


def main() -> None:
    deepinfer.use("cuda_sm100")
    report = []
    shapes = [tuple(map(int, arg.split(","))) for arg in sys.argv[2:]] or V3_PROJECTIONS
    for n, k in shapes:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        whole = [
            quantize_rows(torch.randn(max(ROWS), k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)
        ]
        w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
        for m in ROWS:
            a = [QTensor(x.data[:m], x.scale[:m], x.block, x.scale_format) for x in whole]
            exact = (a[0].dequantize() @ w[0].dequantize().T).float()
            row = {"N": n, "K": k, "M": m}
            for mode, invariant in (("default", False), ("invariant", True)):
                with batch_invariant(invariant):
                    ops.gemm(a[0], w[0], out_dtype=torch.bfloat16)
                    row[f"{mode}_impl"] = last_resolution("gemm")[0].provider
                    row[f"{mode}_ms"] = time_graph_ms(
                        lambda i, a=a, w=w: ops.gemm(a[i], w[i], out_dtype=torch.bfloat16), sets=SETS
                    )
            # the launches without the swap: 64-row tiles unsplit (batch-invariant) and 16-row tiles (default mode)
            row["unsplit64_tile"], row["rows16_tile"] = _unsplit_tile(m, n, k), _rows16_tile(m, n, k)
            for name in ("unsplit64", "rows16"):
                launch = partial(_launch, a, w, row[f"{name}_tile"], [torch.empty(m, n, **BF16) for _ in range(SETS)])
                row[f"{name}_ms"] = time_graph_ms(launch, sets=SETS)
            unsplit = _launch(a, w, row["unsplit64_tile"], [torch.empty(m, n, **BF16)], 0)
            best = {}
            for block_w, stages, split in itertools.product(WIDTHS, STAGES, SPLITS):
                name = f"swap{block_w}_s{stages}_k{split}"
                tile = Tile(16 if m <= 16 else 32 if m <= 32 else 64, block_w, 4, stages, split, swap=True)
                run = partial(_launch, a, w, tile, [torch.empty(m, n, **BF16) for _ in range(SETS)])
                try:
                    got = run(0).float()
                except Exception as error:  # shared memory refused at this depth
                    row[name] = f"refused: {type(error).__name__}"
                    continue
                err = ((got - exact).norm() / exact.norm()).item()
                same = bool(torch.equal(run(0).view(torch.int16), unsplit.view(torch.int16)))
                ms = time_graph_ms(run, sets=SETS)
                row[name] = {"ms": ms, "rel_err": err, "same_bits_as_unsplit": same}
                kind = "unsplit" if split == 1 else "split"
                usable = ms is not None and err < 1e-2 and (kind == "split" or same)
                if usable and (kind not in best or ms < best[kind][1]):
                    best[kind] = (name, ms)
            row["best"] = best
            line = (
                f"N={n:>5} K={k:>5} M={m:>3}: default {row['default_ms']:.4f} ({row['default_impl']}), "
                f"invariant {row['invariant_ms']:.4f} ({row['invariant_impl']}); without the swap: "
                f"64-row unsplit {row['unsplit64_ms']:.4f}, 16-row {row['rows16_ms']:.4f}"
            )
            for kind, (name, ms) in best.items():
                ref = row["unsplit64_ms"] if kind == "unsplit" else row["rows16_ms"]
                line += f"; best {kind} {name} {ms:.4f} ({ms / ref:.2f}x)"
            unequal = [key for key, v in row.items() if isinstance(v, dict) and "_k1" in key
                       and not v["same_bits_as_unsplit"]]  # fmt: skip
            line += f"; unsplit launches with other bits: {unequal or 'none'}"
            print(line, flush=True)
            report.append(row)
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
