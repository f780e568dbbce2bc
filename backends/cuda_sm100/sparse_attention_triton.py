"""The Triton kernels of DeepSeek Sparse Attention: ``write_index_cache``'s, ``indexer_topk``'s (the token rows, the
scores as sort keys, the chosen slots) and ``sparse_mla``'s (the gathered split kernel): ``sparse_attention.py``
chooses their launch and launches them (its docstring describes the algorithms)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton import INTERPRET, cast, dot, pdl_wait, pow2_ceil, to_e4m3
from .attention_triton import _dequantize

_INTERPRET = tl.constexpr(INTERPRET)


# --- write_index_cache ------------------------------------------------------------------------------------------------


@triton.jit
def _write_index_kernel(
    k_ptr,
    slots_ptr,
    cache_ptr,
    cache_f32_ptr,
    stride_t,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUPS: tl.constexpr,
    WIDTH: tl.constexpr,
    FP8: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """Token ``program_id(0)``'s key into its slot (none for slot ``-1``). FP8: per 128 values, ``scale =
    2^ceil(log2(max(amax, 1e-4) / 448))`` (``pow2_ceil``, exact), then ``x / scale`` (exact) rounded to e4m3."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    base = slot * WIDTH
    if FP8:
        g = tl.arange(0, GROUPS)
        cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        gmask = g < D // 128
        x = tl.load(k_ptr + t * stride_t + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
        scale = pow2_ceil(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0)
        q = to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0), PREROUND).to(tl.uint8, bitcast=True)
        tl.store(cache_ptr + base + cols, q, mask=gmask[:, None])
        tl.store(cache_f32_ptr + (base + D) // 4 + g, scale, mask=gmask)
    else:
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(k_ptr + t * stride_t + cols, mask=mask, other=0.0)
        tl.store(cache_ptr + base + cols, cast(x, tl.bfloat16), mask=mask)


# --- indexer_topk -----------------------------------------------------------------------------------------------------


@triton.jit
def _token_rows_kernel(cu_ptr, seq_lens_ptr, seq_ptr, limit_ptr, BLOCK: tl.constexpr):
    """For each query token of sequence ``program_id(0)``: its sequence, and how many positions it sees
    (``seq_lens[b] - L_b + i + 1`` for query ``i`` of ``L_b``)."""
    pdl_wait()
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b)
    stop = tl.load(cu_ptr + b + 1)
    first = tl.load(seq_lens_ptr + b) - (stop - start) + 1
    for t0 in range(start, stop, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        mask = t < stop
        tl.store(seq_ptr + t, tl.full((BLOCK,), 0, tl.int32) + b, mask=mask)
        tl.store(limit_ptr + t, first + (t - start), mask=mask)


@triton.jit
def _opaque(x):
    """``x`` (int64), of which the compiler then knows nothing: no divisibility, no contiguity.

    A slot computed as ``page * PAGE + pos % PAGE`` can be credited by Triton's alignment analysis with the
    divisibility of the first position of a contiguous run (mla_decode met it: 16-byte loads on 4-byte aligned
    fp8_ds_mla records, benchmarks/NOTES.md). Records whose width is not a multiple of 16 bytes, such as the 132-byte
    fp8_ds_index key, take their row offsets through this move, and get loads no wider than the record's own
    alignment whatever the Triton version (3.9's analysis already gives 4-byte copies there, with or without it).
    The interpreter has no such analysis (and no inline assembly)."""
    if _INTERPRET:
        return x
    return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=True, pack=1)


