"""``mla_decode``'s split kernel in Gluon (``triton.experimental.gluon``), for the bf16 cache: the scores of a block are
computed once for the program's 64 heads, each warpgroup taking half of the block's tokens, and P x V is split by
value columns, each warpgroup taking half of the latent (FlashMLA's division of the work).

The ``tl`` kernel in ``deepinfer_cuda_sm100.attention`` cannot choose that split: Triton gives chained products all
warps along the rows, so with 64 heads and two warpgroups both compute the same [64, 64] scores (NOTES.md, sixth
session) and 112 instead of 73 GFLOP of products are issued at B=64, ctx 4096. Here the layouts are explicit:
scores and output are ``NVMMADistributedLayout`` with warps [4, 2] (the two warpgroups side by side along columns),
P goes through shared memory so each warpgroup multiplies all of it by its own value columns.

The program's query (64 x 576 bf16) stays in shared memory; whole 64-token blocks arrive by TMA copies into two
stages; the last, partial block of a span is gathered by pointer, zeros past the span. Splits and the merge are the
committed kernel's (same partial layout), so the two are compared output to output.

    python3 benchmarks/gluon_mla.py OUT.json   (on the GPU: checked against the committed kernel and the reference,
                                                then both timed from CUDA graphs)
    python3 benchmarks/gluon_mla.py --compile  (anywhere: compiles for SM90 and prints registers and shared memory)

Written against Triton 3.6's Gluon, the GPU machine's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_H, BLOCK_N, L, R, LH = (gl.constexpr(v) for v in (64, 64, 512, 64, 256))


@gluon.jit
def _load_block(lat_desc, rope_desc, bar, c0_s, c1_s, kr_s, stage, row, pred):
    nbytes: gl.constexpr = 2 * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
    mbarrier.expect(bar.index(stage), nbytes, pred=pred)
    tma.async_copy_global_to_shared(lat_desc, [row, 0], bar.index(stage), c0_s.index(stage), pred=pred)
    tma.async_copy_global_to_shared(lat_desc, [row, LH], bar.index(stage), c1_s.index(stage), pred=pred)
    tma.async_copy_global_to_shared(rope_desc, [row, L], bar.index(stage), kr_s.index(stage), pred=pred)


@gluon.jit
def _gather_block(cache_ptr, table_row, n0, end, c0_s, c1_s, kr_s, stage, PAGE: gl.constexpr, WIDTH: gl.constexpr):
    """The tokens n0 + [0, 64) of a span gathered by pointer into ``stage``, zeros at and past ``end`` (the cache past
    a sequence may hold NaN, which P x V must not see). 16 tokens at a time: the products in flight hold most of the
    registers."""
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    CHUNK: gl.constexpr = 16
    cols = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, rows)), 0)
    rope_cols = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(0, rows)), 0)
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        pos = n0 + r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, rows))
        valid = pos < end
        page = gl.load(table_row + pos // PAGE, mask=valid, other=0)
        base = gl.expand_dims((page.to(gl.int64) * PAGE + pos % PAGE) * WIDTH, 1)
        valid = gl.expand_dims(valid, 1)
        c0_s.index(stage).slice(r, CHUNK).store(gl.load(cache_ptr + base + cols, mask=valid, other=0.0))
        c1_s.index(stage).slice(r, CHUNK).store(gl.load(cache_ptr + base + LH + cols, mask=valid, other=0.0))
        kr_s.index(stage).slice(r, CHUNK).store(gl.load(cache_ptr + base + L + rope_cols, mask=valid, other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _query_to_smem(q_ptr, b, s, pid_h, H, stride_qb, stride_qs, stride_qh):
    """The program's 64 query heads into shared memory as the A operands of S = Q K^T: two latent halves and the rope
    part, zeros for heads past ``H``."""
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
    q_row = gl.expand_dims(q_ptr + b.to(gl.int64) * stride_qb + s * stride_qs + heads * stride_qh, 1)
    hmask = gl.expand_dims(heads < H, 1)
    cols = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, rows)), 0)
    rope_cols = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(0, rows)), 0)
    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, LH], gl.bfloat16)
    rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, R], gl.bfloat16)
    q0_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, gl.load(q_row + cols, mask=hmask))
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, gl.load(q_row + LH + cols, mask=hmask))
    qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], rope_layout, gl.load(q_row + L + rope_cols, mask=hmask))
    return q0_s, q1_s, qr_s


S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16]))


@gluon.jit
def _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, stage):
    """Issues S = Q K^T of the block in ``stage`` (the two latent halves, then the rope part), asynchronously."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q0_s, c0_s.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q1_s, c1_s.index(stage).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qr_s, kr_s.index(stage).permute((1, 0)), s, is_async=True)


