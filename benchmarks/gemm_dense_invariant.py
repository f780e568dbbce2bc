"""Batch-invariant dense ``gemm`` on cuda_sm100 at the model's two dense products (one CUDA GPU): the MoE router's
fp32 logits (N = 256, K = 7168) and ``lm_head`` (bf16 operands, fp32 logits, N = 129280, K = 7168).

    python3 benchmarks/gemm_dense_invariant.py OUT.json

For each row count: the graph time of ``ops.gemm`` in the default mode (cuBLAS) and in batch-invariant mode (the
committed tile), then each tile variant launched directly. Every variant's rows are compared bit for bit with the
same rows of its own largest product (what batch invariance needs), and its worst error against an fp64 product is
reported. For ``lm_head`` it also reports whether cuBLAS's rows equal the committed batch-invariant rows.
"""

from __future__ import annotations

import json
import sys

import torch

import deepinfer
from deepinfer import ops
from deepinfer.bench import time_graph_ms
from deepinfer.dispatch import batch_invariant, last_resolution
from deepinfer_cuda_sm100.gemm import Tile, _launch_gemm, gemm_cublas

SETS = 4
# (name, N, K, operand dtype, row counts, variants: Tile(block_m, block_n, warps, stages, split_k, block_k))
PRODUCTS = [
    ("router", 256, 7168, torch.float32, (1, 8, 64, 256, 4096), [
        Tile(16, 64, 4, 3, 7, 64), Tile(16, 32, 4, 3, 7, 64), Tile(16, 128, 4, 3, 7, 64), Tile(16, 64, 4, 3, 14, 64),
        Tile(16, 64, 4, 3, 4, 64), Tile(16, 32, 4, 3, 14, 32), Tile(32, 64, 4, 3, 7, 64), Tile(16, 64, 2, 3, 7, 32),
        Tile(16, 64, 4, 4, 7, 32), Tile(16, 32, 2, 4, 14, 32), Tile(32, 32, 4, 3, 14, 32), Tile(64, 64, 4, 3, 7, 32),
        *[Tile(bm, bn, 4, st, split, 32, True) for bm, bn, st, split in [
            (64, 64, 3, 7), (64, 32, 3, 7), (64, 128, 3, 7), (64, 64, 4, 14), (64, 64, 3, 1), (64, 64, 4, 4),
            (128, 64, 3, 7), (16, 64, 3, 7), (64, 32, 4, 14)]],
    ]),
    ("lm_head", 129280, 7168, torch.bfloat16, (1, 8, 64, 256), [
        Tile(64, 128, 4, 4), Tile(64, 128, 4, 6), Tile(64, 128, 8, 4), Tile(64, 64, 4, 6), Tile(64, 256, 8, 3),
        Tile(64, 256, 8, 4), Tile(64, 128, 4, 3, 1, 128), Tile(64, 128, 4, 4, 1, 128), Tile(64, 128, 8, 4, 1, 128),
        Tile(64, 256, 8, 2, 1, 128), Tile(128, 128, 8, 3), Tile(64, 64, 4, 4, 1, 128),
    ]),
]  # fmt: skip


def measure(name: str, n: int, k: int, dtype: torch.dtype, rows: tuple[int, ...], variants: list[Tile]) -> list:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    whole = [torch.randn(max(rows), k, device="cuda", generator=gen).to(dtype) for _ in range(SETS)]
    w = [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype) for _ in range(SETS)]
    exact = whole[0].double() @ w[0].double().T

    def launch(a: torch.Tensor, b: torch.Tensor, tile: Tile) -> torch.Tensor:
        out = torch.empty(a.shape[0], n, dtype=torch.float32, device="cuda")
        return _launch_gemm(a, b, out, None, None, None, True, tile)

    largest = {tile: launch(whole[0], w[0], tile) for tile in variants}
    with batch_invariant():
        committed = ops.gemm(whole[0], w[0], out_dtype=torch.float32)
    firsts: dict[tuple, Tile] = {}
    same_bits = {}
    for tile in variants:  # the same split and step, another tile: the same bits?
        first = firsts.setdefault((tile.split_k, tile.block_k, tile.tf32x3), tile)
        same_bits[tile] = {"as": tuple(first), "equal": torch.equal(largest[tile], largest[first])}
        same_bits[tile]["equal_committed"] = torch.equal(largest[tile], committed)
        print(f"  {tuple(tile)} at M={max(rows)}: {same_bits[tile]}", flush=True)
    report = []
    for m in rows:
        a = [x[:m] for x in whole]
        row = {"product": name, "N": n, "K": k, "M": m}
        for mode, invariant in (("default", False), ("invariant", True)):
            with batch_invariant(invariant):
                out = ops.gemm(a[0], w[0], out_dtype=torch.float32)
                row[f"{mode}_impl"] = last_resolution("gemm")[0].provider
                row[f"{mode}_ms"] = time_graph_ms(
                    lambda i, a=a: ops.gemm(a[i], w[i], out_dtype=torch.float32), sets=SETS
                )
            if invariant:
                row["invariant_rows_equal_largest"] = torch.equal(out, committed[:m])
        row["cost"] = row["invariant_ms"] / row["default_ms"]
        line = (
            f"{name} M={m:>4}: default {row['default_ms']:.4f} ms ({row['default_impl']}), invariant "
            f"{row['invariant_ms']:.4f} ms ({row['invariant_impl']}): {row['cost']:.2f}x, rows equal "
            f"{row['invariant_rows_equal_largest']}"
        )
        if dtype != torch.float32:
            cublas = gemm_cublas(a[0], w[0], out_dtype=torch.float32, bias=None)
            row["cublas_equals_invariant"] = torch.equal(cublas, committed[:m])
            line += f", cuBLAS equal {row['cublas_equals_invariant']}"
        print(line, flush=True)
        row["variants"] = []
        for tile in variants:
            out = launch(a[0], w[0], tile)
            v = {
                "tile": tile._asdict(),
                "largest_same_bits": same_bits[tile],
                "ms": time_graph_ms(lambda i, a=a, tile=tile: launch(a[i], w[i], tile), sets=SETS),
                "rows_equal_largest": torch.equal(out, largest[tile][:m]),
                "max_rel_error": float((out.double() - exact[:m]).abs().max() / exact[:m].abs().max()),
            }
            row["variants"].append(v)
            print(
                f"    {tuple(tile)}: {v['ms']:.4f} ms ({v['ms'] / row['default_ms']:.2f}x default), rows equal "
                f"{v['rows_equal_largest']}, error {v['max_rel_error']:.1e}",
                flush=True,
            )
        report.append(row)
    return report


def main() -> None:
    deepinfer.use("cuda_sm100")
    report = []
    for product in PRODUCTS:
        report += measure(*product)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
