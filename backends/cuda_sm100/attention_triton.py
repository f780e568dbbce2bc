"""The Triton kernels of ``mla_decode`` (the split-KV kernel, the merge of its spans by lse, the bf16 copy of an
fp8_ds_mla cache's rows), ``attention_varlen`` and ``write_kv_cache``: ``attention.py`` chooses their launch and
launches them (its docstring describes the algorithms). ``sparse_attention_triton.py`` reuses ``_dequantize``, and
``sparse_attention.py`` ``_mla_merge_kernel``."""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.kv_cache import FP8_GROUP

from ._triton import cast, dot, pdl_wait, pow2_ceil, to_e4m3

LOG2E = 1.4426950408889634


GROUP = tl.constexpr(FP8_GROUP)  # fp8_ds_mla latent columns per scale


@triton.jit
def _load_block(
    latent_src,
    rope_src,
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    first,
    slot,
    valid,
    WIDTH: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    ROPE_AT: tl.constexpr,
    GH: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
):
    """The two latent halves [BLOCK_N, L/2] (bf16) and the rope part [BLOCK_N, R] of the tokens in cache rows ``slot``.

    ``TMA``: the rows are ``first + [0, BLOCK_N)``, all valid, read by TMA copies through ``latent_src`` /
    ``rope_src``. Otherwise they are gathered by pointer, zeros where not ``valid`` (the cache past a sequence may
    hold anything, NaN included, and P x V must not see it). The rope part starts at column ``ROPE_AT`` of a record
    (bf16 units); an fp8_ds_mla record holds L e4m3 bytes, then L / 128 fp32 scales, then the rope part."""
    LH: tl.constexpr = L // 2
    cols = tl.arange(0, LH)
    base = slot * WIDTH  # elements of the cache's dtype (bytes for fp8_ds_mla)
    if TMA:
        row = first.to(tl.int32)
        c0 = latent_src.load([row, 0])
        c1 = latent_src.load([row, LH])
        k_rope = rope_src.load([row, ROPE_AT])
    else:
        other = 0 if FP8 else 0.0
        c0 = tl.load(cache_ptr + base[:, None] + cols[None, :], mask=valid[:, None], other=other)
        c1 = tl.load(cache_ptr + base[:, None] + LH + cols[None, :], mask=valid[:, None], other=other)
        rope = (base // 2 if FP8 else base) + ROPE_AT
        k_rope = tl.load(cache_bf16_ptr + rope[:, None] + tl.arange(0, R)[None, :], mask=valid[:, None], other=0.0)
    if FP8:  # each e4m3 byte times its 128-group's scale; a half narrower than a group (GH = 1) lies in one group
        scale_at = ((base + L) // 4)[:, None] + tl.arange(0, GH)[None, :]
        s0 = tl.load(cache_f32_ptr + scale_at, mask=valid[:, None], other=0.0)
        s1 = tl.load(cache_f32_ptr + scale_at + LH // GROUP, mask=valid[:, None], other=0.0)
        c0 = _dequantize(c0, s0, GH)
        c1 = _dequantize(c1, s1, GH)
    return c0, c1, k_rope


@triton.jit
def _dequantize(raw, scale, G: tl.constexpr):
    """e4m3 bytes [N, W] times ``scale`` [N, G] (G equal groups of columns), as bf16."""
    n: tl.constexpr = raw.shape[0]
    w: tl.constexpr = raw.shape[1]
    values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32).reshape(n, G, w // G)
    return cast((values * scale[:, :, None]).reshape(n, w), tl.bfloat16)


@triton.jit
def _mla_step(
    q0, q1, q_rope, c0, c1, k_rope, acc0, acc1, m_i, l_i, valid, qk_scale, MASK: tl.constexpr, FP32_DOT: tl.constexpr
):
    """One block of tokens folded into the running (acc, max, sum), the latent in two halves. ``MASK``: some tokens
    of the block are past the span."""
    qk = dot(q0, tl.trans(c0), tl.zeros((q0.shape[0], c0.shape[0]), tl.float32), FP32_DOT)
    qk = dot(q1, tl.trans(c1), qk, FP32_DOT)
    qk = dot(q_rope, tl.trans(k_rope), qk, FP32_DOT)
    if MASK:
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
    else:  # every score is visible: the scale goes into one FMA with the max
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = cast(p, c0.dtype)
    acc0 = dot(p, c0, acc0 * alpha[:, None], FP32_DOT)
    acc1 = dot(p, c1, acc1 * alpha[:, None], FP32_DOT)
    return acc0, acc1, m_new, l_i


@triton.jit
def _mla_split_kernel(
    q_ptr,
    latent_src,
    rope_src,
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    S_q,
    H,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_table,
    n_splits,
    span,
    L: tl.constexpr,
    R: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGE: tl.constexpr,
    ROPE_AT: tl.constexpr,
    GH: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DIRECT: tl.constexpr,
):
    pdl_wait()
    row = tl.program_id(0)  # b * S_q + s
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    b = row // S_q
    s = row % S_q
    limit = tl.load(seq_lens_ptr + b) - S_q + s + 1  # positions < limit are visible to this query
    start = split * span
    end = tl.minimum(start + span, limit)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    part = (row.to(tl.int64) * H + heads) * n_splits + split
    if start >= end:
        tl.store(part_lse_ptr + part, tl.full((BLOCK_H,), float("-inf"), tl.float32), mask=hmask)
        if DIRECT:  # no merge follows: the output's rows are zeros
            zeros = tl.zeros((BLOCK_H, L), part_out_ptr.dtype.element_ty)
            tl.store(part_out_ptr + part[:, None] * L + tl.arange(0, L)[None, :], zeros, mask=hmask[:, None])
        return

    LH: tl.constexpr = L // 2
    q_row = q_ptr + b.to(tl.int64) * stride_qb + s * stride_qs + heads[:, None] * stride_qh
    q0 = tl.load(q_row + tl.arange(0, LH)[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + LH + tl.arange(0, LH)[None, :], mask=hmask[:, None], other=0.0)
    q_rope = tl.load(q_row + L + tl.arange(0, R)[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, LH), tl.float32)
    acc1 = tl.zeros((BLOCK_H, LH), tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    table_row = table_ptr + b.to(tl.int64) * stride_table
    tokens = tl.arange(0, BLOCK_N)
    # Whole blocks inside one page (spans start on a block boundary): one table entry each and no masks.
    full = 0
    if PAGE % BLOCK_N == 0:
        full = (end - start) // BLOCK_N
    for i in range(full):
        n0 = start + i * BLOCK_N
        first = tl.load(table_row + n0 // PAGE).to(tl.int64) * PAGE + n0 % PAGE
        c0, c1, k_rope = _load_block(
            latent_src,
            rope_src,
            cache_ptr,
            cache_f32_ptr,
            cache_bf16_ptr,
            first,
            first + tokens,
            tokens < BLOCK_N,
            WIDTH,
            L,
            R,
            ROPE_AT,
            GH,
            FP8,
            TMA,
        )
        acc0, acc1, m_i, l_i = _mla_step(
            q0, q1, q_rope, c0, c1, k_rope, acc0, acc1, m_i, l_i, None, qk_scale, False, FP32_DOT
        )
    for n0 in range(start + full * BLOCK_N, end, BLOCK_N):  # the partial last block (every block if pages are short)
        pos = n0 + tokens
        valid = pos < end
        page = tl.load(table_row + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        c0, c1, k_rope = _load_block(
            latent_src,
            rope_src,
            cache_ptr,
            cache_f32_ptr,
            cache_bf16_ptr,
            slot,
            slot,
            valid,
            WIDTH,
            L,
            R,
            ROPE_AT,
            GH,
            FP8,
            False,
        )
        acc0, acc1, m_i, l_i = _mla_step(
            q0, q1, q_rope, c0, c1, k_rope, acc0, acc1, m_i, l_i, valid, qk_scale, True, FP32_DOT
        )
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634  # natural log
    out_row = part_out_ptr + part[:, None] * L + tl.arange(0, LH)[None, :]
    tl.store(out_row, cast(acc0 / l_i[:, None], part_out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(out_row + LH, cast(acc1 / l_i[:, None], part_out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=hmask)


@triton.jit
def _mla_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, n_splits, L: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr
):
    """Merges the splits of one (query row, head): out = sum_i w_i out_i, w_i = exp(lse_i - lse), summed in a fixed
    order (a given number of splits always adds up the same way)."""
    pdl_wait()
    rh = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    lse_all = tl.load(part_lse_ptr + rh * n_splits + splits, mask=splits < n_splits, other=float("-inf"))
    m = tl.max(lse_all, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw anything: zeros and lse = -inf
    total = tl.sum(tl.exp(lse_all - m_safe), axis=0)
    acc = tl.zeros((L,), tl.float32)
    for i0 in range(0, n_splits, CHUNK):  # CHUNK splits at a time; an empty split (w = 0) is never read
        i = i0 + tl.arange(0, CHUNK)
        w = tl.exp(tl.load(part_lse_ptr + rh * n_splits + i, mask=i < n_splits, other=float("-inf")) - m_safe)
        part = tl.load(
            part_out_ptr + (rh * n_splits + i)[:, None] * L + tl.arange(0, L)[None, :], mask=(w > 0)[:, None], other=0.0
        )
        acc += tl.sum(w[:, None] * part, axis=0)
    acc = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + rh * L + tl.arange(0, L), cast(acc, out_ptr.dtype.element_ty))
    tl.store(lse_ptr + rh, tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total)))


@triton.jit
def _bf16_copy_kernel(
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    table_ptr,
    seq_lens_ptr,
    copy_ptr,
    stride_table,
    reach,
    L: tl.constexpr,
    R: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGE: tl.constexpr,
    ROPE_AT: tl.constexpr,
    GH: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Tokens ``BLOCK_N * program_id(1) + [0, BLOCK_N)`` of sequence ``program_id(0)``, those below its length, from
    fp8_ds_mla records to bf16 rows of ``copy`` (latent, then rope), at row ``sequence * reach + position``."""
    pdl_wait()
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    length = tl.load(seq_lens_ptr + b)
    if n0 >= length:
        return
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < length
    page = tl.load(table_ptr + b.to(tl.int64) * stride_table + pos // PAGE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    c0, c1, k_rope = _load_block(
        None, None, cache_ptr, cache_f32_ptr, cache_bf16_ptr, slot, slot, valid, WIDTH, L, R, ROPE_AT, GH, True, False
    )
    LH: tl.constexpr = L // 2
    row = copy_ptr + (b.to(tl.int64) * reach + pos)[:, None] * (L + R)
    tl.store(row + tl.arange(0, LH)[None, :], c0, mask=valid[:, None])
    tl.store(row + LH + tl.arange(0, LH)[None, :], c1, mask=valid[:, None])
    tl.store(row + L + tl.arange(0, R)[None, :], k_rope, mask=valid[:, None])


@triton.jit
def _varlen_step(
    q,
    q_tail,
    acc,
    m_i,
    l_i,
    n0,
    offs_m,
    k_ptr,
    v_ptr,
    k_start,
    len_k,
    kv_h,
    shift,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DTAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """One block of keys folded into the running (acc, max, sum). ``MASK`` is false for blocks every query row of
    the tile sees in full (below the causal diagonal, inside the sequence): they skip the masking work."""
    d = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < len_k
    rows = (k_start + offs_n).to(tl.int64)
    k_rows = k_ptr + rows[:, None] * stride_kt + kv_h * stride_kh
    k = tl.load(k_rows + d[None, :], mask=mask_n[:, None] & (d[None, :] < D_QK), other=0.0)
    qk = dot(q, tl.trans(k), tl.zeros((q.shape[0], BLOCK_N), tl.float32), FP32_DOT)
    if BLOCK_DTAIL > 0:
        dt = BLOCK_DQK + tl.arange(0, BLOCK_DTAIL)
        k_tail = tl.load(k_rows + dt[None, :], mask=mask_n[:, None] & (dt[None, :] < D_QK), other=0.0)
        qk = dot(q_tail, tl.trans(k_tail), qk, FP32_DOT)
    if MASK:
        qk = qk * qk_scale
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
    else:  # every score is finite: the scale goes into one FMA with the max
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + rows[:, None] * stride_vt + kv_h * stride_vh + dv[None, :],
        mask=mask_n[:, None] & (dv[None, :] < D_V),
        other=0.0,
    )
    acc = dot(cast(p, v.dtype), v, acc * alpha[:, None], FP32_DOT)
    return acc, m_new, l_i


@triton.jit
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_q_ptr,
    cu_k_ptr,
    n_seqs,
    scale,
    group,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DTAIL: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Program (t, h): head ``h`` of the t-th tile of ``BLOCK_M`` queries counted from the last sequence's last tile
    back (causal: the longest rows of queries start first), each sequence's tiles found from ``cu_q_ptr`` on the
    device. The grid's first dimension is an upper bound (every query in tiles, plus one partial tile per sequence):
    the host never reads the sequences' lengths."""
    pdl_wait()
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seqs = tl.arange(0, BLOCK_B)
    starts = tl.load(cu_q_ptr + seqs, mask=seqs < n_seqs, other=0)
    stops = tl.load(cu_q_ptr + 1 + seqs, mask=seqs < n_seqs, other=0)
    tiles = tl.cdiv(stops - starts, BLOCK_M)  # query tiles of each sequence (0 past n_seqs)
    ends = tl.cumsum(tiles, axis=0)
    seq = tl.sum((ends <= t).to(tl.int32), axis=0)  # sequences past n_seqs end at the total, which t never reaches
    if seq >= n_seqs:
        return
    pid_m = t - tl.sum(tl.where(seqs < seq, tiles, 0), axis=0)
    q_start = tl.load(cu_q_ptr + seq)
    len_q = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    len_k = tl.load(cu_k_ptr + seq + 1) - k_start
    kv_h = h // group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < len_q
    # D_QK = BLOCK_DQK (a power of two) + a tail (e.g. 192 = 128 + 64), so nothing is padded to 256.
    d = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_rows + d[None, :], mask=mask_m[:, None] & (d[None, :] < D_QK), other=0.0)
    q_tail = q
    if BLOCK_DTAIL > 0:
        dt = BLOCK_DQK + tl.arange(0, BLOCK_DTAIL)
        q_tail = tl.load(q_rows + dt[None, :], mask=mask_m[:, None] & (dt[None, :] < D_QK), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    shift = len_k - len_q  # bottom-right alignment: query i sees keys j <= i + shift
    # Keys below `full` are seen by every row of the tile; [full, hi) needs the causal and length masks.
    hi = len_k
    full = len_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(len_k, (pid_m + 1) * BLOCK_M + shift)
        full = tl.maximum(tl.minimum(full, (pid_m * BLOCK_M + shift + 1) // BLOCK_N * BLOCK_N), 0)
    qk_scale = scale * 1.4426950408889634
    step_args = (k_ptr, v_ptr, k_start, len_k, kv_h, shift, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh)
    for n0 in range(0, full, BLOCK_N):
        acc, m_i, l_i = _varlen_step(
            q, q_tail, acc, m_i, l_i, n0, offs_m, *step_args,
            D_QK, D_V, BLOCK_DQK, BLOCK_DTAIL, BLOCK_DV, CAUSAL, False, BLOCK_N, FP32_DOT,
        )  # fmt: skip
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _varlen_step(
            q, q_tail, acc, m_i, l_i, n0, offs_m, *step_args,
            D_QK, D_V, BLOCK_DQK, BLOCK_DTAIL, BLOCK_DV, CAUSAL, True, BLOCK_N, FP32_DOT,
        )  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query that sees no key returns zeros
    tl.store(
        o_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + dv[None, :],
        cast(out, o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & (dv[None, :] < D_V),
    )


@triton.jit
def _write_kernel(
    latent_ptr,
    slots_ptr,
    cache_ptr,
    cache_f32_ptr,
    cache_bf16_ptr,
    stride_t,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WIDTH: tl.constexpr,
    FP8: tl.constexpr,
    PREROUND: tl.constexpr,
):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    rope = tl.load(latent_ptr + t * stride_t + L + r, mask=rmask, other=0.0)
    if FP8:
        groups = tl.arange(0, L // 128)[:, None] * 128 + tl.arange(0, 128)[None, :]
        c = tl.load(latent_ptr + t * stride_t + groups).to(tl.float32)
        scale = pow2_ceil(tl.maximum(tl.max(tl.abs(c), axis=1), 1e-4) / 448.0)
        q = to_e4m3(tl.clamp(c / scale[:, None], -448.0, 448.0), PREROUND).to(tl.uint8, bitcast=True)
        base = slot * WIDTH
        tl.store(cache_ptr + base + groups, q)
        tl.store(cache_f32_ptr + (base + L) // 4 + tl.arange(0, L // 128), scale)
        tl.store(cache_bf16_ptr + (base + L + 4 * (L // 128)) // 2 + r, cast(rope, tl.bfloat16), mask=rmask)
    else:
        cols = tl.arange(0, L)
        c = tl.load(latent_ptr + t * stride_t + cols)
        tl.store(cache_ptr + slot * WIDTH + cols, cast(c, tl.bfloat16))
        tl.store(cache_ptr + slot * WIDTH + L + r, cast(rope, tl.bfloat16), mask=rmask)