@gluon.jit
def mla_split_gluon(
    q_ptr,
    lat_desc,
    rope_desc,
    cache_ptr,
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
    PAGE: gl.constexpr,
    WIDTH: gl.constexpr,
    SPLIT: gl.constexpr,
    DEFER_SUM: gl.constexpr,
):
    """The committed ``_mla_split_kernel``'s contract for a bf16 cache, L = 512, R = 64, 64 heads per program."""
    row = gl.program_id(0)
    pid_h = gl.program_id(1)
    split = gl.program_id(2)
    b = row // S_q
    s = row % S_q
    limit = gl.load(seq_lens_ptr + b) - S_q + s + 1
    start = split * SPLIT
    end = gl.minimum(start + SPLIT, limit)

    o_layout: gl.constexpr = O_LAYOUT
    heads_o = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    part_o = (row.to(gl.int64) * H + heads_o) * n_splits + split
    if start >= end:
        gl.store(part_lse_ptr + part_o, gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, o_layout)),
                 mask=heads_o < H)  # fmt: skip
        return

    q0_s, q1_s, qr_s = _query_to_smem(q_ptr, b, s, pid_h, H, stride_qb, stride_qs, stride_qh)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], lat_desc.layout)
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], lat_desc.layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], rope_desc.layout)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], kr_s.layout)
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bar.index(i), count=1)

    table_row = table_ptr + b.to(gl.int64) * stride_table
    full = (end - start) // BLOCK_N  # whole blocks (a span starts on a block boundary, a block lies in one page)
    for i in gl.static_range(2):
        n0 = start + i * BLOCK_N
        first = gl.load(table_row + n0 // PAGE, mask=i < full, other=0) * PAGE + n0 % PAGE
        _load_block(lat_desc, rope_desc, bar, c0_s, c1_s, kr_s, i, first, i < full)
    fence_async_shared()
    gl.thread_barrier()  # the query's stores are visible to the tensor cores

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_part = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)  # DEFER_SUM: summed over tokens once, at the end
    o0 = gl.zeros([BLOCK_H, LH], gl.float32, O_LAYOUT)
    o1 = gl.zeros([BLOCK_H, LH], gl.float32, O_LAYOUT)
    qk_scale = scale * 1.4426950408889634
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    if full == 0:
        _gather_block(cache_ptr, table_row, start, end, c0_s, c1_s, kr_s, 0, PAGE, WIDTH)
    else:
        mbarrier.wait(bar.index(0), 0)
    s = _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, 0)
    s = warpgroup_mma_wait(0, deps=[s])
    # Block i: softmax of its scores, P into shared memory, P x V issued; then block i + 1's scores are issued behind
    # it, so the tensor cores go from one product to the next without waiting for this warpgroup.
    for i in range(n_blocks):
        stage = i % 2
        s = gl.where(gl.expand_dims(start + i * BLOCK_N + tokens < end, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        if DEFER_SUM:
            l_part = l_part * gl.expand_dims(alpha, 1) + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # each warpgroup wrote half of P's columns and reads all of them
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT), assert_trivial=True), 1)
        pv0 = warpgroup_mma(p_s, c0_s.index(stage), o0 * alpha_o, is_async=True)
        pv1 = warpgroup_mma(p_s, c1_s.index(stage), o1 * alpha_o, is_async=True)
        nxt = i + 1
        if nxt < n_blocks:
            if nxt < full:
                mbarrier.wait(bar.index(nxt % 2), (nxt // 2) & 1)
            else:  # the partial last block; its stage held block i - 1, done, and has no copy in flight
                _gather_block(cache_ptr, table_row, start + nxt * BLOCK_N, end, c0_s, c1_s, kr_s, nxt % 2, PAGE, WIDTH)
            s_next = _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, nxt % 2)
            o0, o1, s = warpgroup_mma_wait(0, deps=[pv0, pv1, s_next])
        else:
            o0, o1 = warpgroup_mma_wait(0, deps=[pv0, pv1])
        gl.thread_barrier()  # both warpgroups are done with P and with this stage
        n0 = start + (i + 2) * BLOCK_N
        refill = i + 2 < full
        first = gl.load(table_row + n0 // PAGE, mask=refill, other=0) * PAGE + n0 % PAGE
        _load_block(lat_desc, rope_desc, bar, c0_s, c1_s, kr_s, stage, first, refill)
    for i in gl.static_range(2):
        mbarrier.invalidate(bar.index(i))

    if DEFER_SUM:
        l_i = gl.sum(l_part, axis=1)
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634
    inv_l = gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout)), 1)
    out_row = gl.expand_dims(part_o * L, 1) + gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, o_layout)), 0)
    omask = gl.expand_dims(heads_o < H, 1)
    gl.store(part_out_ptr + out_row, o0 * inv_l, mask=omask)
    gl.store(part_out_ptr + out_row + LH, o1 * inv_l, mask=omask)
    gl.store(part_lse_ptr + part_o, gl.convert_layout(lse, gl.SliceLayout(1, o_layout)), mask=heads_o < H)


