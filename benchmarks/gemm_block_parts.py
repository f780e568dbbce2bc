"""Batch-invariant FP8 ``gemm`` at a few rows: the K blocks' products computed in parallel and chained in K order by
a second kernel (``Tile.block_parts``), beside the unsplit kernel and the default mode's split (one CUDA GPU).

    python3 benchmarks/gemm_block_parts.py OUT.json

For the three projections with K >= 4096 and M = 1 ... 32: graph times (rotated input sets) of the default mode's
launch, the unsplit launch batch-invariant mode used before, and block-parts launches over K splits and launch
shapes of the chaining kernel (elements, warps per program); whether each block-parts result equals the unsplit
one bit for bit.
"""

from __future__ import annotations

import argparse
import json

import torch

from deepinfer.bench import time_graph_ms
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm

SHAPES = ((2112, 7168), (4096, 7168), (7168, 16384))
ROWS = (1, 2, 4, 8, 16, 32)
CHAINS = ((64, 2), (32, 1))
WIDE_PARTS = gemm.Tile(64, 64, 4, 4, swap=True)  # the swapped kernel's parts above SWAP_MAX_M rows
SETS = 4


def run(a: tuple[torch.Tensor, torch.Tensor], w, tile: gemm.Tile | None, invariant: bool) -> torch.Tensor:
    out = torch.empty(a[0].shape[0], w.shape[0], dtype=torch.bfloat16, device="cuda")
    return gemm._launch_gemm(a[0], w.data, out, a[1], w.scale, None, invariant, tile)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    args = p.parse_args()
    report = []
    for n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        # SETS weights in turn: more bytes than L2 holds, as in a model's forward pass
        a_all = [
            quantize_rows(torch.randn(max(ROWS), k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)
        ]
        w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
        for m in ROWS:
            a = [(x.data[:m].contiguous(), x.scale[:m].contiguous()) for x in a_all]

            launch = lambda i, tile, invariant=True, a=a, w=w: run(a[i], w[i], tile, invariant)
            timed = lambda tile, invariant=True, f=launch: time_graph_ms(lambda i: f(i, tile, invariant), sets=SETS)

            unsplit = gemm.SWAPPED_TILE if m <= gemm.SWAP_MAX_M else gemm._unsplit_tile(m, n, k)
            parts = gemm.SWAPPED_TILE._replace(num_stages=4) if m <= gemm.SWAP_MAX_M else WIDE_PARTS
            parts = parts._replace(block_parts=True)
            want = launch(0, unsplit).view(torch.int16)
            row = {"N": n, "K": k, "M": m, "default_ms": timed(None, False), "unsplit_ms": timed(unsplit)}
            variants = [(split, chain) for split in (4, 8) for chain in CHAINS]
            for split, chain in variants:
                gemm.CHAIN_LAUNCH = chain
                tile = parts._replace(split_k=split)
                key = f"parts split {split} chain {chain[0]}x{chain[1]}"
                row[key] = {"ms": timed(tile), "equal": bool(torch.equal(launch(0, tile).view(torch.int16), want))}
            report.append(row)
            best = min((v["ms"], key) for key, v in row.items() if key.startswith("parts"))
            print(
                f"N={n:>5} K={k:>5} M={m:>3}: default {row['default_ms']:.4f} unsplit {row['unsplit_ms']:.4f} "
                f"({row['unsplit_ms'] / row['default_ms']:.2f}x) best {best[1]} {best[0]:.4f} "
                f"({best[0] / row['default_ms']:.2f}x); all equal: "
                f"{all(v['equal'] for key, v in row.items() if key.startswith('parts'))}; "
                + " ".join(f"{key[6:]}={v['ms']:.4f}" for key, v in row.items() if key.startswith("parts")),
                flush=True,
            )
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
