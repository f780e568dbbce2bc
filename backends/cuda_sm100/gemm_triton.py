"""The Triton kernels of ``quantize_fp8``, ``gemm`` and ``grouped_gemm``: ``gemm.py`` chooses their launch (tiles,
splits over K) and launches them; its docstring says why an element's bits do not depend on the tile."""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import cast, dot, pdl_wait, pow2_ceil, to_e4m3


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
        else:
            if a.dtype != b.dtype:  # a bf16 / fp16 activation against an fp32 weight: its values, exactly, in fp32
                a = a.to(tl.float32)
            if TF32X3:
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


@triton.jit
def _expert_rows(pid_m, offsets_ptr, masked_ptr, E, max_m, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr):  # fmt: skip
    """(expert, first row, end of the expert's rows) of M tile ``pid_m`` of a grouped layout; the tile has no rows
    where first row >= end. Contiguous: M tile t is the t-th over all experts (each program counts the experts' tiles
    from ``offsets``), at most one partial tile per expert. Masked: M tile e * tiles_per_expert + t."""
    if MASKED:
        tiles = tl.cdiv(max_m, BLOCK_M)
        e = pid_m // tiles
        rows_in_expert = tl.load(masked_ptr + e)
        first = (pid_m % tiles) * BLOCK_M
        row0 = e.to(tl.int64) * max_m + first
        row_end = e.to(tl.int64) * max_m + rows_in_expert
    else:
        experts = tl.arange(0, BLOCK_E)
        starts = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
        stops = tl.load(offsets_ptr + 1 + experts, mask=experts < E, other=0)
        tiles = tl.cdiv(stops - starts, BLOCK_M)  # M tiles of each expert (0 past E)
        ends = tl.where(experts < E, tl.cumsum(tiles, axis=0), 2147483647)
        e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        tile_start = tl.sum(tl.where(experts < e, tiles, 0), axis=0)
        last = tl.minimum(e, E - 1)  # a tile past every expert's (e == E) reads in bounds and has no rows
        row0 = (tl.load(offsets_ptr + last) + (pid_m - tile_start) * BLOCK_M).to(tl.int64)
        row_end = tl.where(e < E, tl.load(offsets_ptr + last + 1).to(tl.int64), row0)
    return e, row0, row_end


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
    stride_ae,
    stride_bn,
    stride_cm,
    stride_ce,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    A3D: tl.constexpr,
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
    weight streams past once (``tile_coords`` over ``GRID_M`` M tiles). Its prologue is ``_expert_rows``' with early
    exits, kept inline until a GPU run shows the shared form compiles to the same speed. Masked, without TMA, expert
    e's rows of A start ``stride_ae`` elements after expert e - 1's (``max_m * stride_am`` where A is contiguous; a
    transposed view, e.g. heads of ``[tokens, heads, K]``, is read in place). C's rows are ``stride_cm`` apart;
    masked, expert e's rows start ``stride_ce`` elements after expert e - 1's (``max_m * stride_cm`` where C is
    contiguous), so C may be such a view too. ``A3D`` (masked, TMA): A is read by 3-D copies of an ``[E, max_m,
    K]`` view with any row and expert strides (its K contiguous), in place."""
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
    if MASKED and not TMA:  # A's rows from expert e's own start (the scales' rows stay offs_m)
        a_src = a_src + e.to(tl.int64) * stride_ae
        a_first = first
        a_offs = first + tl.arange(0, BLOCK_M)
    else:
        a_first = row0
        a_offs = offs_m
    if MASKED:
        c_rows = e.to(tl.int64) * stride_ce + (first + tl.arange(0, BLOCK_M)).to(tl.int64) * stride_cm
    else:
        c_rows = offs_m * stride_cm
    # B is read as [E * N, K]: expert e's rows start at e * N (a tile past N reads the next expert's rows, which
    # only feed columns that are never stored)
    b_first = e.to(tl.int64) * N + pid_n * BLOCK_N
    b_block = e.to(tl.int64) * tl.cdiv(N, BLOCK_K) + pid_n * BLOCK_N // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A3D:
            a = a_src.load([e.to(tl.int32), first.to(tl.int32), k0]).reshape(BLOCK_M, BLOCK_K)
        else:
            a = _load_tile(a_src, a_first, a_offs, mask_m, stride_am, k0, K, BLOCK_K, TMA)
        b = _load_tile(b_src, b_first, b_first + tl.arange(0, BLOCK_N), mask_n, stride_bn, k0, K, BLOCK_K, TMA)
        if FP8:
            part = dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_DOT)
            acc = acc + part * _block_scales(as_ptr, bs_ptr, offs_m, mask_m, b_block, k0, K, BLOCK_K)[:, None]
        else:
            acc = dot(a, tl.trans(b), acc, FP32_DOT)
    tl.store(
        c_ptr + c_rows[:, None] + offs_n[None, :],
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
    stride_ce,
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
        c_rows = e.to(tl.int64) * stride_ce + (offs_m - first) * stride_cm  # C's rows as in _grouped_gemm_kernel
        tl.store(
            c_ptr + c_rows[None, :] + offs_n[:, None],
            cast(acc, c_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_m[None, :],
        )


@triton.jit
def _e2m1(code):
    """bf16 values of int32 e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0), exactly, from bits: the
    magnitudes 1, 1.5, 2, 3, 4, 6 of codes 2..7 are bf16 ``0x3F00 + (code << 6)``; code 1 is 0.5 (``0x3F00``) and
    code 0 is zero."""
    magnitude = code & 7
    bits = tl.where(magnitude >= 2, (magnitude << 6) + 0x3F00, magnitude * 0x3F00) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _ue8m0(scale_byte):
    """fp32 ``2^(scale_byte - 127)`` of int32 ue8m0 bytes: byte 0 is 2^-127 (an fp32 subnormal), 255 is NaN."""
    scale = tl.where(scale_byte == 0, 0x400000, scale_byte << 23).to(tl.float32, bitcast=True)
    return tl.where(scale_byte == 255, float("nan"), scale)


@triton.jit(do_not_specialize=["max_m", "GRID_M"])
def _grouped_gemm_fp4_kernel(
    a_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    offsets_ptr,
    masked_ptr,
    E,
    N,
    K,
    max_m,
    GRID_M,
    stride_am,
    stride_cm,
    MASKED: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALED: tl.constexpr = False,
    BLOCK_K: tl.constexpr = 128,
):
    """A float activation against FP4 expert weights: B is the packed bytes ``[E * N, K / 2]`` (low nibble the even
    element) and their ue8m0 scale bytes ``[E * N, K / 32]`` (K a multiple of 32). Each K step is one scale group of
    32 elements: the group's 16 bytes of each of ``BLOCK_N`` rows (loaded along the row,
    coalesced, each byte once), their low and high nibbles decoded to exact bf16 values (``_e2m1``), the product
    ``A_even @ W_low^T + A_odd @ W_high^T`` over the group (A's even and odd columns loaded apart), then scaled by
    each row's group scale into the fp32 accumulator (fp32 activations). With ``SCALED`` (bf16 activations), each
    ``BLOCK_K`` step hands the packed codes and their scales to ``tl.dot_scaled`` instead, which Triton lowers to
    products of the weight upcast exactly: on SM90 by permutes in registers ahead of wgmma / mma.sync, on SM100 to
    tcgen05.
    M tiles as ``_expert_rows`` numbers them."""
    pdl_wait()
    pid_m, pid_n = tile_coords(tl.program_id(0), GRID_M * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    e, row0, row_end = _expert_rows(pid_m, offsets_ptr, masked_ptr, E, max_m, MASKED, BLOCK_M, BLOCK_E)
    if row0 >= row_end:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < row_end, offs_n < N
    w_rows = e.to(tl.int64) * N + offs_n  # expert e's rows of B and of its scales
    half_k, groups = K // 2, K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_rows = a_ptr + offs_m[:, None] * stride_am
    b_rows = b_ptr + w_rows[:, None] * half_k
    if SCALED:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            offs_h = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
            mask_h, mask_g = mask_n[:, None] & (offs_h < half_k)[None, :], mask_n[:, None] & (offs_g < groups)[None, :]
            packed = tl.load(b_rows + offs_h[None, :], mask=mask_h, other=0)
            scale = tl.load(bs_ptr + w_rows[:, None] * groups + offs_g[None, :], mask=mask_g, other=127)
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc)
    else:
        for group in range(0, groups):
            offs_h = group * 16 + tl.arange(0, 16)  # the group's bytes: elements 2h (low nibble), 2h + 1 (high)
            a_even = tl.load(a_rows + 2 * offs_h[None, :], mask=mask_m[:, None], other=0.0)
            a_odd = tl.load(a_rows + 2 * offs_h[None, :] + 1, mask=mask_m[:, None], other=0.0)
            packed = tl.load(b_rows + offs_h[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
            scale = tl.load(bs_ptr + w_rows * groups + group, mask=mask_n, other=127).to(tl.int32)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part = dot(a_even, tl.trans(_e2m1(packed).to(a_even.dtype)), part, FP32_DOT)
            part = dot(a_odd, tl.trans(_e2m1(packed >> 4).to(a_even.dtype)), part, FP32_DOT)
            acc += part * _ue8m0(scale)[None, :]
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        cast(acc, c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )
