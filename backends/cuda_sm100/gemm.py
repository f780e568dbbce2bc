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
(``gemm_cublas.cublas_fp8_invariant_supports``). The same holds for bf16 products and cuBLAS's bf16 product
(``gemm_cublas.cublas_invariant_supports``).

Products with an fp32 weight (the router's logits; a bf16 / fp16 activation is taken in fp32 inside the kernel) run
batch-invariantly as three tf32 tensor-core products (tf32x3: each operand's tf32 high part times the other's, plus
both high-low cross terms; close to fp32) with one fixed tile, and split K into spans whose number is set by K alone,
added in span order: no row count enters a row's arithmetic there either. In default mode cuBLAS runs them, except at
a few rows of a short K, where the tf32x3 tile is a single launch (``FEW_ROWS_FP32_MAX_M``).

This file holds the ops' entry points, their ``supports`` and the Triton kernels' launch choice (tiles, splits over
K, grouped layouts); the kernels themselves are in ``gemm_triton.py``, cuBLAS's products and the probes of whether
they agree with the kernels in ``gemm_cublas.py``, the Hopper Gluon kernels in ``gemm_gluon.py`` and
``gemm_gluon_grouped.py``. ``plugin.py`` registers each kernel choice as an implementation of its own.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer import Decline, FP4Tensor, QTensor
from deepinfer.dispatch import batch_invariant_enabled

from . import probe
from ._triton import INTERPRET, PDL, num_sms, placed, tma_ready
from .gemm_triton import (
    _chain_blocks_kernel,
    _gemm_kernel,
    _gemm_swapped_kernel,
    _grouped_gemm_fp4_kernel,
    _grouped_gemm_kernel,
    _grouped_masked_swapped_kernel,
    _quantize_kernel,
    _sum_splits_kernel,
)

FP8_BLOCK = 128


# --- quantize_fp8 -------------------------------------------------------------------------------------------------


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


# fp32 weights at 2 to FEW_ROWS_FP32_MAX_M rows in default mode: the tf32x3 tile where K is one span (one launch,
# 5.9 us at the embedded model's router against cuBLAS's SGEMM and split-K sum, 7.8 us; a GEMV at one row, 3.8 us,
# and longer K stay with cuBLAS: benchmarks/NOTES.md, gemm — the router at a few rows).
FEW_ROWS_FP32_MAX_M = 16


def _fp32_tile(k: int) -> Tile:
    """The fp32 launch: ``FP32_TILE`` with a split over K whose span count depends on K alone."""
    return FP32_TILE._replace(split_k=max(1, min(triton.cdiv(k, FP32_SPAN), MAX_FP32_SPANS)))  # K = 0: one span


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


def gemm_triton(a, w, *, out_dtype, bias):
    """bf16 / fp16 / fp32 operands (both of one dtype, or a bf16 / fp16 ``a`` against an fp32 ``w``) with a tile
    that no row count changes: the batch-invariant dense product."""
    out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device=a.device)
    tile = _fp32_tile(a.shape[1]) if w.dtype == torch.float32 else None
    return _launch_gemm(a.contiguous(), w.contiguous(), out, None, None, bias, invariant=True, tile=tile)


def fp32_few_rows_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    if not (answer := triton_dense_supports(a, w, out_dtype=out_dtype, bias=bias)):
        return answer
    if w.dtype != torch.float32:
        return Decline(f"w is {w.dtype}, not float32")
    if not 2 <= a.shape[0] <= FEW_ROWS_FP32_MAX_M:
        return Decline(f"{a.shape[0]} rows, not 2 to {FEW_ROWS_FP32_MAX_M}")
    if _fp32_tile(w.shape[1]).split_k > 1:
        return Decline(f"K = {w.shape[1]} > {FP32_SPAN}: more than one span")
    return True


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


# --- grouped GEMM -------------------------------------------------------------------------------------------------


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
# The swapped walk reads each weight tile once per 16 rows of A: decode's rows per expert. Beyond this many (a prefill
# chunk through a grouped projection such as DeepSeek-V4's ``wo_a``) the 64-row tiles serve; both give a row the same
# bits, so the choice by row count keeps batch invariance.
MASKED_SWAPPED_MAX_M = 1024
MASKED_PROGRAMS_PER_SM = 4


# The kernels ``grouped_gemm`` chooses between, in the order tried (each a registered implementation: ``plugin.py``):
# outside batch-invariant mode, FP8 in the contiguous layout at a long prefill chunk's rows per expert takes the Gluon
# kernel (``gemm_gluon_grouped``) while ``GROUPED_GLUON`` is on (it gave the Triton kernel's bits in every case
# measured; it is not declared batch-invariant yet); FP8 in the masked layout swaps its operands up to
# ``MASKED_SWAPPED_MAX_M`` rows per expert; outside batch-invariant mode the dense masked layout of decode takes
# ``GROUPED_DECODE_TILE`` below ``DECODE_TILE_MAX_M`` rows per expert; ``_grouped_gemm_kernel`` with ``GROUPED_TILE``
# serves every supported call.
GROUPED_KERNELS = ("gluon-ws", "triton-masked-swapped", "triton-decode", "triton")
GROUPED_GLUON = True
# Masked bf16 operands strided by rows or experts (absorbed MLA's per-head products) read in place by 3-D TMA copies
# at the larger tiles, instead of copied to a contiguous operand first.
STRIDED_A_TMA = True


def grouped_kernel(a, w, *, masked_m, invariant: bool, expert_offsets=None, out_dtype=torch.bfloat16) -> str:
    """The first of ``GROUPED_KERNELS`` that serves a supported call in the given mode."""
    masked = masked_m is not None
    a_data = a.data if isinstance(a, QTensor) else a
    if not invariant and grouped_gluon_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m,
                                                out_dtype=out_dtype):  # fmt: skip
        return "gluon-ws"
    if isinstance(w, QTensor) and masked and a_data.shape[1] <= MASKED_SWAPPED_MAX_M:
        return "triton-masked-swapped"
    if masked and a_data.shape[1] <= DECODE_TILE_MAX_M and not invariant:
        return "triton-decode"
    return "triton"


def grouped_gemm(a, w, *, expert_offsets, masked_m, out_dtype, out=None, kernel: str | None = None):
    """``ops.grouped_gemm`` by ``kernel`` (one of ``GROUPED_KERNELS``; None: ``grouped_kernel``'s choice in the
    current mode)."""
    if kernel is None:
        kernel = grouped_kernel(a, w, masked_m=masked_m, invariant=batch_invariant_enabled(),
                                expert_offsets=expert_offsets, out_dtype=out_dtype)  # fmt: skip
    if kernel == "gluon-ws":
        from . import gemm_gluon_grouped

        return gemm_gluon_grouped.grouped_gemm(a, w, expert_offsets=expert_offsets, masked_m=masked_m,
                                               out_dtype=out_dtype)  # fmt: skip
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
    if out is None:
        out = torch.empty(*a_data.shape[:-1], n, dtype=out_dtype, device=a_data.device)
    if rows == 0 or n == 0:
        return out
    # a masked bf16 view whose experts or rows are strided (its K contiguous; absorbed MLA's per-head products) is
    # read in place rather than copied first: at decode rows by pointer loads, at larger tiles by 3-D TMA copies
    strided = masked and not fp8 and a_data.stride(-1) == 1 and not a_data.is_contiguous()
    in_place = kernel == "triton-decode" and strided
    a3d = kernel == "triton" and strided and STRIDED_A_TMA and tma_ready(a_data, dims=3)
    a2 = a_data if in_place or a3d else a_data.reshape(rows, k).contiguous()
    stride_am, stride_ae = (a2.stride(1), a2.stride(0)) if in_place else (a2.stride(0), a2.stride(0) * a_data.shape[1])
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
    tma = not in_place and (a3d or tma_ready(a2)) and tma_ready(b)
    if masked:
        grid_m, offsets = experts * triton.cdiv(a_data.shape[1], block_m), dummy
    else:  # at most one partial tile per expert
        grid_m, offsets = triton.cdiv(rows, block_m) + experts, expert_offsets
    _grouped_gemm_kernel[(grid_m * triton.cdiv(n, block_n),)](
        TensorDescriptor.from_tensor(a2, [1, block_m, block_k] if a3d else [block_m, block_k]) if tma else a2,
        TensorDescriptor.from_tensor(b, [block_n, block_k]) if tma else b,
        out,
        a_scale,
        b_scale,
        offsets,
        masked_m if masked else dummy,
        experts,
        n,
        k,
        a_data.shape[1] if masked else 0,
        grid_m,
        stride_am,
        stride_ae if masked else 0,
        b.stride(0),
        out.stride(-2),
        out.stride(0) if masked else 0,
        MASKED=masked,
        FP8=fp8,
        TMA=tma,
        A3D=a3d and tma,
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
    """``_grouped_masked_swapped_kernel`` on A ``[E * max_m, K]`` FP8, B ``[E * N, K]`` FP8 into ``out``
    ``[E, max_m, N]`` (any strides but the last)."""
    tile = MASKED_SWAPPED_TILE
    k = a2.shape[1]
    tma = tma_ready(a2, b)
    pairs = experts * triton.cdiv(max_m, tile.block_m) * triton.cdiv(n, tile.block_n)  # at most
    _grouped_masked_swapped_kernel[(min(pairs, MASKED_PROGRAMS_PER_SM * num_sms()),)](
        TensorDescriptor.from_tensor(a2, [tile.block_m, FP8_BLOCK]) if tma else a2,
        TensorDescriptor.from_tensor(b, [tile.block_n, FP8_BLOCK]) if tma else b,
        out,
        a_scale,
        b_scale,
        masked_m,
        experts,
        n,
        k,
        max_m,
        a2.stride(0),
        b.stride(0),
        out.stride(1),
        out.stride(0),
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


def grouped_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    if isinstance(w, FP4Tensor):
        return Decline("w is an FP4Tensor")
    a_data = a.data if isinstance(a, QTensor) else a
    if not isinstance(w, QTensor) and a_data.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"a is {a_data.dtype} against a dense w, expected bfloat16 or float16")
    return placed(a=a, w=w, expert_offsets=expert_offsets, masked_m=masked_m)


def grouped_gluon_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """``gemm_gluon_grouped.supports``, with a Triton that has Gluon's Hopper language, while ``GROUPED_GLUON`` is
    on."""
    try:
        from . import gemm_gluon_grouped
    except ImportError:
        return Decline("this Triton has no Gluon language for Hopper")
    answer = gemm_gluon_grouped.supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)
    return Decline("gemm.GROUPED_GLUON is off") if answer and not GROUPED_GLUON else answer


