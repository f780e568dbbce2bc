"""``quantize_fp8``, ``gemm``, ``grouped_gemm`` with DeepSeek block scaling.

FP8 products accumulate per 128-wide K block in fp32 and apply both scales per block (as DeepGEMM does). bf16
products go to cuBLAS through torch by default; the Triton bf16 kernel is the batch-invariant variant.

Batch invariance is a matter of each element's arithmetic, not of the launch shape. Without a split over K, every
tile of 64-row multiples (tensor-core products of 64 rows) computes an element the same way: the K-ordered sum of
its 128-deep products, each accumulated from zero and scaled; so do the swapped kernels that serve a few rows
(``_gemm_swapped_kernel``) and the masked layout of decode (``_grouped_masked_swapped_kernel``). cuBLAS's
block-scaled FP8 product gives exactly those bits from 64 rows on (benchmarks/NOTES.md, gemm: 2026-12-01 —
batch-invariant FP8 gemm without a split over K), so
batch-invariant mode may take it, row count by row count, once it has been seen to
(``cublas_fp8_invariant_supports``). The same holds for bf16 products and cuBLAS's bf16 product
(``cublas_invariant_supports``).

fp32 products (the router's logits) run as three tf32 tensor-core products (tf32x3: each operand's tf32 high part
times the other's, plus both high-low cross terms; close to fp32) with one fixed tile, and split K into spans whose
number is set by K alone, added in span order: no row count enters a row's arithmetic there either.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer import Decline, QTensor
from deepinfer.dispatch import batch_invariant_enabled
from deepinfer.qtensor import quantize_blocks

from ._triton import INTERPRET, PDL, cast, dot, num_sms, on_device, pdl_wait, placed, pow2_ceil, tma_ready, to_e4m3

FP8_BLOCK = 128


# --- quantize_fp8 -------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, UE8M0: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     PREROUND: tl.constexpr):  # fmt: skip
    """One scale group (``BLOCK`` columns) of ``ROWS`` rows per program."""
    pdl_wait()
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    mask = rows < M
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0
    if UE8M0:
        scale = pow2_ceil(scale)
    # max and maximum drop a NaN on the GPU: a group holding one gets a NaN scale explicitly, as the contract says.
    scale = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, float("nan"), scale)
    q = to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0), PREROUND)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask[:, None])
    tl.store(s_ptr + rows * (K // BLOCK) + group, scale, mask=mask)


QUANTIZE_ROWS = 16  # rows per program (one row per program made a million programs of 128 values for prefill)


def quantize_fp8(x, *, block, scale_format):
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // block, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(triton.cdiv(m, QUANTIZE_ROWS), k // block)](
            x2,
            q,
            s,
            m,
            k,
            UE8M0=scale_format == "ue8m0",
            BLOCK=block,
            ROWS=QUANTIZE_ROWS,
            PREROUND=INTERPRET,
            launch_pdl=PDL,
        )
    return QTensor(q.view(x.shape), s.view(*x.shape[:-1], k // block), (1, block), scale_format)


def quantize_supports(x, *, block, scale_format) -> bool | Decline:
    answer = placed(x=x)
    if answer and (block != triton.next_power_of_2(block) or block < 16):
        return Decline(f"block {block} is not a power of two >= 16")
    return answer


# --- dense GEMM ---------------------------------------------------------------------------------------------------


@triton.jit
def tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid``: consecutive programs walk ``GROUP_M`` row tiles down one column
    of tiles, so a wave of programs shares its weight tiles in L2."""
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * grid_n) * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * grid_n)) % rows_in_group, (pid % (GROUP_M * grid_n)) // rows_in_group


@triton.jit
def _load_tile(src, first, offs, mask, stride, k0, K, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Rows ``first + [0, len(offs))``, columns ``[k0, k0 + BLOCK_K)`` of a row-major [rows, K] operand: one TMA
    copy (out-of-range elements read as zero) or masked loads."""
    if TMA:
        tile = src.load([first.to(tl.int32), k0])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(
            src + offs[:, None] * stride + offs_k[None, :], mask=mask[:, None] & (offs_k < K)[None, :], other=0.0
        )
    return tile


@triton.jit
def _block_scales(as_ptr, bs_ptr, offs_m, mask_m, b_block, k0, K, BLOCK_K: tl.constexpr):
    """``a_scale[m] * b_scale`` of the 128-deep K block at ``k0``, per row of A, for a tile inside one 128-column
    weight block (``b_block``): the two scales meet first, so scaling a product costs one FMA per element."""
    kb = k0 // BLOCK_K
    sa = tl.load(as_ptr + offs_m * (K // BLOCK_K) + kb, mask=mask_m, other=0.0)
    sb = tl.load(bs_ptr + b_block * (K // BLOCK_K) + kb)
    return sa * sb


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_src,
    b_src,
    c_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    TF32X3: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[N, K]^T; FP8: A scales [M, K/128], B scales [ceil(N/128), K/128], BLOCK_K = 128.
    ``a_src`` / ``b_src`` are TMA descriptors (TMA) or pointers. SPLIT_K > 1 cuts K into SPLIT_K spans, each
    accumulated from zero by the programs of axis 1, which store their fp32 partial products at ``C + split * M * N``
    (no bias) for ``_sum_splits_kernel``."""
    pdl_wait()
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    for k0 in range(split * k_span, tl.minimum(K, (split + 1) * k_span), BLOCK_K):
        a = _load_tile(a_src, pid_m * BLOCK_M, offs_m, mask_m, stride_am, k0, K, BLOCK_K, TMA)
        b = _load_tile(b_src, pid_n * BLOCK_N, offs_n, mask_n, stride_bn, k0, K, BLOCK_K, TMA)
        if FP8:
            part = dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_DOT)
            scales = _block_scales(as_ptr, bs_ptr, offs_m, mask_m, pid_n * BLOCK_N // BLOCK_K, k0, K, BLOCK_K)
            acc = acc + part * scales[:, None]
        elif TF32X3:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="tf32x3")
        else:
            acc = dot(a, tl.trans(b), acc, FP32_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K > 1:
        c_ptr += split.to(tl.int64) * M * N
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        cast(acc, c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _swapped_product(a_src, b_src, as_ptr, bs_ptr, a_first, offs_m, mask_m, stride_am, b_first, b_rows, mask_n,
                     stride_bn, b_block, k_lo, k_hi, K, TMA: tl.constexpr, FP32_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The fp32 [BLOCK_N, BLOCK_M] tile of B A^T over the 128-deep K blocks in ``[k_lo, k_hi)``: weight rows
    ``b_first + [0, BLOCK_N)`` (``b_rows``) by A rows ``a_first + [0, BLOCK_M)`` (``offs_m``), each block's product
    from zero, then one FMA with both scales (``_block_scales``, weight-scale block ``b_block``)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        b = _load_tile(b_src, b_first, b_rows, mask_n, stride_bn, k0, K, BLOCK_K, TMA)
        a = _load_tile(a_src, a_first, offs_m, mask_m, stride_am, k0, K, BLOCK_K, TMA)
        part = dot(b, tl.trans(a), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), FP32_DOT)
        scales = _block_scales(as_ptr, bs_ptr, offs_m, mask_m, b_block, k0, K, BLOCK_K)
        acc = acc + part * scales[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemm_swapped_kernel(
    a_src,
    b_src,
    c_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    TMA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_PARTS: tl.constexpr,
):
    """``_gemm_kernel``'s FP8 product for a few rows, with the operands swapped: each program computes the
    [BLOCK_N, BLOCK_M] tile of C^T = B A^T, so the weight's rows fill the tensor cores' 64 or 128 rows and A's few
    rows are not padded to 64. Per element the arithmetic is ``_gemm_kernel``'s (each 128-deep product from zero,
    then one FMA with both scales), and so are its bits (benchmarks/NOTES.md, gemm: 2026-12-02 — few-row FP8 gemm
    with swapped operands). Axis 0 walks the column
    tiles, axis 1 the row tiles, axis 2 the K spans (fp32 partials at ``C + split * M * N``, as there).

    BLOCK_PARTS: the K blocks' products, unscaled, each stored at ``C + block * M * N`` (fp32) for
    ``_chain_blocks_kernel``, which scales and adds them in K order: the unsplit arithmetic, with K spread over
    programs."""
    pdl_wait()
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    if BLOCK_PARTS:
        at = c_ptr + offs_m[None, :] * N + offs_n[:, None]
        for k0 in range(split * k_span, tl.minimum(K, (split + 1) * k_span), BLOCK_K):
            b = _load_tile(b_src, pid_n * BLOCK_N, offs_n, mask_n, stride_bn, k0, K, BLOCK_K, TMA)
            a = _load_tile(a_src, pid_m * BLOCK_M, offs_m, mask_m, stride_am, k0, K, BLOCK_K, TMA)
            part = dot(b, tl.trans(a), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), FP32_DOT)
            tl.store(at + (k0 // BLOCK_K) * M * N, part, mask=mask_n[:, None] & mask_m[None, :])
    else:
        acc = _swapped_product(a_src, b_src, as_ptr, bs_ptr, pid_m * BLOCK_M, offs_m, mask_m, stride_am,
                               pid_n * BLOCK_N, offs_n, mask_n, stride_bn, pid_n * BLOCK_N // BLOCK_K,
                               split * k_span, tl.minimum(K, (split + 1) * k_span), K, TMA, FP32_DOT, BLOCK_M,
                               BLOCK_N, BLOCK_K)  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if SPLIT_K > 1:
            c_ptr += split.to(tl.int64) * M * N
        tl.store(
            c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None],
            cast(acc, c_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )


@triton.jit
def _sum_splits_kernel(
    parts_ptr, bias_ptr, out_ptr, MN, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    """out[m, n] = parts[0, m, n] + ... + parts[SPLIT - 1, m, n] (+ bias[n]) for the fp32 partials ``[SPLIT, M, N]``,
    added in split order, rounded once to out's dtype."""
    pdl_wait()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(parts_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(parts_ptr + s * MN + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // N) * stride_om + i % N, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chain_blocks_kernel(
    parts_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, M, N, stride_om, KB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """out[m, n] from the K blocks' unscaled fp32 products ``parts [KB, M, N]``: from zero, one FMA per block in K
    order with ``_block_scales``, as the unsplit K loop does (+ bias[n]), rounded once to out's dtype."""
    pdl_wait()
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    m, n = i // N, i % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for kb in tl.static_range(KB):
        part = tl.load(parts_ptr + kb * M * N + i, mask=mask, other=0.0)
        acc = acc + part * _block_scales(as_ptr, bs_ptr, m, mask, n // 128, kb * 128, KB * 128, 128)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, cast(acc, out_ptr.dtype.element_ty), mask=mask)


class Tile(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    block_k: int = 64  # K per step of a bf16 / fp16 / fp32 product (FP8 steps are one 128-deep scale block)
    tf32x3: bool = False  # fp32 operands as three tf32 tensor-core products (else FMAs on the CUDA cores)
    swap: bool = False  # FP8: ``_gemm_swapped_kernel``, block_n weight rows by block_m rows of A per program
    block_parts: bool = False  # swapped FP8: K blocks' products apart, added in K order by ``_chain_blocks_kernel``


SPLIT_K_MIN_K = 4096  # FP8 products this long split K where their tiles would leave SMs idle
FILL_WAVES = 2  # ... that is, where the tiles give fewer programs than this many per SM
MIN_COLUMN_TILES = 40  # unsplit tiles narrow until N gives this many (about a third of the H200's SMs) or 32 wide
SHORT_K = 512  # ... except products this short, whose few K blocks per program leave more, narrower programs faster
# Measurements of the constants below: benchmarks/NOTES.md, gemm (2026-12-01 — batch-invariant K spans in one program:
# DEEP_K; 2026-12-02 — few-row FP8 gemm with swapped operands: SWAP_MAX_M; 2026-12-03 — cuBLAS waves, the power
# limit, few-row gemm, and 2026-12-04 — one tile in both modes, block parts over 8 spans: SWAPPED_SPLIT_K;
# 2026-12-02 — block parts at a few rows: BLOCK_PARTS_MAX_SHARE).
DEEP_K = 4096  # 64 x 128 tiles of products this deep keep 4 K blocks in flight, not 3
SWAP_MAX_M = 16  # FP8 products of at most this many rows swap their operands ...
SWAPPED_TILE = Tile(16, 64, 4, 6, swap=True)  # ... 64 weight rows by 16 of A; the same bits as the 64-row tiles
SWAPPED_SPLIT_K = 8  # spans of a split swapped product: 1.02-1.17x four at K >= 7168, in both modes
# Batch-invariant swapped products split long K all the same where the unsplit tiles would give at most this share
# of the SMs a program: the K blocks' products are computed in parallel, then scaled and added in K order by a second
# kernel, the unsplit arithmetic
BLOCK_PARTS_MAX_SHARE = 0.5
CHAIN_LAUNCH = (32, 1)  # elements and warps per program of the kernel that chains the blocks' products


def _deep(tile: Tile, k: int) -> Tile:
    return tile._replace(num_stages=4) if k >= DEEP_K else tile


def _fills_gpu(m: int, n: int, block_m: int, block_n: int) -> bool:
    """Whether the tiles of an [m, n] output alone give every SM ``FILL_WAVES`` programs."""
    return triton.cdiv(m, block_m) * triton.cdiv(n, block_n) >= FILL_WAVES * num_sms()


def _tile(m: int, n: int, k: int, fp8: bool, invariant: bool, swap: bool | None = None) -> Tile:
    """The launch shape (measured on the H200 over the DeepSeek-V3 projections: ``benchmarks/gemm_tiles.py``;
    benchmarks/NOTES.md, gemm, has the swapped and block-parts launches). Up to ``SWAP_MAX_M`` rows, FP8 products
    swap their operands. Otherwise batch-invariant mode keeps 64-row tiles, whose bits do not depend on the tile
    (module docstring), and sets the tile's width by the grid. The default mode splits K where the tiles would not
    fill the GPU; batch-invariant mode never sums partial products over K, but spreads a few rows' K blocks over
    programs where the unsplit swapped tiles would leave most SMs idle, then adds their products in K order
    (``block_parts``). bf16 / fp16 products (the batch-invariant ones) take 64 x 128 tiles, or 64 x 256 where N
    alone gives two waves of those. ``swap``: whether FP8 operands swap (None: up to ``SWAP_MAX_M`` rows, the choice
    the registry's ``triton-fp8-swapped`` implementations make)."""
    if not fp8:
        wide = _fills_gpu(1, n, 1, 256)  # N alone, whatever M: lm_head takes 256 columns (NOTES.md, gemm)
        return Tile(64, 256, 8, 4) if wide else _deep(Tile(64, 128, 4, 3), k)
    if swap if swap is not None else m <= SWAP_MAX_M:
        programs = triton.cdiv(m, SWAPPED_TILE.block_m) * triton.cdiv(n, SWAPPED_TILE.block_n)
        split = k >= SPLIT_K_MIN_K and programs < FILL_WAVES * num_sms()
        if invariant:
            split = split and programs <= BLOCK_PARTS_MAX_SHARE * num_sms()
        if not split:  # no more stages than K blocks: a spare stage only takes shared memory other programs could use
            return SWAPPED_TILE._replace(num_stages=min(SWAPPED_TILE.num_stages, triton.cdiv(k, FP8_BLOCK)))
        return SWAPPED_TILE._replace(num_stages=4, split_k=SWAPPED_SPLIT_K, block_parts=invariant)
    tile = Tile(64, 64, 4, 3) if m <= 64 else _deep(Tile(64, 128, 4, 3), k)
    if invariant or k < SPLIT_K_MIN_K or _fills_gpu(m, n, tile.block_m, tile.block_n):
        return _unsplit_tile(m, n, k)
    return tile._replace(split_k=4)


# fp32 products: one tile for every row count, K cut into spans of about FP32_SPAN, at most MAX_FP32_SPANS of them.
# Three tf32 tensor-core products each (0.7-1.2x cuBLAS's fp32 product at the router's shape; FMAs on the CUDA cores:
# 3-8x); tiles with the same spans give the same bits (benchmarks/NOTES.md, gemm: 2026-12-02 — batch-invariant
# router and lm_head).
FP32_TILE, FP32_SPAN, MAX_FP32_SPANS = Tile(64, 32, 4, 4, block_k=32, tf32x3=True), 512, 16


def _fp32_tile(k: int) -> Tile:
    """The fp32 launch: ``FP32_TILE`` with a split over K whose span count depends on K alone."""
    return FP32_TILE._replace(split_k=min(triton.cdiv(k, FP32_SPAN), MAX_FP32_SPANS))


def _unsplit_tile(m: int, n: int, k: int) -> Tile:
    """Where 64 x 128 tiles fill the GPU, those; products of at most ``SHORT_K`` at up to 64 rows 64 x 64 tiles;
    else the widest of 128, 64, 32 columns that still cuts N into ``MIN_COLUMN_TILES`` tiles, twice as wide where that
    alone makes the grid one wave instead of two, with 6 K blocks in flight for long products where each SM has at
    most one program (``benchmarks/gemm_tiles.py unsplit``, ``benchmarks/gemm_invariant_cost.py``)."""
    if _fills_gpu(m, n, 64, 128):
        return _deep(Tile(64, 128, 4, 3), k)
    if k <= SHORT_K and m <= 64:
        return Tile(64, 64, 4, 3)
    block_n = next((bn for bn in (128, 64) if triton.cdiv(n, bn) >= MIN_COLUMN_TILES), 32)
    rows = triton.cdiv(m, 64)
    if block_n < 128 and rows * triton.cdiv(n, block_n) > num_sms() >= rows * triton.cdiv(n, 2 * block_n):
        block_n *= 2
    one_wave = rows * triton.cdiv(n, block_n) <= num_sms()
    return Tile(64, block_n, 4, 6) if one_wave and k >= 2048 else _deep(Tile(64, block_n, 4, 3), k)


def _launch_gemm(a, b, out, a_scale, b_scale, bias, invariant: bool, tile: Tile | None = None) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return out
    bias = bias.contiguous() if bias is not None else None  # read at bias_ptr + n
    fp8 = a_scale is not None
    tile = tile or _tile(m, n, k, fp8, invariant)
    block_m = tile.block_m
    if INTERPRET:  # the interpreter's row-independent dot materialises [BLOCK_M, BLOCK_K, BLOCK_N]: keep it <= 2^20
        block_m = min(block_m, 64)
    split = tile.split_k
    block_k = FP8_BLOCK if fp8 else tile.block_k
    assert not fp8 or FP8_BLOCK % tile.block_n == 0, "an FP8 tile lies inside one 128-column weight-scale block"
    assert fp8 or not tile.swap, "only FP8 products swap their operands"
    assert tile.swap or not tile.block_parts, "the swapped kernel stores the K blocks' products"
    parts = k // FP8_BLOCK if tile.block_parts else split  # fp32 [parts, m, n] ahead of a second kernel
    split_out = tile.block_parts or split > 1
    target = torch.empty(parts, m, n, dtype=torch.float32, device=out.device) if split_out else out
    dummy = out
    tma = tma_ready(a, b)
    args = (
        TensorDescriptor.from_tensor(a, [block_m, block_k]) if tma else a,
        TensorDescriptor.from_tensor(b, [tile.block_n, block_k]) if tma else b,
        target,
        a_scale if fp8 else dummy,
        b_scale if fp8 else dummy,
        bias if bias is not None and target is out else dummy,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0) if target is out else n,
    )
    launch = dict(
        TMA=tma,
        HAS_BIAS=bias is not None and target is out,
        FP32_DOT=INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        enable_fp_fusion=True,  # one FFMA per scaled block: cuBLAS's bits (Triton 3.10 turns fusion off by default)
    )
    if tile.swap:
        _gemm_swapped_kernel[(triton.cdiv(n, tile.block_n), triton.cdiv(m, block_m), split)](
            *args, **launch, BLOCK_PARTS=tile.block_parts, launch_pdl=PDL
        )
    else:
        _gemm_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, tile.block_n), split)](
            *args,
            FP8=fp8,
            TF32X3=tile.tf32x3 and not INTERPRET,  # the interpreter's fp32 path multiplies in fp32
            GROUP_M=8,
            **launch,
            launch_pdl=PDL,
        )
    if tile.block_parts:
        block, warps = CHAIN_LAUNCH
        _chain_blocks_kernel[(triton.cdiv(m * n, block),)](
            target, a_scale, b_scale, bias if bias is not None else dummy, out, m, n, out.stride(0),
            KB=parts, HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps, enable_fp_fusion=True,
            launch_pdl=PDL,
        )  # fmt: skip
    elif target is not out:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            target,
            bias if bias is not None else dummy,
            out,
            m * n,
            n,
            out.stride(0),
            SPLIT=split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            launch_pdl=PDL,
        )
    return out


def _as_fp8(a, w: QTensor) -> QTensor:
    return a if isinstance(a, QTensor) else quantize_fp8(a, block=FP8_BLOCK, scale_format=w.scale_format)


def gemm_fp8(a, w, *, out_dtype, bias, invariant: bool = False, swap: bool | None = None):
    """A bf16 or FP8 activation against an FP8 block-scaled weight (bf16 ``a`` is quantised first). ``swap``: by
    ``_gemm_swapped_kernel`` (True) or ``_gemm_kernel`` (False); None: ``_tile``'s choice by the row count."""
    qa = _as_fp8(a, w)
    m, (n, k) = qa.shape[0], w.shape
    out = torch.empty(m, n, dtype=out_dtype, device=qa.data.device)
    tile = None if swap is None or m == 0 or n == 0 else _tile(m, n, k, True, invariant, swap)
    return _launch_gemm(
        qa.data.contiguous(), w.data.contiguous(), out, qa.scale.contiguous(), w.scale.contiguous(), bias, invariant,
        tile,
    )  # fmt: skip


CUBLAS_FP8_MIN_M = 256  # below, the Triton kernel (split over K where the GPU would idle) is faster


def gemm_fp8_cublas(a, w, *, out_dtype, bias, out: torch.Tensor | None = None):
    """cuBLAS block-scaled FP8 through torch's ``scaled_mm`` (1x128 activation and 128x128 weight scales, fp32
    accumulation); not batch-invariant. cuBLAS takes row counts that are multiples of 4: rows are padded. ``out``
    (rows a multiple of 4): written in place, through the out form of the op behind ``scaled_mm``."""
    qa = _as_fp8(a, w)
    m, pad = qa.shape[0], -qa.shape[0] % 4
    data, scale = qa.data.contiguous(), qa.scale
    if pad:
        data = F.pad(data.view(torch.uint8), (0, 0, 0, pad)).view(data.dtype)
        scale = F.pad(scale, (0, 0, 0, pad))
    scale_a = scale.t().contiguous().t()  # cuBLAS reads activation scales outer-dim-major
    recipe = F.ScalingType
    if out is not None:
        return torch._scaled_mm_v2(
            data, w.data.t(), [scale_a], [recipe.BlockWise1x128.value], [], [w.scale.t()],
            [recipe.BlockWise128x128.value], [], None, out_dtype, [], False, out=out,
        )  # fmt: skip
    out = F.scaled_mm(
        data, w.data.t(), scale_a, recipe.BlockWise1x128, w.scale.t(), recipe.BlockWise128x128, output_dtype=out_dtype
    )
    return out[:m]


@functools.cache
def _cublas_fp8_agrees() -> bool:
    """Whether this torch and cuBLAS run the block-scaled product, and agree with the Triton kernel, at a shape
    cuBLAS accepts (asked once, outside graph capture)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(128, 512, device="cuda", generator=gen).bfloat16()
    w = quantize_blocks(torch.randn(256, 512, device="cuda", generator=gen))
    try:
        got = gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None).float()
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError):
        return False
    want = gemm_fp8(a, w, out_dtype=torch.float32, bias=None)
    return bool(((got - want).norm() / want.norm()) < 1e-2)


def cublas_fp8_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    a_data = a.data if isinstance(a, QTensor) else a
    if INTERPRET:
        return Decline("cuBLAS does not run in the Triton interpreter")
    if not isinstance(w, QTensor) or w.block != (FP8_BLOCK, FP8_BLOCK):
        return Decline(f"w is not FP8 with ({FP8_BLOCK}, {FP8_BLOCK}) scale blocks")
    if isinstance(a, QTensor) and a.block != (1, FP8_BLOCK):
        return Decline(f"a's scale blocks are {a.block}, not (1, {FP8_BLOCK})")
    if a_data.dim() != 2 or a_data.shape[0] < CUBLAS_FP8_MIN_M:
        return Decline(f"{a_data.shape[0]} rows < {CUBLAS_FP8_MIN_M}")
    if w.shape[1] % (4 * FP8_BLOCK):  # cuBLAS wants a multiple of 4 scale blocks along K
        return Decline(f"K = {w.shape[1]} is not a multiple of {4 * FP8_BLOCK}")
    if bias is not None:
        return Decline("a bias is given")
    if out_dtype != torch.bfloat16:
        return Decline(f"out_dtype is {out_dtype}, expected torch.bfloat16")
    if a_data.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return Decline(f"a is {a_data.dtype}, not bf16 or e4m3")
    if not on_device(a_data, w.data):
        return Decline("operands are not on the GPU")
    if not hasattr(F, "scaled_mm"):
        return Decline("this torch has no scaled_mm")
    if not _cublas_fp8_ready():
        return Decline("cuBLAS's block-scaled FP8 product is not known to agree here")
    return True


def _cublas_fp8_ready() -> bool:
    if _cublas_fp8_agrees.cache_info().currsize or not torch.cuda.is_current_stream_capturing():
        return _cublas_fp8_agrees()
    return False  # never ask for the first time inside a CUDA graph capture


_cublas_answers: dict[tuple, bool] = {}  # per key (FP8 or dense product): whether cuBLAS gave the Triton bits


def _cublas_agreed(key: tuple, probe: Callable[[], bool]) -> bool:
    """``probe()``'s answer for ``key``, asked once; never asked for the first time inside a CUDA graph capture
    (declined there)."""
    if key not in _cublas_answers:
        if torch.cuda.is_current_stream_capturing():
            return False
        _cublas_answers[key] = probe()
    return _cublas_answers[key]


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def cublas_fp8_invariant_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """cuBLAS in batch-invariant mode: where it runs, and only at a row count where it gave the unsplit Triton
    kernel's bits (asked once per row count and weight shape, outside graph capture, on random activations)."""
    answer = cublas_fp8_supports(a, w, out_dtype=out_dtype, bias=bias)
    if not answer:
        return answer
    m = (a.data if isinstance(a, QTensor) else a).shape[0]
    if not _cublas_agreed((m, *w.shape, w.data.device.index or 0), lambda: _cublas_gives_unsplit_bits(m, w)):
        return Decline(f"at {m} rows cuBLAS does not give the unsplit kernel's bits (or was not asked yet)")
    return True


def _cublas_gives_unsplit_bits(m: int, w: QTensor) -> bool:
    device, k = w.data.device, w.shape[1]
    gen = torch.Generator(device=device).manual_seed(m)
    code = torch.randint(0, 254, (m, k), dtype=torch.uint8, device=device, generator=gen)
    data = (code + (code >= 127).to(torch.uint8)).view(torch.float8_e4m3fn)  # any sign and magnitude, never NaN
    scale = torch.randint(-8, 8, (m, k // FP8_BLOCK), device=device, generator=gen).float().exp2()
    a = QTensor(data, scale, (1, FP8_BLOCK), w.scale_format)
    want = gemm_fp8(a, w, out_dtype=torch.bfloat16, bias=None, invariant=True)
    return _same_bits(gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None), want)


def gemm_triton(a, w, *, out_dtype, bias):
    """bf16 / fp16 / fp32 operands (both of one dtype) with a tile that no row count changes: the batch-invariant
    dense product."""
    out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device=a.device)
    tile = _fp32_tile(a.shape[1]) if a.dtype == torch.float32 else None
    return _launch_gemm(a.contiguous(), w.contiguous(), out, None, None, bias, invariant=True, tile=tile)


@functools.cache
def _mm_widens() -> bool:
    """Whether this torch multiplies bf16 / fp16 matrices straight into an fp32 result (``torch.mm(out_dtype=)``)."""
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


@contextlib.contextmanager
def _fp32_reductions() -> Iterator[None]:
    """Within the block cuBLAS keeps split-K partial sums of bf16 / fp16 products in fp32 (torch's default lets it
    reduce them in the operands' precision)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = before


def gemm_cublas(a, w, *, out_dtype, bias):
    """cuBLAS through torch, fp32 accumulation (split-K partials included); not batch-invariant (cuBLAS picks
    algorithms by shape). An fp32 result is never rounded to the input dtype on the way: bf16 / fp16 operands go
    straight into an fp32 result where torch can (logits over a large vocabulary: no fp32 copy of the weight each
    call), else through fp32 copies of the operands."""
    if out_dtype == torch.float32 and a.dtype != torch.float32:
        if a.dtype == w.dtype and _mm_widens():
            out = torch.mm(a, w.t(), out_dtype=torch.float32)
            return out if bias is None else out + bias.float()
        a, w = a.float(), w.float()
    with _fp32_reductions():
        out = torch.nn.functional.linear(a, w)
    if bias is not None:
        return (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)


def fp8_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    a_data = a.data if isinstance(a, QTensor) else a
    if not isinstance(w, QTensor):
        return Decline("w is dense, not an FP8 QTensor")
    if not (answer := placed(a=a, w=w, bias=bias)):
        return answer
    if a_data.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        return Decline(f"a is {a_data.dtype}, expected a float or float8_e4m3fn")
    return True


def fp8_swapped_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """``fp8_supports`` at up to ``SWAP_MAX_M`` rows: the swapped kernel's (weight rows as the tensor cores' M)."""
    answer = fp8_supports(a, w, out_dtype=out_dtype, bias=bias)
    m = (a.data if isinstance(a, QTensor) else a).shape[0]
    if answer and m > SWAP_MAX_M:
        return Decline(f"a has {m} rows > {SWAP_MAX_M}")
    return answer


def triton_dense_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    if isinstance(w, QTensor) or isinstance(a, QTensor):
        return Decline("a or w is an FP8 QTensor")
    if not (answer := placed(a=a, w=w, bias=bias)):
        return answer
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return Decline(f"a is {a.dtype}, expected bfloat16, float16 or float32")
    return True


def cublas_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    if INTERPRET:
        return Decline("cuBLAS does not run in the Triton interpreter")
    if isinstance(w, QTensor) or isinstance(a, QTensor):
        return Decline("a or w is an FP8 QTensor")
    if not (answer := placed(a=a, w=w, bias=bias)):
        return answer
    return True


CUBLAS_DENSE_INVARIANT_MIN_M = 256  # below, the Triton tile is as fast at lm_head's shape (NOTES.md, gemm)


def cublas_invariant_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """cuBLAS for bf16 / fp16 operands in batch-invariant mode: from ``CUBLAS_DENSE_INVARIANT_MIN_M`` rows, without
    a bias, and only at a row count where it gave ``gemm_triton``'s bits (asked once per row count, shape and dtypes,
    outside graph capture, on random activations against the weight itself)."""
    answer = cublas_supports(a, w, out_dtype=out_dtype, bias=bias)
    if not answer:
        return answer
    if bias is not None:
        return Decline("a bias is given")
    if a.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"a is {a.dtype}, expected bfloat16 or float16")
    if a.shape[0] < CUBLAS_DENSE_INVARIANT_MIN_M:
        return Decline(f"{a.shape[0]} rows < {CUBLAS_DENSE_INVARIANT_MIN_M}")
    m = a.shape[0]
    key = ("dense", m, *w.shape, a.dtype, out_dtype, w.device.index or 0)
    if not _cublas_agreed(key, lambda: _cublas_gives_triton_bits(m, w, out_dtype)):
        return Decline(f"at {m} rows cuBLAS does not give the Triton tile's bits (or was not asked yet)")
    return True


def _cublas_gives_triton_bits(m: int, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=w.device).manual_seed(m)
    a = torch.randn(m, w.shape[1], device=w.device, generator=gen).to(w.dtype)
    want = gemm_triton(a, w, out_dtype=out_dtype, bias=None)
    return _same_bits(gemm_cublas(a, w, out_dtype=out_dtype, bias=None), want)


# --- grouped GEMM -------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_m", "GRID_M"])
def _grouped_gemm_kernel(
    a_src,
    b_src,
    c_ptr,
    as_ptr,
    bs_ptr,
    offsets_ptr,
    masked_ptr,
    E,
    N,
    K,
    max_m,
    GRID_M,
    stride_am,
    stride_bn,
    stride_cm,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Contiguous: M tile t is the t-th over all experts (each program counts the experts' tiles from ``offsets``).
    Masked: M tile e * tiles_per_expert + t. Rows never cross experts. Programs walk ``GROUP_M`` M tiles (one
    expert's rows, mostly) down every column tile before the next ones, so those rows stay in L2 while the expert's
    weight streams past once (``tile_coords`` over ``GRID_M`` M tiles)."""
    pdl_wait()
    pid_m, pid_n = tile_coords(tl.program_id(0), GRID_M * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if MASKED:
        tiles = tl.cdiv(max_m, BLOCK_M)
        e = pid_m // tiles
        rows_in_expert = tl.load(masked_ptr + e)
        first = (pid_m % tiles) * BLOCK_M
        if first >= rows_in_expert:
            return
        row0 = e.to(tl.int64) * max_m + first
        row_end = e.to(tl.int64) * max_m + rows_in_expert
    else:
        experts = tl.arange(0, BLOCK_E)
        starts = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
        stops = tl.load(offsets_ptr + 1 + experts, mask=experts < E, other=0)
        tiles = tl.cdiv(stops - starts, BLOCK_M)  # M tiles of each expert (0 past E)
        ends = tl.where(experts < E, tl.cumsum(tiles, axis=0), 2147483647)
        e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        if e >= E:
            return
        tile_start = tl.sum(tl.where(experts < e, tiles, 0), axis=0)
        row0 = (tl.load(offsets_ptr + e) + (pid_m - tile_start) * BLOCK_M).to(tl.int64)
        row_end = tl.load(offsets_ptr + e + 1).to(tl.int64)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < row_end, offs_n < N
    # B is read as [E * N, K]: expert e's rows start at e * N (a tile past N reads the next expert's rows, which
    # only feed columns that are never stored)
    b_first = e.to(tl.int64) * N + pid_n * BLOCK_N
    b_block = e.to(tl.int64) * tl.cdiv(N, BLOCK_K) + pid_n * BLOCK_N // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _load_tile(a_src, row0, offs_m, mask_m, stride_am, k0, K, BLOCK_K, TMA)
        b = _load_tile(b_src, b_first, b_first + tl.arange(0, BLOCK_N), mask_n, stride_bn, k0, K, BLOCK_K, TMA)
        if FP8:
            part = dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_DOT)
            acc = acc + part * _block_scales(as_ptr, bs_ptr, offs_m, mask_m, b_block, k0, K, BLOCK_K)[:, None]
        else:
            acc = dot(a, tl.trans(b), acc, FP32_DOT)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        cast(acc, c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit(do_not_specialize=["max_m"])
def _grouped_masked_swapped_kernel(
    a_src,
    b_src,
    c_ptr,
    as_ptr,
    bs_ptr,
    masked_ptr,
    E,
    N,
    K,
    max_m,
    stride_am,
    stride_bn,
    stride_cm,
    TMA: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """FP8, masked layout (decode): the products of the row tiles that hold rows, operands swapped as in
    ``_gemm_swapped_kernel`` (a [BLOCK_N, BLOCK_M] tile of expert e's C^T = B_e A_e^T per step, each 128-deep
    product from zero, then one FMA with both scales: the bits of ``_grouped_gemm_kernel``'s 64-row tiles).

    The pairs (row tile holding rows, column tile) are numbered expert by expert, row tile by row tile, column tile
    fastest, and program p takes pairs p, p + programs, ...: a batch that reaches a few of many experts launches
    no program per empty tile, and each program holds at most one pair more than any other."""
    pdl_wait()
    experts = tl.arange(0, BLOCK_E)
    rows = tl.minimum(tl.load(masked_ptr + experts, mask=experts < E, other=0), max_m)
    tiles = tl.cdiv(rows, BLOCK_M)
    ends = tl.cumsum(tiles, axis=0)
    grid_n = tl.cdiv(N, BLOCK_N)
    for pair in range(tl.program_id(0), tl.sum(tiles, axis=0) * grid_n, tl.num_programs(0)):
        tile, pid_n = pair // grid_n, pair % grid_n
        e = tl.sum((ends <= tile).to(tl.int32), axis=0)
        first = e.to(tl.int64) * max_m  # expert e's first row of A and C
        row0 = first + (tile - tl.sum(tl.where(experts < e, tiles, 0), axis=0)) * BLOCK_M
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < first + tl.sum(tl.where(experts == e, rows, 0), axis=0)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_n = offs_n < N
        b_first = e.to(tl.int64) * N + pid_n * BLOCK_N  # B as [E * N, K], as in ``_grouped_gemm_kernel``
        b_block = e.to(tl.int64) * tl.cdiv(N, BLOCK_K) + pid_n * BLOCK_N // BLOCK_K
        acc = _swapped_product(a_src, b_src, as_ptr, bs_ptr, row0, offs_m, mask_m, stride_am, b_first,
                               b_first + tl.arange(0, BLOCK_N), mask_n, stride_bn, b_block, 0, K, K, TMA, FP32_DOT,
                               BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        tl.store(
            c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None],
            cast(acc, c_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )


# One tile for every row count and both layouts (batch-invariant: a row's bits never depend on the layout it came
# in). Outside batch-invariant mode, the bf16 masked layout of decode (the absorbed MLA products, every head holding
# the batch's rows) takes 16-row tiles below DECODE_TILE_MAX_M rows: from 64 rows the 64 x 128 tile measured
# 1.3-1.9x faster. FP8 in the masked layout, in both modes, swaps its operands: 64 weight rows by 16 of A, over the
# tiles that hold rows only, MASKED_PROGRAMS_PER_SM programs per SM (benchmarks/NOTES.md, grouped_gemm: 2026-12-02 —
# masked FP8 grouped_gemm, swapped).
GROUPED_TILE = Tile(64, 128, 4, 3)
GROUPED_DECODE_TILE, DECODE_TILE_MAX_M = Tile(16, 64, 4, 4), 63
GROUPED_GROUP_M = 16  # M tiles walked together down the column tiles (16 x 64 rows: 1024 rows, an expert or two)
MASKED_SWAPPED_TILE = Tile(16, 64, 4, 5, swap=True)
MASKED_PROGRAMS_PER_SM = 4


# The kernels ``grouped_gemm`` chooses between, in the order tried (each a registered implementation: ``plugin.py``):
# FP8 in the masked layout swaps its operands; outside batch-invariant mode the dense masked layout of decode takes
# ``GROUPED_DECODE_TILE`` below ``DECODE_TILE_MAX_M`` rows per expert; ``_grouped_gemm_kernel`` with
# ``GROUPED_TILE`` serves every supported call.
GROUPED_KERNELS = ("triton-masked-swapped", "triton-decode", "triton")


def grouped_kernel(a, w, *, masked_m, invariant: bool) -> str:
    """The first of ``GROUPED_KERNELS`` that serves a supported call in the given mode."""
    masked = masked_m is not None
    if isinstance(w, QTensor) and masked:
        return "triton-masked-swapped"
    a_data = a.data if isinstance(a, QTensor) else a
    if masked and a_data.shape[1] <= DECODE_TILE_MAX_M and not invariant:
        return "triton-decode"
    return "triton"


def grouped_gemm(a, w, *, expert_offsets, masked_m, out_dtype, kernel: str | None = None):
    """``ops.grouped_gemm`` by ``kernel`` (one of ``GROUPED_KERNELS``; None: ``grouped_kernel``'s choice in the
    current mode)."""
    if kernel is None:
        kernel = grouped_kernel(a, w, masked_m=masked_m, invariant=batch_invariant_enabled())
    fp8 = isinstance(w, QTensor)
    if fp8:
        a = _as_fp8(a, w)
    a_data = a.data if fp8 else a
    experts, n, k = w.shape
    masked = masked_m is not None
    # The kernels read entry e of either at ptr + e.
    masked_m = masked_m.contiguous() if masked else None
    expert_offsets = expert_offsets.contiguous() if expert_offsets is not None else None
    rows = a_data.shape[0] * a_data.shape[1] if masked else a_data.shape[0]
    out = torch.empty(*a_data.shape[:-1], n, dtype=out_dtype, device=a_data.device)
    if rows == 0 or n == 0:
        return out
    a2 = a_data.reshape(rows, k).contiguous()
    b = (w.data if fp8 else w).contiguous().view(experts * n, k)
    dummy = out  # stands in for the pointer arguments a launch does not read
    a_scale = a.scale.reshape(rows, -1).contiguous() if fp8 else dummy
    b_scale = w.scale.contiguous() if fp8 else dummy
    if kernel == "triton-masked-swapped":
        return _grouped_masked_swapped(a2, b, out, a_scale, b_scale, masked_m, experts, n, a_data.shape[1])
    tile = GROUPED_DECODE_TILE if kernel == "triton-decode" else _deep(GROUPED_TILE, k)
    block_m, block_n = tile.block_m, tile.block_n
    block_k = FP8_BLOCK if fp8 else tile.block_k
    assert not fp8 or FP8_BLOCK % block_n == 0, "an FP8 tile lies inside one 128-column weight-scale block"
    tma = tma_ready(a2, b)
    if masked:
        grid_m, offsets = experts * triton.cdiv(a_data.shape[1], block_m), dummy
    else:  # at most one partial tile per expert
        grid_m, offsets = triton.cdiv(rows, block_m) + experts, expert_offsets
    _grouped_gemm_kernel[(grid_m * triton.cdiv(n, block_n),)](
        TensorDescriptor.from_tensor(a2, [block_m, block_k]) if tma else a2,
        TensorDescriptor.from_tensor(b, [block_n, block_k]) if tma else b,
        out.view(rows, n),
        a_scale,
        b_scale,
        offsets,
        masked_m if masked else dummy,
        experts,
        n,
        k,
        a_data.shape[1] if masked else 0,
        grid_m,
        a2.stride(0),
        b.stride(0),
        n,
        MASKED=masked,
        FP8=fp8,
        TMA=tma,
        FP32_DOT=INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(experts),
        GROUP_M=GROUPED_GROUP_M,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=PDL,
    )
    return out


def _grouped_masked_swapped(a2, b, out, a_scale, b_scale, masked_m, experts: int, n: int, max_m: int):
    """``_grouped_masked_swapped_kernel`` on A ``[E * max_m, K]`` FP8, B ``[E * N, K]`` FP8 into ``out``."""
    tile = MASKED_SWAPPED_TILE
    k = a2.shape[1]
    tma = tma_ready(a2, b)
    pairs = experts * triton.cdiv(max_m, tile.block_m) * triton.cdiv(n, tile.block_n)  # at most
    _grouped_masked_swapped_kernel[(min(pairs, MASKED_PROGRAMS_PER_SM * num_sms()),)](
        TensorDescriptor.from_tensor(a2, [tile.block_m, FP8_BLOCK]) if tma else a2,
        TensorDescriptor.from_tensor(b, [tile.block_n, FP8_BLOCK]) if tma else b,
        out.view(-1, n),
        a_scale,
        b_scale,
        masked_m,
        experts,
        n,
        k,
        max_m,
        a2.stride(0),
        b.stride(0),
        n,
        TMA=tma,
        FP32_DOT=INTERPRET,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=FP8_BLOCK,
        BLOCK_E=triton.next_power_of_2(experts),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=PDL,
    )
    return out


def grouped_supports(a, w, *, expert_offsets, masked_m, out_dtype) -> bool | Decline:
    a_data = a.data if isinstance(a, QTensor) else a
    if not isinstance(w, QTensor) and a_data.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"a is {a_data.dtype} against a dense w, expected bfloat16 or float16")
    return placed(a=a, w=w, expert_offsets=expert_offsets, masked_m=masked_m)


def grouped_masked_swapped_supports(a, w, *, expert_offsets, masked_m, out_dtype) -> bool | Decline:
    """``grouped_supports`` for an FP8 weight in the masked layout."""
    if not isinstance(w, QTensor):
        return Decline("w is dense, not an FP8 QTensor")
    if masked_m is None:
        return Decline("the contiguous layout (expert_offsets), not the masked one")
    return grouped_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)


def grouped_decode_supports(a, w, *, expert_offsets, masked_m, out_dtype) -> bool | Decline:
    """``grouped_supports`` for a dense weight in the masked layout at up to ``DECODE_TILE_MAX_M`` rows per expert."""
    if isinstance(w, QTensor):
        return Decline("w is an FP8 QTensor")
    if masked_m is None:
        return Decline("the contiguous layout (expert_offsets), not the masked one")
    if a.shape[1] > DECODE_TILE_MAX_M:
        return Decline(f"a has {a.shape[1]} rows per expert > {DECODE_TILE_MAX_M}")
    return grouped_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)