# --- warp-specialized: one warpgroup computes the scores, the softmax and the left half of P x V; the other only the
# right half of P x V, so that its products run while the first warpgroup works on the softmax and the next scores.
S_WG = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_WG = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))


@gluon.jit
def _scores_wg(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, stage):
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_WG)
    s = warpgroup_mma(q0_s, c0_s.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(q1_s, c1_s.index(stage).permute((1, 0)), s, is_async=True)
    return warpgroup_mma(qr_s, kr_s.index(stage).permute((1, 0)), s, is_async=True)


@gluon.jit
def _part_rows(row, pid_h, split, H, n_splits):
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_WG))
    return (row.to(gl.int64) * H + heads) * n_splits + split, heads < H


@gluon.jit
def _refill(lat_desc, rope_desc, kv_ready, kv_free, c0_s, c1_s, kr_s, table_row, start, full, i, PAGE: gl.constexpr):
    """Once the other warpgroup is done with block i, its stage takes block i + 2 (if that is a whole block)."""
    stage = i % 2
    mbarrier.wait(kv_free.index(stage), (i // 2) & 1)
    n0 = start + (i + 2) * BLOCK_N
    refill = i + 2 < full
    first = gl.load(table_row + n0 // PAGE, mask=refill, other=0) * PAGE + n0 % PAGE
    _load_block(lat_desc, rope_desc, kv_ready, c0_s, c1_s, kr_s, stage, first, refill)


@gluon.jit
def _softmax_left_partition(
    q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, lat_desc, rope_desc,
    cache_ptr, table_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h, split, H, n_splits,
    PAGE: gl.constexpr, WIDTH: gl.constexpr, SCORES_FIRST: gl.constexpr,
):  # fmt: skip
    """Block i: softmax of S_i, P_i and its row factor handed to the other warpgroup, P_i x V_i[:, :256] issued, then
    S_{i + 1} issued behind it; the stage is refilled once both warpgroups are done with it."""
    full = (end - start) // BLOCK_N
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_WG))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_WG))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_WG))
    o = gl.zeros([BLOCK_H, LH], gl.float32, O_WG)
    if full == 0:
        _gather_block(cache_ptr, table_row, start, end, c0_s, c1_s, kr_s, 0, PAGE, WIDTH)
    else:
        mbarrier.wait(kv_ready.index(0), 0)
    s = warpgroup_mma_wait(0, deps=[_scores_wg(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, 0)])
    pv = o  # P x V (left) still in flight across iterations when SCORES_FIRST
    for i in range(n_blocks):
        stage = i % 2
        s = gl.where(gl.expand_dims(start + i * BLOCK_N + tokens < end, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        o_cur = o
        if SCORES_FIRST:  # P_{i - 1} x V_{i - 1} (left) ran during this softmax; then block i - 1 is done
            o_cur = warpgroup_mma_wait(0, deps=[pv])  # (only P x V is carried across iterations, not both)
            if i > 0:
                _refill(lat_desc, rope_desc, kv_ready, kv_free, c0_s, c1_s, kr_s, table_row, start, full, i - 1, PAGE)
        mbarrier.wait(p_free, (i & 1) ^ 1)  # the other warpgroup is done with P_{i - 1}
        p_s.store(p.to(gl.bfloat16))
        a_s.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_WG)), 1)
        nxt = i + 1
        if SCORES_FIRST:
            # S_{i + 1} ahead of P_i x V_i, so that the next softmax can start while P_i x V_i runs
            if nxt < n_blocks:
                if nxt < full:
                    mbarrier.wait(kv_ready.index(nxt % 2), (nxt // 2) & 1)
                else:  # the partial last block; its stage held block i - 1, released above
                    _gather_block(
                        cache_ptr, table_row, start + nxt * BLOCK_N, end, c0_s, c1_s, kr_s, nxt % 2, PAGE, WIDTH
                    )
                s_next = _scores_wg(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, nxt % 2)
                pv_async = warpgroup_mma(p_s, c0_s.index(stage), o_cur * alpha_o, is_async=True)
                s, pv = warpgroup_mma_wait(1, deps=[s_next, pv_async])
            else:
                pv_async = warpgroup_mma(p_s, c0_s.index(stage), o_cur * alpha_o, is_async=True)
                pv = warpgroup_mma_wait(1, deps=[pv_async])
        else:
            pv_async = warpgroup_mma(p_s, c0_s.index(stage), o * alpha_o, is_async=True)
            if nxt < n_blocks:
                if nxt < full:
                    mbarrier.wait(kv_ready.index(nxt % 2), (nxt // 2) & 1)
                else:  # the partial last block; its stage held block i - 1, released in the last iteration
                    _gather_block(
                        cache_ptr, table_row, start + nxt * BLOCK_N, end, c0_s, c1_s, kr_s, nxt % 2, PAGE, WIDTH
                    )
                s_next = _scores_wg(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, nxt % 2)
                o, s = warpgroup_mma_wait(0, deps=[pv_async, s_next])
            else:
                o = warpgroup_mma_wait(0, deps=[pv_async])
            _refill(lat_desc, rope_desc, kv_ready, kv_free, c0_s, c1_s, kr_s, table_row, start, full, i, PAGE)
    if SCORES_FIRST:
        o = warpgroup_mma_wait(0, deps=[pv])
    mbarrier.wait(p_free, (n_blocks & 1) ^ 1)
    a_s.store(1.0 / l_i)  # the other half's normaliser
    mbarrier.arrive(p_ready, count=1)

    part, hmask = _part_rows(row, pid_h, split, H, n_splits)
    inv_l = gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, O_WG)), 1)
    cols = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, O_WG)), 0)
    gl.store(part_out_ptr + gl.expand_dims(part * L, 1) + cols, o * inv_l, mask=gl.expand_dims(hmask, 1))
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634
    gl.store(part_lse_ptr + part, gl.convert_layout(lse, gl.SliceLayout(1, O_WG)), mask=hmask)


@gluon.jit
def _right_partition(
    p_s, a_s, c1_s, kv_free, p_ready, p_free, part_out_ptr, start, end, row, pid_h, split, H, n_splits
):  # fmt: skip
    """P_i x V_i[:, 256:] for each block, after the first warpgroup has published P_i and its row factor."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    o = gl.zeros([BLOCK_H, LH], gl.float32, O_WG)
    for i in range(n_blocks):
        mbarrier.wait(p_ready, i & 1)
        alpha = gl.expand_dims(a_s.load(gl.SliceLayout(1, O_WG)), 1)
        o = warpgroup_mma(p_s, c1_s.index(i % 2), o * alpha)
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(kv_free.index(i % 2), count=1)
    mbarrier.wait(p_ready, n_blocks & 1)
    inv_l = gl.expand_dims(a_s.load(gl.SliceLayout(1, O_WG)), 1)
    part, hmask = _part_rows(row, pid_h, split, H, n_splits)
    cols = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, O_WG)), 0)
    gl.store(part_out_ptr + gl.expand_dims(part * L + LH, 1) + cols, o * inv_l, mask=gl.expand_dims(hmask, 1))


@gluon.jit
def mla_split_ws(
    q_ptr,
    lat_desc,
    rope_desc,
    cache_ptr,
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
    PAGE: gl.constexpr,
    WIDTH: gl.constexpr,
    SPLIT: gl.constexpr,
    RIGHT_REGS: gl.constexpr,
    SCORES_FIRST: gl.constexpr,
):
    """``mla_split_gluon``'s contract, warp-specialized; launched with 4 warps (the worker adds 4)."""
    row = gl.program_id(0)
    pid_h = gl.program_id(1)
    split = gl.program_id(2)
    b = row // S_q
    s = row % S_q
    limit = gl.load(seq_lens_ptr + b) - S_q + s + 1
    start = split * SPLIT
    end = gl.minimum(start + SPLIT, limit)
    if start >= end:
        part, hmask = _part_rows(row, pid_h, split, H, n_splits)
        gl.store(
            part_lse_ptr + part, gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, O_WG)), mask=hmask
        )
        return

    q0_s, q1_s, qr_s = _query_to_smem(q_ptr, b, s, pid_h, H, stride_qb, stride_qs, stride_qh)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], lat_desc.layout)
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], lat_desc.layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], rope_desc.layout)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], kr_s.layout)
    a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)

    table_row = table_ptr + b.to(gl.int64) * stride_table
    full = (end - start) // BLOCK_N
    for i in gl.static_range(2):
        n0 = start + i * BLOCK_N
        first = gl.load(table_row + n0 // PAGE, mask=i < full, other=0) * PAGE + n0 % PAGE
        _load_block(lat_desc, rope_desc, kv_ready, c0_s, c1_s, kr_s, i, first, i < full)
    fence_async_shared()
    gl.thread_barrier()  # the query's stores are visible to the tensor cores
    qk_scale = scale * 1.4426950408889634
    gl.warp_specialize(
        [
            (
                _softmax_left_partition,
                (q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, kv_ready, kv_free, p_ready, p_free, lat_desc,
                 rope_desc, cache_ptr, table_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h,
                 split, H, n_splits, PAGE, WIDTH, SCORES_FIRST),
            ),
            (
                _right_partition,
                (p_s, a_s, c1_s, kv_free, p_ready, p_free, part_out_ptr, start, end, row, pid_h, split, H, n_splits),
            ),
        ],
        [4],
        [RIGHT_REGS],
    )  # fmt: skip


def descriptors(records: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors over the cache's token records [tokens, 576] (bf16): 64 x 256 latent halves and the 64 x 64
    rope part."""
    n, half, rope = BLOCK_N.value, LH.value, R.value
    half_layout = gl.NVMMASharedLayout.get_default_for([n, half], gl.bfloat16)
    rope_layout = gl.NVMMASharedLayout.get_default_for([n, rope], gl.bfloat16)
    return (
        TensorDescriptor.from_tensor(records, [n, half], half_layout),
        TensorDescriptor.from_tensor(records, [n, rope], rope_layout),
    )


VARIANTS = {  # name -> (kernel, its constants, warps given at launch)
    "gluon split": (mla_split_gluon, {"DEFER_SUM": False}, 8),
    "gluon split, sum deferred": (mla_split_gluon, {"DEFER_SUM": True}, 8),
    "gluon warp-specialized": (mla_split_ws, {"RIGHT_REGS": 192, "SCORES_FIRST": False}, 4),
    "gluon warp-specialized, scores first": (mla_split_ws, {"RIGHT_REGS": 192, "SCORES_FIRST": True}, 4),
}


def mla_decode_gluon(q, kv_cache, block_table, seq_lens, *, softmax_scale, variant, invariant=False):
    """The committed ``mla_decode`` host code with a Gluon split kernel (bf16 cache, L = 512, R = 64)."""
    from deepinfer_cuda_sm100 import attention
    from deepinfer_cuda_sm100._triton import next_pow2, num_sms

    kernel, constants, warps = VARIANTS[variant]
    batch, s_q, heads, _ = q.shape
    out = torch.empty(batch, s_q, heads, L, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device)
    page = kv_cache.shape[1]
    head_blocks = triton.cdiv(heads, BLOCK_H)
    context = block_table.shape[1] * page
    split = attention._split_tokens(batch * s_q * head_blocks, context, num_sms(q.device.index or 0), invariant)
    n_splits = triton.cdiv(context, split)
    part_out = torch.empty(batch * s_q * heads * n_splits, L, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch * s_q * heads * n_splits, dtype=torch.float32, device=q.device)
    records = kv_cache.view(-1, kv_cache.shape[2])
    lat_desc, rope_desc = descriptors(records)
    kernel[(batch * s_q, head_blocks, n_splits)](
        q, lat_desc, rope_desc, records, block_table, seq_lens, part_out, part_lse, softmax_scale, s_q, heads,
        q.stride(0), q.stride(1), q.stride(2), block_table.stride(0), n_splits,
        PAGE=page, WIDTH=kv_cache.shape[2], SPLIT=split, num_warps=warps, **constants,
    )  # fmt: skip
    attention._mla_merge_kernel[(batch * s_q * heads,)](
        part_out, part_lse, out, lse, n_splits, L=L, BLOCK_S=next_pow2(n_splits), CHUNK=8
    )
    return out, lse


def compile_for_sm90(variant: str) -> None:
    """Compiles a variant for SM90 without a GPU and prints its resources (``cuobjdump`` from Triton's wheel) and its
    tensor-core instructions."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel, constants, warps = VARIANTS[variant]
    lat_desc, rope_desc = descriptors(torch.empty(4096, L.value + R.value, dtype=torch.bfloat16))
    signature = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    signature |= {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale": "fp32"}
    for name in ("S_q", "H", "stride_qb", "stride_qs", "stride_qh", "stride_table", "n_splits"):
        signature[name] = "i32"
    for name, desc in (("lat_desc", lat_desc), ("rope_desc", rope_desc)):
        signature[name] = native_specialize_impl(BaseBackend, desc, False, True, True)[0]
    constants = {"PAGE": 64, "WIDTH": L.value + R.value, "SPLIT": 1024} | constants
    signature |= dict.fromkeys(constants, "constexpr")
    source = GluonASTSource(kernel, signature, constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = f"{triton.__path__[0]}/backends/nvidia/bin/cuobjdump"
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*STACK:(\d+)", usage)
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", compiled.asm["ptx"])
    counts = ", ".join(f"{shape} x {shapes.count(shape)}" for shape in sorted(set(shapes)))
    print(f"{variant}: registers {found[1]}, stack {found[2]}, shared {compiled.metadata.shared} bytes; wgmma {counts}")


def main() -> int:
    if sys.argv[1:] == ["--compile"]:
        print(f"Triton {triton.__version__}, SM90")
        for variant in VARIANTS:
            compile_for_sm90(variant)
        return 0
    from tile_variants import make

    import deepinfer
    from deepinfer import bench, ops
    from deepinfer.conformance.cases import error
    from deepinfer_cuda_sm100 import attention

    report = {"device": torch.cuda.get_device_name(), "rows": []}
    # lengths short of the table's reach by up to 100 tokens (spans end inside a page), then whole pages
    for batch, ctx, short in [(8, 1024, 100), (64, 4096, 100), (64, 4096, 0), (128, 4096, 0), (32, 16384, 0),
                              (64, 16384, 0), (128, 16384, 0), (1, 4096, 0), (64, 1024, 0)]:  # fmt: skip
        sets = [make(batch, ctx, "bf16", seed, short=short) for seed in range(3)]
        with deepinfer.use("reference"):
            ref = ops.mla_decode(**sets[0], kv_lora_rank=512, kv_format="bf16")
        sides = {
            "committed": lambda i, sets=sets: attention.mla_decode(**sets[i], kv_lora_rank=512, kv_format="bf16"),
        } | {name: lambda i, sets=sets, name=name: mla_decode_gluon(**sets[i], variant=name) for name in VARIANTS}
        row = {"B": batch, "ctx": ctx, "short": short}
        for name, fn in sides.items():
            out = fn(0)
            err = max(error(out[0], ref[0]), error(out[1], ref[1]))
            ms = bench.time_graph_ms(fn, sets=len(sets), reps=30) if err < 0.05 else None
            row[name] = {"ms": ms, "rel_err": err}
            cache_gb = batch * ctx * 576 * 2 / 1e9
            speed = f"{ms:.4f} ms, {cache_gb / ms * 1e3:.0f} GB/s of cache" if ms else "not timed"
            print(f"B={batch} ctx={ctx} short={short} {name}: {speed}, rel err {err:.1e}", flush=True)
        report["rows"].append(row)
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