@triton.jit
def _load_keys(cache_ptr, cache_f32_ptr, slot, valid, D: tl.constexpr, WIDTH: tl.constexpr, FP8: tl.constexpr):
    """The indexer keys [BLOCK_N, D] at cache rows ``slot``, zeros where not ``valid``: bf16 as cached, or e4m3 times
    its power-of-two scale (exact in bf16)."""
    d = tl.arange(0, D)
    if FP8 and WIDTH % 16 != 0:
        slot = _opaque(slot)
    k = tl.load(cache_ptr + (slot * WIDTH)[:, None] + d[None, :], mask=valid[:, None], other=0)
    if FP8:
        G: tl.constexpr = D // 128
        scale = tl.load(
            cache_f32_ptr + ((slot * WIDTH + D) // 4)[:, None] + tl.arange(0, G)[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        k = _dequantize(k, scale, G)
    return k


@triton.jit
def _sort_keys(score, pos, visible):
    """int64 keys ordering (score descending, position ascending) as signed integers: the fp32 bits made
    order-preserving (negatives' magnitude bits flipped; -0 read as +0) in the high word, ``2^31 - 1 - pos`` in the
    low one. Positions not ``visible`` (and a score of -inf, as the reference reads it) get -2^63, below every other
    key."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) + (0x7FFFFFFF - pos).to(tl.int64)
    nothing = tl.full(pos.shape, -2147483648, tl.int32).to(tl.int64) << 32
    return tl.where(visible & (score > float("-inf")), key, nothing)


@triton.jit
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    cache_f32_ptr,
    table_ptr,
    seq_ptr,
    limit_ptr,
    keys_ptr,
    row0,
    H,
    reach,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_table,
    D: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPAN: tl.constexpr,
    USE_DOT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """The sort keys (``_sort_keys``) of positions ``SPAN * program_id(1) + [0, SPAN)`` for query token ``row0 +
    program_id(0)``, into row ``program_id(0)`` of ``keys [rows, reach]``. ``USE_DOT``: the heads' dot products as
    one tl.dot (bf16 q and keys multiply exactly, fp32 accumulation); else one head at a time, in head order."""
    pdl_wait()
    r = tl.program_id(0)
    t = (row0 + r).to(tl.int64)
    start = tl.program_id(1) * SPAN
    b = tl.load(seq_ptr + t)
    limit = tl.load(limit_ptr + t)  # positions < limit are visible
    table_row = table_ptr + b.to(tl.int64) * stride_table
    key_row = keys_ptr + r.to(tl.int64) * reach
    d = tl.arange(0, D)
    tokens = tl.arange(0, BLOCK_N)
    if USE_DOT:
        heads = tl.arange(0, BLOCK_H)
        hmask = heads < H
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
        if q.dtype != tl.bfloat16:  # fp32 and fp16 queries: fp32 products (bf16 keys are exact in fp32)
            q = q.to(tl.float32)
        w = tl.load(w_ptr + t * stride_wt + heads, mask=hmask, other=0.0)
    hi = tl.minimum(start + SPAN, limit)
    for n0 in range(start, hi, BLOCK_N):
        pos = n0 + tokens
        valid = pos < limit
        page = tl.load(table_row + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        k = _load_keys(cache_ptr, cache_f32_ptr, slot, valid, D, WIDTH, FP8)
        if USE_DOT:
            s = dot(q, tl.trans(k.to(q.dtype)), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), FP32_DOT)
            score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        else:
            kf = k.to(tl.float32)
            score = tl.zeros((BLOCK_N,), tl.float32)
            for h in range(H):
                qh = tl.load(q_ptr + t * stride_qt + h * stride_qh + d).to(tl.float32)
                wh = tl.load(w_ptr + t * stride_wt + h)
                score += wh * tl.maximum(tl.sum(kf * qh[None, :], axis=1), 0.0)
        tl.store(key_row + pos, _sort_keys(score, pos, valid), mask=pos < reach)
    # The rest of the span (up to the row's end) is past the query's limit.
    seen = tl.maximum(hi - start, 0)
    nothing = tl.full((BLOCK_N,), -2147483648, tl.int32).to(tl.int64) << 32  # _sort_keys's key of the unseen
    for n0 in range(start + (seen + BLOCK_N - 1) // BLOCK_N * BLOCK_N, tl.minimum(start + SPAN, reach), BLOCK_N):
        pos = n0 + tokens
        tl.store(key_row + pos, nothing, mask=pos < reach)


@triton.jit
def _topk_slots_kernel(
    chosen_ptr,
    table_ptr,
    seq_ptr,
    out_ptr,
    row0,
    rows,
    k,
    topk,
    stride_table,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``ROWS * program_id(0) + [0, ROWS)`` of the ``k`` chosen keys (any order) to cache slots in ascending
    position order, then ``-1``: ``topk`` int32 entries of output rows ``row0 + ...``."""
    pdl_wait()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < rows
    t = (row0 + r).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    key = tl.load(chosen_ptr + r.to(tl.int64)[:, None] * k + cols[None, :], mask=rmask[:, None] & (cols < k)[None, :])
    visible = rmask[:, None] & (cols < k)[None, :] & ((key >> 32) != -2147483648)
    pos = tl.where(visible, 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32), 0x7FFFFFFF)
    pos = tl.sort(pos)  # ascending along each row; what the query does not see (2^31 - 1) last
    visible = pos != 0x7FFFFFFF
    b = tl.load(seq_ptr + t, mask=rmask, other=0)
    page = tl.load(table_ptr + b.to(tl.int64)[:, None] * stride_table + pos // PAGE, mask=visible, other=0)
    slot = tl.where(visible, page * PAGE + pos % PAGE, -1)
    out_rows = out_ptr + t[:, None] * topk
    tl.store(out_rows + cols[None, :], slot, mask=rmask[:, None] & (cols < topk)[None, :])
    for c0 in range(BLOCK_K, topk, BLOCK_K):
        c = c0 + cols
        tl.store(
            out_rows + c[None, :], tl.full((ROWS, BLOCK_K), -1, tl.int32), mask=rmask[:, None] & (c < topk)[None, :]
        )


# --- sparse_mla -------------------------------------------------------------------------------------------------------


@triton.jit
def _gather_rows(
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    slot,
    valid,
    L: tl.constexpr,
    LH: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WIDTH: tl.constexpr,
    ROPE_AT: tl.constexpr,
    FP8: tl.constexpr,
):
    """The latent halves [BLOCK_N, LH] (bf16; columns ``[0, LH)`` and ``[LH, 2 LH)``, zero past ``L``) and the rope
    part [BLOCK_N, BLOCK_R] of the cache rows ``slot``; zeros where not ``valid``."""
    cols = tl.arange(0, LH)
    m0 = valid[:, None] & (cols < L)[None, :]
    m1 = valid[:, None] & (LH + cols < L)[None, :]
    base = slot * WIDTH  # elements of the cache's dtype (bytes for fp8_ds_mla)
    other = 0 if FP8 else 0.0
    c0 = tl.load(cache_ptr + base[:, None] + cols[None, :], mask=m0, other=other)
    c1 = tl.load(cache_ptr + base[:, None] + LH + cols[None, :], mask=m1, other=other)
    r = tl.arange(0, BLOCK_R)
    rope = (base // 2 if FP8 else base) + ROPE_AT
    k_rope = tl.load(cache_bf16_ptr + rope[:, None] + r[None, :], mask=valid[:, None] & (r < R)[None, :], other=0.0)
    if FP8:  # each e4m3 byte times its 128-group's scale; a half narrower than a group lies in one group
        GH: tl.constexpr = LH // 128 if LH >= 128 else 1
        g0 = tl.arange(0, GH)[None, :]
        g1 = g0 + LH // 128
        scales = ((base + L) // 4)[:, None]
        s0 = tl.load(cache_f32_ptr + scales + g0, mask=valid[:, None] & (g0 * 128 < L), other=0.0)
        s1 = tl.load(cache_f32_ptr + scales + g1, mask=valid[:, None] & (g1 * 128 < L), other=0.0)
        c0 = _dequantize(c0, s0, GH)
        c1 = _dequantize(c1, s1, GH)
    return c0, c1, k_rope


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    idx_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    H,
    topk,
    n_splits,
    stride_qt,
    stride_qh,
    stride_it,
    L: tl.constexpr,
    LH: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WIDTH: tl.constexpr,
    ROPE_AT: tl.constexpr,
    FP8: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LIST_CHUNK: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Heads ``BLOCK_H * program_id(1) + [0, BLOCK_H)`` of query token ``program_id(0)`` over index entries
    ``SPLIT * program_id(2) + [0, SPLIT)`` of its list: out [H, L] and lse (natural log) at row ``(t * H + head) *
    n_splits + split`` of ``part_out`` / ``part_lse`` (the op's out and lse themselves when ``n_splits == 1``)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < H
    idx_row = idx_ptr + t * stride_it
    # Where the span's listed slots end (indexer_topk pads with -1 at the end: those steps are skipped). -1 entries
    # before it are masked one by one.
    start = split * SPLIT
    stop = tl.minimum(start + SPLIT, topk)
    end = start
    for i0 in range(start, stop, LIST_CHUNK):
        i = i0 + tl.arange(0, LIST_CHUNK)
        listed = tl.load(idx_row + i, mask=i < stop, other=-1) >= 0
        end = tl.maximum(end, tl.max(tl.where(listed, i + 1, 0), axis=0))

    cols = tl.arange(0, LH)
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_row + cols[None, :], mask=hmask[:, None] & (cols < L)[None, :], other=0.0)
    q1 = tl.load(q_row + LH + cols[None, :], mask=hmask[:, None] & (LH + cols < L)[None, :], other=0.0)
    r = tl.arange(0, BLOCK_R)
    q_rope = tl.load(q_row + L + r[None, :], mask=hmask[:, None] & (r < R)[None, :], other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, LH), tl.float32)
    acc1 = tl.zeros((BLOCK_H, LH), tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(idx_row + n, mask=n < end, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0).to(tl.int64)
        c0, c1, k_rope = _gather_rows(
            cache_ptr, cache_f32_ptr, cache_bf16_ptr, slot, valid, L, LH, R, BLOCK_R, WIDTH, ROPE_AT, FP8
        )
        qk = dot(q0, tl.trans(c0), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), FP32_DOT)
        qk = dot(q1, tl.trans(c1), qk, FP32_DOT)
        qk = dot(q_rope, tl.trans(k_rope), qk, FP32_DOT)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing listed so far: p = 0, acc stays 0
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = cast(p, c0.dtype)
        acc0 = dot(p, c0, acc0 * alpha[:, None], FP32_DOT)
        acc1 = dot(p, c1, acc1 * alpha[:, None], FP32_DOT)
        m_i = m_new
    empty = l_i == 0.0  # nothing listed: zeros and lse = -inf
    denom = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(denom)) / 1.4426950408889634)  # natural log
    denom = denom[:, None]
    part = (t * H + heads) * n_splits + split
    out_row = part_out_ptr + part[:, None] * L + cols[None, :]
    tl.store(out_row, cast(acc0 / denom, part_out_ptr.dtype.element_ty), mask=hmask[:, None] & (cols < L)[None, :])
    tl.store(
        out_row + LH, cast(acc1 / denom, part_out_ptr.dtype.element_ty), mask=hmask[:, None] & (LH + cols < L)[None, :]
    )
    tl.store(part_lse_ptr + part, lse, mask=hmask)