def grouped_masked_swapped_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """``grouped_supports`` for an FP8 weight in the masked layout, up to ``MASKED_SWAPPED_MAX_M`` rows per
    expert."""
    if not isinstance(w, QTensor):
        return Decline("w is not an FP8 QTensor")
    if masked_m is None:
        return Decline("the contiguous layout (expert_offsets), not the masked one")
    if a.shape[1] > MASKED_SWAPPED_MAX_M:
        return Decline(f"a has {a.shape[1]} rows per expert > {MASKED_SWAPPED_MAX_M}")
    return grouped_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)


def grouped_decode_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """``grouped_supports`` for a dense weight in the masked layout at up to ``DECODE_TILE_MAX_M`` rows per expert."""
    if isinstance(w, (QTensor, FP4Tensor)):
        return Decline(f"w is an {'FP8 QTensor' if isinstance(w, QTensor) else 'FP4Tensor'}")
    if masked_m is None:
        return Decline("the contiguous layout (expert_offsets), not the masked one")
    if a.shape[1] > DECODE_TILE_MAX_M:
        return Decline(f"a has {a.shape[1]} rows per expert > {DECODE_TILE_MAX_M}")
    return grouped_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)


# --- grouped GEMM with FP4 weights --------------------------------------------------------------------------------


# SM90 has no tensor-core instruction that takes e2m1. ``_grouped_gemm_fp4_kernel`` hands a bf16 activation, the packed
# codes and their ue8m0 scales to ``tl.dot_scaled``, which Triton lowers on SM90 to an in-register upcast of the codes
# (byte permutes) times the scale, exact in bf16 (conformance draws scales near a checkpoint's, not at the ends of
# ue8m0's range), ahead of wgmma products. At V4-Flash's expert shapes (H100) that is
# 1.6-1.9x the speed of decoding each 32-value group by bit arithmetic and scaling the group's product, 1.1-1.25 TB/s
# of codes at 1.5-6 rows per expert. That hand decode serves fp32 activations, and SM100 while ``tcgen05-fp4`` is off
# (there ``tl.dot_scaled`` lowers to tcgen05 products, which have not run on a GPU here). No split over K.
# ``triton-fp4`` (64-row tiles) serves both modes; in the default mode ``triton-fp4-few`` takes the masked layout and
# calls of at most FP4_FEW_ROWS rows per expert on average with 16 x 64 tiles of two warps, 1.5x the 64-row tile's
# speed there. Its products need not round as the 64-row tile's do, so batch-invariant mode keeps the one tile.
FP4_TILE = Tile(64, 128, 4, 3)
FP4_TILE_FEW = Tile(16, 64, 2, 3)
FP4_FEW_ROWS = 16


