"""Launch shapes of the cuda_sm100 FP8 ``gemm`` kernel on the device, each checked against the reference, then
timed from CUDA graphs (median device time over rotated weights, so small products stream from memory, not L2),
beside cuBLAS block-scaled ``scaled_mm`` in the same run.

    python3 benchmarks/gemm_tiles.py OUT.json [small|invariant|large|all|unsplit]

small: M = 1, 8, 64 over BLOCK_N x stages x split-K (the default mode's tiles below ``CUBLAS_FP8_MIN_M``).
invariant: tiles that do not depend on M (batch-invariant mode) at M = 1, 64, 512, 4096.
unsplit: 64-row tiles without a split over K at M = 1 ... 256, each also compared bit for bit with the 64 x 128
launch (and with cuBLAS from 64 rows, which computes each element the same way: NOTES.md, gemm, 2026-12-01).
large: tiles where rows are many: M=4096 for two projections, and ``grouped_gemm`` contiguous with 32 experts x
512 rows (gate/up and down).
Activations arrive quantised; the weights are the DeepSeek-V3 projections of the issue's table.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from deepinfer import QTensor
from deepinfer.bench import time_graph_ms
from deepinfer.conformance.gemm import V3_PROJECTIONS
from deepinfer.qtensor import quantize_blocks, quantize_rows
from deepinfer_cuda_sm100 import gemm, gemm_cublas

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


def fp8_ceiling(size: int = 8192):
    """The product the FP8 ceiling is measured on: ``(fn(i), flops)`` of a tensor-wise scaled ``scaled_mm`` of
    ``size``^3."""
    x = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return lambda i: torch._scaled_mm(x, x.t(), one, one, out_dtype=torch.bfloat16), 2 * size**3


def fp8_peak_tflops(size: int = 8192) -> float:
    """The FP8 matmul rate measured here, the ceiling of the GEMM scripts' percentages: ``fp8_ceiling`` replayed from
    a CUDA graph."""
    fn, flops = fp8_ceiling(size)
    return flops / time_graph_ms(fn, sets=1, reps=20) / 1e9


def sweep(m: int, n: int, k: int, tiles: list[gemm.Tile]) -> dict:
    a, w = inputs(m, n, k, seed=m * 7 + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    row = {"M": m, "N": n, "K": k, "tiles": []}
    try:
        cublas = lambda i: gemm_cublas.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None)
        row["cublas_rel_err"] = rel_err(cublas(0), want)
        row["cublas_ms"] = time_graph_ms(cublas, sets=SETS, reps=50)
    except Exception as e:  # reported beside the tiles, not hidden
        row["cublas_ms"] = f"{type(e).__name__}: {e}"[:200]
    for tile in tiles:
        try:
            err = rel_err(launch(a[0], w[0], tile), want)
        except Exception as e:  # e.g. more shared memory than an SM has: reported, not hidden
            row["tiles"].append({"tile": list(tile), "ms": None, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
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
                                            (64, 64, 4, 4), (128, 64, 4, 4)]]  # fmt: skip


UNSPLIT_TILES = [gemm.Tile(64, bn, 4, stages) for bn in (16, 32, 64, 128) for stages in (3, 4, 6, 8)]


def unsplit_sweep(m: int, n: int, k: int) -> dict:
    row = sweep(m, n, k, UNSPLIT_TILES)
    a, w = inputs(m, n, k, seed=m * 7 + n + k)
    canon = launch(a[0], w[0], gemm.Tile(64, 128, 4, 3)).view(torch.int16)
    ran = [t for t, r in zip(UNSPLIT_TILES, row["tiles"]) if "error" not in r]
    row["bits_equal_64x128"] = [torch.equal(launch(a[0], w[0], t).view(torch.int16), canon) for t in ran]
    if m >= 64:
        cublas = gemm_cublas.gemm_fp8_cublas(a[0], w[0], out_dtype=torch.bfloat16, bias=None)
        row["bits_equal_cublas"] = torch.equal(cublas.view(torch.int16), canon)
    default = gemm._tile(m, n, k, True, False)
    row["default_ms"] = time_graph_ms(lambda i: launch(a[i], w[i], default), sets=SETS, reps=50)
    print(f"  default {list(default)} {row['default_ms']:.4f} ms; bits equal {row['bits_equal_64x128']}, "
          f"cuBLAS {row.get('bits_equal_cublas')}", flush=True)  # fmt: skip
    return row


def save(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def grouped_inputs(tokens: int, n: int, k: int, seed: int, experts: int = 256, top_k: int = 8, sets: int = 2):
    """The decode shape of the model's MoE layer: ``tokens`` tokens routed top-k over 256 experts, masked layout
    with capacity ``tokens`` (one process). FP8 weights are drawn directly as e4m3 values with random block scales."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(sets):
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.flatten()
        rows = torch.bincount(ids, minlength=experts).clamp(max=tokens).int()
        a = quantize_rows(torch.randn(experts, tokens, k, device="cuda", generator=gen), 128, "fp32")
        data = torch.randn(experts, n, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, n // 128, k // 128, device="cuda", generator=gen) * k**-0.5 + 1e-3
        w = QTensor(data, scale, (128, 128), "fp32")
        out.append({"a": a, "w": w, "expert_offsets": None, "masked_m": rows, "out_dtype": torch.bfloat16})
    return out


LARGE_TILES = [gemm.Tile(*t) for t in [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (64, 64, 4, 4),
                                        (128, 128, 8, 3), (128, 128, 8, 4)]]  # fmt: skip


def contiguous_sweep(experts: int, rows: int, n: int, k: int) -> dict:
    """``grouped_gemm``, contiguous layout, ``rows`` per expert, over LARGE_TILES (``GROUPED_TILE`` swapped)."""
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    offsets = torch.arange(experts + 1, device="cuda", dtype=torch.int32) * rows
    sets = []
    for _ in range(2):
        a = quantize_rows(torch.randn(experts * rows, k, device="cuda", generator=gen), 128, "fp32")
        data = torch.randn(experts, n, k, device="cuda", generator=gen, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        scale = torch.rand(experts, n // 128, k // 128, device="cuda", generator=gen) * k**-0.5 + 1e-3
        w = QTensor(data, scale, (128, 128), "fp32")
        sets.append({"a": a, "w": w, "expert_offsets": offsets, "masked_m": None, "out_dtype": torch.bfloat16})
    a, w = sets[0]["a"], sets[0]["w"]
    want = torch.cat([a.dequantize()[e * rows : (e + 1) * rows] @ QTensor(w.data[e], w.scale[e], (128, 128), "fp32")
                      .dequantize().t() for e in range(experts)])  # fmt: skip
    row, default = {"experts": experts, "rows": rows, "N": n, "K": k, "tiles": []}, (gemm.GROUPED_TILE, gemm.DEEP_K)
    gemm.DEEP_K = 1 << 62  # each swept tile runs as given, whatever K
    for tile in LARGE_TILES:
        gemm.GROUPED_TILE = tile
        err = rel_err(gemm.grouped_gemm(**sets[0], kernel="triton"), want)  # the swept tiles are the Triton kernel's
        run = lambda i: gemm.grouped_gemm(**sets[i], kernel="triton")
        ms = time_graph_ms(run, sets=len(sets), reps=30) if err < 1e-2 else None
        row["tiles"].append({"tile": list(tile), "ms": ms, "rel_err": err})
        label = f"grouped contiguous E={experts} rows={rows} N={n} K={k} {list(tile)}"
        print(f"{label}: {ms} ms, rel err {err:.1e}", flush=True)
    gemm.GROUPED_TILE, gemm.DEEP_K = default
    return row


def main() -> None:
    out_path, which = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "all"
    report = {"device": torch.cuda.get_device_name(), "small": [], "invariant": []}
    if which in ("small", "all"):
        for (n, k), m in itertools.product(V3_PROJECTIONS, (1, 8, 64)):
            report["small"].append(sweep(m, n, k, small_tiles(m)))
            save(report, out_path)
    if which in ("large", "all"):
        report["large"] = [sweep(4096, n, k, LARGE_TILES) for n, k in ((24576, 1536), (7168, 16384))]
        save(report, out_path)
        for n, k in ((4096, 7168), (7168, 2048)):
            report["large"].append(contiguous_sweep(32, 512, n, k))
            save(report, out_path)
    if which == "unsplit":
        report["unsplit"] = []
        for (n, k), m in itertools.product(V3_PROJECTIONS, (1, 8, 64, 128, 256)):
            report["unsplit"].append(unsplit_sweep(m, n, k))
            save(report, out_path)
    if which in ("invariant", "all"):
        for (n, k), m in itertools.product(V3_PROJECTIONS, (1, 64, 512, 4096)):
            report["invariant"].append(sweep(m, n, k, INVARIANT_TILES))
            save(report, out_path)


if __name__ == "__main__":
    main()
