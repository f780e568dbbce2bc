"""K-loop variants of the FP8 block-scaled GEMM on the device, each checked against the dequantised product, then
timed from CUDA graphs beside cuBLAS block-scaled ``scaled_mm`` and the committed kernel in the same run.

    python3 benchmarks/gemm_kloop.py OUT.json [persistent]

Variants (see NOTES.md): how the two block scales meet the fp32 partial product (an outer product of both per
element, or the weight scale folded into the row scales so one FMA per element remains), loads through pointers or
TMA descriptors, one or two 128-deep products in flight per loop trip, Triton's warp specialisation; then (this
sweep) a register cap (``maxnreg``) so that three or four programs share an SM, the tile's columns as two
independent products per K block, and activation scales read from a K-block-major copy. ``persistent``: only the
twelfth session's persistent kernel (one or two programs per SM walking the tiles, TMA stores), beside cuBLAS and
the committed launch.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from gemm_tiles import SETS, fp8_peak_tflops, inputs, rel_err
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.bench import time_graph_ms
from deepinfer_cuda_sm100 import gemm


@triton.jit
def _scaled(part, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, kb, KB, M, N, FOLD: tl.constexpr, BLOCK_N: tl.constexpr):
    sa = tl.load(as_ptr + offs_m * KB + kb, mask=offs_m < M, other=0.0)
    if FOLD:  # the tile sits inside one 128-column weight block: one scale per (tile, K block)
        sb = tl.load(bs_ptr + (pid_n * BLOCK_N // 128) * KB + kb)
        return acc + part * (sa * sb)[:, None]
    sb = tl.load(bs_ptr + (offs_n // 128) * KB + kb, mask=offs_n < N, other=0.0)
    return acc + part * sa[:, None] * sb[None, :]


@triton.jit
def _ptr_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, FOLD: tl.constexpr, UNROLL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = gemm.tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, 128)
    a_rows = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    b_rows = b_ptr + offs_n[:, None] * K + offs_k[None, :]
    mask_a, mask_b = (offs_m < M)[:, None], (offs_n < N)[:, None]
    KB = K // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 128 * UNROLL):
        a = tl.load(a_rows + k0, mask=mask_a, other=0.0)
        b = tl.load(b_rows + k0, mask=mask_b, other=0.0)
        part = tl.dot(a, tl.trans(b))
        if UNROLL == 2:
            a2 = tl.load(a_rows + k0 + 128, mask=mask_a, other=0.0)
            b2 = tl.load(b_rows + k0 + 128, mask=mask_b, other=0.0)
            part2 = tl.dot(a2, tl.trans(b2))
            acc = _scaled(part, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128, KB, M, N, FOLD, BLOCK_N)
            acc = _scaled(part2, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128 + 1, KB, M, N, FOLD, BLOCK_N)
        else:
            acc = _scaled(part, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128, KB, M, N, FOLD, BLOCK_N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=mask_a & (offs_n < N)[None, :])


@triton.jit
def _tma_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, M, N, K, FOLD: tl.constexpr, UNROLL: tl.constexpr,
                WS: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = gemm.tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    KB = K // 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, 128 * UNROLL, num_stages=STAGES, warp_specialize=WS):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        b = b_desc.load([pid_n * BLOCK_N, k0])
        part = tl.dot(a, b.T)
        if UNROLL == 2:
            a2 = a_desc.load([pid_m * BLOCK_M, k0 + 128])
            b2 = b_desc.load([pid_n * BLOCK_N, k0 + 128])
            part2 = tl.dot(a2, b2.T)
            acc = _scaled(part, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128, KB, M, N, FOLD, BLOCK_N)
            acc = _scaled(part2, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128 + 1, KB, M, N, FOLD, BLOCK_N)
        else:
            acc = _scaled(part, acc, as_ptr, bs_ptr, offs_m, pid_n, offs_n, k0 // 128, KB, M, N, FOLD, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _halves_kernel(a_desc, b_desc, c_ptr, as_ptr, bs_ptr, M, N, K, SCALES_T: tl.constexpr,
                   HALVES: tl.constexpr, STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   GROUP_M: tl.constexpr):  # fmt: skip
    """TMA + one FMA, with the tile's columns as HALVES independent products per K block (so the wait for one can
    overlap the other's MMA), and the activation scales read from a K-block-major copy (SCALES_T: coalesced)."""
    pid_m, pid_n = gemm.tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    HALF: tl.constexpr = BLOCK_N // HALVES
    KB = K // 128
    acc0 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for k0 in tl.range(0, K, 128, num_stages=STAGES):
        kb = k0 // 128
        a = a_desc.load([pid_m * BLOCK_M, k0])
        if SCALES_T:
            sa = tl.load(as_ptr + kb * M + offs_m, mask=offs_m < M, other=0.0)
        else:
            sa = tl.load(as_ptr + offs_m * KB + kb, mask=offs_m < M, other=0.0)
        b0 = b_desc.load([pid_n * BLOCK_N, k0])
        part0 = tl.dot(a, b0.T)
        if HALVES == 2:
            b1 = b_desc.load([pid_n * BLOCK_N + HALF, k0])
            part1 = tl.dot(a, b1.T)
            acc1 += part1 * (sa * tl.load(bs_ptr + ((pid_n * BLOCK_N + HALF) // 128) * KB + kb))[:, None]
        acc0 += part0 * (sa * tl.load(bs_ptr + (pid_n * BLOCK_N // 128) * KB + kb))[:, None]
    mask_m = (offs_m < M)[:, None]
    for h in tl.static_range(HALVES):
        offs_n = (pid_n * BLOCK_N + h * HALF + tl.arange(0, HALF)).to(tl.int64)
        ptrs, mask = c_ptr + offs_m[:, None] * N + offs_n[None, :], mask_m & (offs_n < N)[None, :]
        if h == 0:
            tl.store(ptrs, acc0.to(tl.bfloat16), mask=mask)
        else:
            tl.store(ptrs, acc1.to(tl.bfloat16), mask=mask)


@triton.jit
def _persistent_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K, GRID: tl.constexpr, STAGES: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """Program p walks tiles p, p + GRID, ...; the (tile, K block) loop is flattened, so the next tile's copies are
    in flight while this tile's result is stored (TMA). Each element is the unsplit kernel's expression (the bits were
    not compared)."""
    kbs = K // 128
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, GRID, flatten=True, num_stages=STAGES):
        pid_m, pid_n = gemm.tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        sb_row = bs_ptr + (pid_n * BLOCK_N // 128) * kbs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kbs):
            a = a_desc.load([pid_m * BLOCK_M, kb * 128])
            b = b_desc.load([pid_n * BLOCK_N, kb * 128])
            part = tl.dot(a, b.T)
            sa = tl.load(as_ptr + offs_m * kbs + kb, mask=offs_m < M, other=0.0)
            acc = acc + part * (sa * tl.load(sb_row + kb))[:, None]
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


def launch(v: dict, a, w, scales_t=None):
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.data.device)
    bm, bn = v["BLOCK_M"], v["BLOCK_N"]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    extra = {"maxnreg": v["maxnreg"]} if v["maxnreg"] else {}
    if v["persistent"]:
        grid_size = min(
            grid[0], v["persistent"] * torch.cuda.get_device_properties(a.data.device).multi_processor_count
        )
        descs = [
            TensorDescriptor.from_tensor(t, blk)
            for t, blk in ((a.data, [bm, 128]), (w.data, [bn, 128]), (out, [bm, bn]))
        ]
        _persistent_kernel[(grid_size,)](*descs, a.scale, w.scale, m, n, k, GRID=grid_size, STAGES=v["stages"],
                                         BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=v["warps"])  # fmt: skip
        return out
    if v["halves"]:
        a_desc = TensorDescriptor.from_tensor(a.data, [bm, 128])
        b_desc = TensorDescriptor.from_tensor(w.data, [bn // v["halves"], 128])
        _halves_kernel[grid](a_desc, b_desc, out, scales_t if v["scales_t"] else a.scale, w.scale, m, n, k,
                             SCALES_T=v["scales_t"], HALVES=v["halves"], STAGES=v["stages"], BLOCK_M=bm, BLOCK_N=bn,
                             GROUP_M=8, num_warps=v["warps"], **extra)  # fmt: skip
        return out
    common = dict(FOLD=v["fold"], UNROLL=v["unroll"], BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=v["warps"], **extra)
    if v["tma"]:
        a_desc = TensorDescriptor.from_tensor(a.data, [bm, 128])
        b_desc = TensorDescriptor.from_tensor(w.data, [bn, 128])
        _tma_kernel[grid](a_desc, b_desc, out, a.scale, w.scale, m, n, k, WS=v["ws"], STAGES=v["stages"], **common)
    else:
        _ptr_kernel[grid](a.data, w.data, out, a.scale, w.scale, m, n, k, num_stages=v["stages"], **common)
    return out


def variant(bm, bn, warps, stages, *, fold=False, unroll=1, tma=False, ws=False, maxnreg=0, halves=0, scales_t=False,
            persistent=0):  # fmt: skip
    return dict(BLOCK_M=bm, BLOCK_N=bn, warps=warps, stages=stages, fold=fold, unroll=unroll, tma=tma, ws=ws,
                maxnreg=maxnreg, halves=halves, scales_t=scales_t, persistent=persistent)  # fmt: skip


PERSISTENT = [  # twelfth session: programs per SM x tile
    variant(128, 128, 8, 3, persistent=1),
    variant(128, 128, 8, 4, persistent=1),
    variant(64, 128, 4, 4, persistent=2),
]
VARIANTS = [  # the fourth session's variants are in its RESULTS.md table; these are the seventh session's
    variant(64, 128, 4, 3, fold=True, tma=True, maxnreg=168),  # three programs per SM instead of two
    variant(64, 128, 4, 2, fold=True, tma=True, maxnreg=168),
    variant(64, 128, 4, 3, fold=True, tma=True, maxnreg=128),  # four, if the shared memory of 2 stages allows
    variant(64, 128, 4, 2, fold=True, tma=True, maxnreg=128),
    variant(64, 128, 4, 3, halves=2),
    variant(64, 128, 4, 3, halves=2, scales_t=True),
    variant(128, 128, 8, 3, halves=2, scales_t=True),
    variant(64, 256, 4, 3, halves=2, scales_t=True),
    variant(64, 128, 4, 4, fold=True, tma=True),
    variant(64, 128, 4, 5, fold=True, tma=True),
    variant(64, 128, 4, 3, halves=1),
    variant(64, 128, 4, 3, halves=1, scales_t=True),
    variant(64, 128, 4, 4, halves=1, scales_t=True),
    variant(64, 128, 4, 5, halves=1, scales_t=True),
    variant(128, 128, 8, 4, halves=1, scales_t=True),
]


def shape_row(m: int, n: int, k: int, peak_tflops: float) -> dict:
    a, w = inputs(m, n, k, seed=m + n + k)
    want = a[0].dequantize() @ w[0].dequantize().t()
    flops = 2 * m * n * k
    row = {"M": m, "N": n, "K": k, "variants": []}

    def record(name, fn):
        try:
            err = rel_err(fn(0), want)
            ms = time_graph_ms(fn, sets=SETS, reps=30) if err < 1e-2 else None
        except Exception as e:  # a variant the compiler refuses is reported, not hidden
            print(f"  {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            row["variants"].append({"name": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            return
        pct = f"{flops / ms / 1e9 / peak_tflops:.0%}" if ms else "-"
        print(f"  {name}: {ms} ms, {pct} of FP8 peak, rel err {err:.1e}", flush=True)
        row["variants"].append({"name": name, "ms": ms, "rel_err": err})

    scales_t = [x.scale.t().contiguous() for x in a]  # [K/128, M]: what a quantiser writing M-major would give
    print(f"M={m} N={n} K={k}", flush=True)
    record("cublas", lambda i: gemm.gemm_fp8_cublas(a[i], w[i], out_dtype=torch.bfloat16, bias=None))
    committed = gemm._tile(m, n, k, True, False)  # the default mode's Triton launch here (cuBLAS serves M >= 256)
    record("committed", lambda i: gemm._launch_gemm(
        a[i].data, w[i].data, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"), a[i].scale, w[i].scale,
        None, False, committed))  # fmt: skip
    for v in PERSISTENT if "persistent" in sys.argv else VARIANTS:
        name = ",".join(f"{key}={val}" for key, val in v.items())
        record(name, lambda i, v=v: launch(v, a[i], w[i], scales_t[i]))
    return row


def main() -> None:
    peak = fp8_peak_tflops()
    print(f"FP8 peak (8192^3 tensor-wise scaled_mm): {peak:.0f} TFLOP/s", flush=True)
    report = {"device": torch.cuda.get_device_name(), "fp8_peak_tflops": peak, "rows": []}
    projections = ((24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168))
    for m, n, k in [(4096, n, k) for n, k in projections] + [(512, 4096, 7168)]:
        report["rows"].append(shape_row(m, n, k, peak))
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