def grouped_gemm_fp4(a, w, *, expert_offsets, masked_m, out_dtype, out=None, tile=FP4_TILE, scaled=None):
    """``ops.grouped_gemm`` of a bf16 or fp32 activation against an ``FP4Tensor`` weight, by
    ``_grouped_gemm_fp4_kernel`` with ``tile``; ``scaled``: its ``tl.dot_scaled`` path, by default for bf16
    activations on devices without the ``fp4`` capability (SM90, and the interpreter)."""
    del out  # a new result: the op copies it into `out`
    if scaled is None:
        scaled = a.dtype == torch.bfloat16 and "fp4" not in _capabilities()
    experts, n, k = w.shape
    masked = masked_m is not None
    rows = a.shape[0] * a.shape[1] if masked else a.shape[0]
    out = torch.empty(*a.shape[:-1], n, dtype=out_dtype, device=a.device)
    if rows == 0 or n == 0:
        return out
    a2 = a.reshape(rows, k).contiguous()
    packed = w.data.contiguous().view(torch.uint8).view(experts * n, k // 2)
    scales = w.scale.contiguous().view(torch.uint8).view(experts * n, k // 32)
    dummy = out  # stands in for the pointer argument a layout does not read
    if masked:
        grid_m = experts * triton.cdiv(a.shape[1], tile.block_m)
    else:  # at most one partial tile per expert
        grid_m = triton.cdiv(rows, tile.block_m) + experts
    _grouped_gemm_fp4_kernel[(grid_m * triton.cdiv(n, tile.block_n),)](
        a2,
        packed,
        scales,
        out.view(rows, n),
        expert_offsets.contiguous() if not masked else dummy,
        masked_m.contiguous() if masked else dummy,
        experts,
        n,
        k,
        a.shape[1] if masked else 0,
        grid_m,
        a2.stride(0),
        n,
        MASKED=masked,
        FP32_DOT=INTERPRET,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_E=triton.next_power_of_2(experts),
        GROUP_M=GROUPED_GROUP_M,
        SCALED=scaled,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=PDL,
    )
    return out


def grouped_fp4_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """An ``FP4Tensor`` weight against a bf16 or fp32 activation (fp16 could not hold every weight value exactly)."""
    if not isinstance(w, FP4Tensor):
        return Decline("w is not an FP4Tensor")
    if a.dtype not in (torch.bfloat16, torch.float32):
        return Decline(f"a is {a.dtype}, expected bfloat16 or float32")
    return placed(a=a, w=w.data, expert_offsets=expert_offsets, masked_m=masked_m)


def grouped_fp4_few_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """``grouped_fp4_supports``, for decode: the masked layout (its programs past an expert's rows return at once),
    or at most ``FP4_FEW_ROWS`` rows per expert on average."""
    ok = grouped_fp4_supports(a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)
    if ok is not True or masked_m is not None:
        return ok
    per_expert = a.shape[0] / w.shape[0]
    if per_expert > FP4_FEW_ROWS:
        return Decline(f"{per_expert:g} rows per expert > {FP4_FEW_ROWS}")
    return True


def grouped_fp4_native(a, w, *, expert_offsets, masked_m, out_dtype, out=None):
    """``grouped_gemm_fp4`` through ``tl.dot_scaled`` (tcgen05 products on SM100), 128 x 128 tiles."""
    return grouped_gemm_fp4(
        a, w, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype, tile=FP4_TILE_SM100, scaled=True
    )


# The SM100 path: ``tl.dot_scaled`` of the bf16 activation and the packed e2m1 weight with its ue8m0 scales, which
# Triton lowers to tcgen05 products of the weight upcast to bf16, exactly (``tests/test_fp4_kernels.py`` compiles
# it for SM100 in CI). tcgen05's block-scaled kinds (mxf8f6f4, mxf4) would take the codes as they are but need the
# activation quantised to MXFP8 too, a looser contract than the op's. It has not run on an SM100 GPU: it is chosen
# only while this is on.
FP4_TCGEN05 = False
FP4_TILE_SM100 = Tile(128, 128, 4, 3)


def grouped_fp4_native_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """An ``FP4Tensor`` weight and a bf16 activation on a device with the ``fp4`` capability (compute capability
    10.x), while ``FP4_TCGEN05`` is on."""
    if not isinstance(w, FP4Tensor):
        return Decline("w is not an FP4Tensor")
    if "fp4" not in _capabilities():
        return Decline("no fp4 capability (tcgen05 needs compute capability 10.x)")
    if not FP4_TCGEN05:
        return Decline("FP4_TCGEN05 is off: the tcgen05 FP4 kernel has not yet run on an SM100 GPU")
    if a.dtype != torch.bfloat16:
        return Decline(f"a is {a.dtype}, expected bfloat16")
    return placed(a=a, w=w.data, expert_offsets=expert_offsets, masked_m=masked_m)


@functools.cache
def _capabilities() -> frozenset[str]:
    return probe.capabilities()
