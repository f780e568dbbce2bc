"""Launch shapes of the cuda_sm100 FP8 ``gemm`` kernel on the device, each checked against the reference, then
timed from CUDA graphs (median device time over rotated weights, so small products stream from memory, not L2),
beside cuBLAS block-scaled ``scaled_mm`` in the same run.

    python3 benchmarks/gemm_tiles.py OUT.json [small|invariant|all]

small: M = 1, 8, 64 over BLOCK_N x stages x split-K (the default mode's tiles below ``CUBLAS_FP8_MIN_M``).
invariant: tiles that do not depend on M (batch-invariant mode) at M = 1, 64, 512, 4096.
Activations arrive quantised; the weights are the DeepSeek-V3 projections of the issue's table.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from deepinfer.bench import time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm

SETS = 4


def inputs(m: int, n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = [quantize_rows(torch.randn(m, k, device="cuda", generator=gen), 128, "fp32") for _ in range(SETS)]
    w = [quantize_blocks(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5) for _ in range(SETS)]
    return a, w


def launch(a, w, tile):
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16, device="cuda")
    return gemm._launch_gemm(a.data, w.data, out, a.scale, w.scale, None, False, tile)


def rel_err(got, want) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def sweep(m: int, n: int, k: int, tiles: list[gemm.Tile]) -> dict:
    a, w = inputs(m, n, k, seed=m * 7 + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    row = {"M": m, "N": n, "K": k, "tiles": []}
    try:
        cublas = lambda i: gemm.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)
        row["cublas_rel_err"] = rel_err(cublas(0), want)
        row["cublas_ms"] = time_graph_ms(cublas, sets=SETS, reps=50)
    except Exception as e:  # reported beside the tiles, not hidden
        row["cublas_ms"] = f"{type(e).__name__}: {e}"[:200]
    for tile in tiles:
        err = rel_err(launch(a[0], w[0], tile), want)
        ms = time_graph_ms(lambda i, t=tile: launch(a[i], w[i], t), sets=SETS, reps=50) if err < 1e-2 else None
        row["tiles"].append({"tile": list(tile), "ms": ms, "rel_err": err})
    row["default_tile"] = list(gemm._tile(m, n, k, True, False))
    best = min((t for t in row["tiles"] if t["ms"]), key=lambda t: t["ms"], default={"tile": None, "ms": None})
    print(f"M={m} N={n} K={k}: best {best['tile']} {best['ms']} ms, cuBLAS {row['cublas_ms']} ms", flush=True)
    return row


def small_tiles(m: int) -> list[gemm.Tile]:
    bm = 16 if m <= 16 else 64
    grid = itertools.product((32, 64, 128), (3, 4, 6), (1, 2, 4, 8))
    return [gemm.Tile(bm, bn, 4, stages, split) for bn, stages, split in grid]


INVARIANT_TILES = [gemm.Tile(*t) for t in [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 4, 3),
                                            (64, 256, 8, 3), (128, 64, 4, 4)]]  # fmt: skip


def save(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    out_path, which = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "all"
    report = {"device": torch.cuda.get_device_name(), "small": [], "invariant": []}
    if which in ("small", "all"):
        for (n, k), m in itertools.product(V3_PROJECTIONS, (1, 8, 64)):
            report["small"].append(sweep(m, n, k, small_tiles(m)))
            save(report, out_path)
    if which in ("invariant", "all"):
        for (n, k), m in itertools.product(V3_PROJECTIONS, (1, 64, 512, 4096)):
            report["invariant"].append(sweep(m, n, k, INVARIANT_TILES))
            save(report, out_path)


if __name__ == "__main__":
    main()
