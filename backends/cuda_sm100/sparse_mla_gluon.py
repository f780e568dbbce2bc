"""``sparse_mla``'s kernel for Hopper (SM90) in Gluon: ``mla_gluon``'s warp-specialized split kernel fed rows gathered
by index instead of consecutive pages. A bf16 or fp8_ds_mla cache, latent 512, rope 64, at least 64 heads.

One program per (query token, 64 heads, span of its index list). Three warpgroups, as ``mla_gluon``'s fp8_ds_mla
kernel divides the work:

- the first computes S = Q K^T of a 64-entry block, its softmax (entries listed as -1 masked, a block with none
  listed yet contributing nothing), hands P and the row factor to the second, and multiplies P by the left latent half;
- the second multiplies each P by the right latent half;
- the third fills the two stages: for each entry of the block it reads the cache slot from the list and copies that
  record by pointer (Hopper has no TMA gather), with zeros for entries listed as -1 (the cache may hold NaN there,
  which P x V must not see). Records go into the stage by cp.async as stored, a whole block in flight at once: bf16
  rows into place; fp8_ds_mla rows' e4m3 halves into the first bytes of their own stage halves, then dequantised to
  bf16 in place by the same warpgroup.

A span ends where its list does: ``indexer_topk`` pads each list with -1 at the end, and the blocks past the last
listed entry are never loaded. Spans of the list split over programs where the grid would leave SMs idle; the
partial outputs merge as ``mla_decode``'s do. Measured on the GPU beside the Triton kernel: benchmarks/NOTES.md,
sparse attention.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._gluon import ASYNC_COMMIT, ASYNC_LOAD, ASYNC_WAIT, BARRIER, REINTERPRET
from .mla_gluon import (
    BLOCK_H,
    BLOCK_N,
    LH,
    LOG2E,
    O_LAYOUT,
    ROPE_AT,
    S_LAYOUT,
    L,
    R,
    _dequantize_half,
    _empty_span,
    _part_rows,
    _query_to_smem,
    _right,
    _scores,
    _store_columns,
    on_hopper,
)

# Rows copied per step of the filling warpgroup, and registers per thread of the second and third warpgroups (the
# first gets the rest of 512: its [64, 256] fp32 accumulator and S take most of it). The fill holds no rows in
# registers (cp.async), so 96 serve it; at 120 the first warpgroup kept 224 and spilled twice as often in its loop
# (benchmarks/NOTES.md, sparse attention: 2026-12-07).
CHUNK = 16
RIGHT_REGS, FILL_REGS = 160, 96
# ``mla_gluon.FP8_BY_BITS`` for this kernel's in-place dequantisation: the same bits, but 1.09-1.13x slower at 96
# fill registers on an H100, and at 120 no faster than the fp32 route at 96 (benchmarks/NOTES.md, sparse attention).
FP8_BY_BITS = False
LIST_CHUNK = gl.constexpr(1024)  # list entries read at a time to find where a span's list ends


@gluon.jit
def _listed_end(idx_row, start, stop):
    """One past the last entry of ``[start, stop)`` of the list that names a slot (``start`` if none does)."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    end = start
    for i0 in range(start, stop, LIST_CHUNK):
        i = i0 + gl.arange(0, LIST_CHUNK, layout=layout)
        listed = gl.load(idx_row + i, mask=i < stop, other=-1) >= 0
        end = gl.maximum(end, gl.max(gl.where(listed, i + 1, 0), axis=0))
    return end


@gluon.jit
def _copy_rows(dst, src_rows, valid, COLUMNS: gl.constexpr):
    """cp.async copies of ``COLUMNS`` bf16 values from each of ``src_rows`` (pointers to the rows' first values, 16-byte
    aligned) into the rows of ``dst`` (zeros where not ``valid``), 16 bytes a copy."""
    threads: gl.constexpr = COLUMNS // 8  # threads of a warp per row
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // threads, threads], [gl.num_warps(), 1], [1, 0])
    rows = gl.expand_dims(gl.convert_layout(src_rows, gl.SliceLayout(1, layout)), 1)
    ok = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, layout)), 1)
    at, ok = gl.broadcast(rows + gl.expand_dims(gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout)), 0), ok)
    # rows are 16-byte aligned: 1152-byte bf16 records, or the rope part 528 bytes into a 656-byte fp8_ds_mla record,
    # from a 16-byte-aligned base (``declines``). Marked because what Triton infers through slots carried across loop
    # iterations varies (one version, without launch attributes, made these 2-byte copies and refused them).
    at = gl.max_contiguous(gl.multiple_of(at, [16, 16]), [1, 8])
    ASYNC_LOAD(dst, at, mask=ok)


@gluon.jit
def _block_slots(idx_row, n0, end, CHUNK: gl.constexpr):
    """The cache slots listed at entries ``n0 + [0, 4 CHUNK)`` (-1 at or past ``end``), as four chunks."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    pos = n0 + gl.arange(0, CHUNK, layout=layout)
    return (
        gl.load(idx_row + pos, mask=pos < end, other=-1),
        gl.load(idx_row + pos + CHUNK, mask=pos + CHUNK < end, other=-1),
        gl.load(idx_row + pos + 2 * CHUNK, mask=pos + 2 * CHUNK < end, other=-1),
        gl.load(idx_row + pos + 3 * CHUNK, mask=pos + 3 * CHUNK < end, other=-1),
    )


@gluon.jit
def _copy_columns(cache_ptr, slots, dst, stage, col0, WIDTH: gl.constexpr, CHUNK: gl.constexpr):
    """cp.async copies of columns ``col0 + [0, dst's width)`` of the block's rows at ``slots`` into ``dst[stage]``."""
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        slot = slots[r // CHUNK]
        valid = slot >= 0
        row = cache_ptr + gl.where(valid, slot, 0).to(gl.int64) * WIDTH + col0
        _copy_rows(dst.index(stage).slice(r, CHUNK), row, valid, dst.shape[2])


@gluon.jit
def _fill_async(cache_ptr, idx_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free,
                WIDTH: gl.constexpr, CHUNK: gl.constexpr):  # fmt: skip
    """The third warpgroup for a bf16 cache: each block's rows copied straight into its stage by cp.async (no
    registers hold them, and a whole block, 72 KB, is in flight at once), issued as soon as the stage is free;
    entries listed as -1 or past ``end`` are zero-filled. The right half and the rope part go first and are published
    as soon as they land, so that S's first products start while the left half is still on its way; the next
    block's slots are loaded while this block's copies are in flight."""
    gl.static_assert(BLOCK_N == 4 * CHUNK, "a block is four chunks of rows")
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    slots = _block_slots(idx_row, start, end, CHUNK)
    for i2 in range(0, n_blocks, 2):  # two blocks per iteration: each stage's index is then known when compiling
        for stage in gl.static_range(2):
            i = i2 + stage
            if i < n_blocks:
                mbarrier.wait(kv_free.index(stage), ((i // 2) & 1) ^ 1)
                _copy_columns(cache_ptr, slots, c1_s, stage, LH, WIDTH, CHUNK)
                _copy_columns(cache_ptr, slots, kr_s, stage, L, WIDTH, CHUNK)
                ASYNC_COMMIT()
                _copy_columns(cache_ptr, slots, c0_s, stage, 0, WIDTH, CHUNK)
                ASYNC_COMMIT()
                slots = _block_slots(idx_row, start + (i + 1) * BLOCK_N, end, CHUNK)
                ASYNC_WAIT(1)
                fence_async_shared()
                mbarrier.arrive(right_ready.index(stage), count=1)
                ASYNC_WAIT(0)
                fence_async_shared()
                mbarrier.arrive(left_ready.index(stage), count=1)


@gluon.jit
def _as_bytes(half):
    """A stage half (``[BLOCK_N, LH]`` bf16) seen as ``[BLOCK_N, LH]`` bytes in its first half, unswizzled: where an
    fp8_ds_mla record's e4m3 half lands before it is dequantised in place."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    if REINTERPRET:
        return half.reinterpret(gl.uint8, [2 * BLOCK_N, LH], layout).slice(0, BLOCK_N)
    else:
        return half._reinterpret(gl.uint8, [2 * BLOCK_N, LH], layout).slice(0, BLOCK_N)


@gluon.jit
def _copy_bytes(dst, src_rows, valid):
    """cp.async copies of ``LH`` bytes from each of ``src_rows`` (16-byte aligned) into the rows of ``dst`` (zeros where
    not ``valid``), 16 bytes a copy."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    rows = gl.expand_dims(gl.convert_layout(src_rows, gl.SliceLayout(1, layout)), 1)
    ok = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, layout)), 1)
    at, ok = gl.broadcast(rows + gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, layout)), 0), ok)
    at = gl.max_contiguous(gl.multiple_of(at, [16, 16]), [1, 16])  # 656-byte records from a 16-byte-aligned base
    ASYNC_LOAD(dst, at, mask=ok)


@gluon.jit
def _chunk_scales(cache_ptr, idx_row, n0, end, WIDTH: gl.constexpr, first: gl.constexpr):
    """Scales ``first`` and ``first + 1`` (of the record's four) of the rows listed at ``n0 + [0, 16)`` (zero where
    none is listed), in the dequantising layout's rows."""
    lat: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    pos = n0 + gl.arange(0, 16, layout=gl.SliceLayout(1, lat))
    slot = gl.load(idx_row + pos, mask=pos < end, other=-1)
    valid = slot >= 0
    record = cache_ptr + gl.where(valid, slot, 0).to(gl.int64) * WIDTH
    scales = (record + L).to(gl.pointer_type(gl.float32), bitcast=True) + first
    return gl.load(scales, mask=valid, other=0.0), gl.load(scales + 1, mask=valid, other=0.0)


@gluon.jit
def _block_scales(cache_ptr, idx_row, n0, end, WIDTH: gl.constexpr, first: gl.constexpr):
    """Scales ``first`` and ``first + 1`` of the block listed at ``n0``, as four chunks' pairs."""
    a0, b0 = _chunk_scales(cache_ptr, idx_row, n0, end, WIDTH, first)
    a1, b1 = _chunk_scales(cache_ptr, idx_row, n0 + 16, end, WIDTH, first)
    a2, b2 = _chunk_scales(cache_ptr, idx_row, n0 + 32, end, WIDTH, first)
    a3, b3 = _chunk_scales(cache_ptr, idx_row, n0 + 48, end, WIDTH, first)
    return a0, b0, a1, b1, a2, b2, a3, b3


@gluon.jit
def _dequantize_in_place(raw, half, scales, BY_BITS: gl.constexpr):
    """The block's e4m3 bytes in ``raw`` (a view of ``half``'s first bytes) read into registers, the warpgroup
    synchronised (every read done before any write), then written back into ``half`` as bf16 (``scales`` from
    ``_block_scales``)."""
    lat: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    r0 = raw.slice(0, 16).load(lat)
    r1 = raw.slice(16, 16).load(lat)
    r2 = raw.slice(32, 16).load(lat)
    r3 = raw.slice(48, 16).load(lat)
    BARRIER()
    half.slice(0, 16).store(_dequantize_half(r0, scales[0], scales[1], BY_BITS))
    half.slice(16, 16).store(_dequantize_half(r1, scales[2], scales[3], BY_BITS))
    half.slice(32, 16).store(_dequantize_half(r2, scales[4], scales[5], BY_BITS))
    half.slice(48, 16).store(_dequantize_half(r3, scales[6], scales[7], BY_BITS))


@gluon.jit
def _fill_fp8(cache_ptr, idx_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free,
              WIDTH: gl.constexpr, CHUNK: gl.constexpr, BY_BITS: gl.constexpr):  # fmt: skip
    """The third warpgroup for an fp8_ds_mla cache: each block's records copied as stored by cp.async, the e4m3
    halves into the first bytes of their own stage halves and the rope part into place, a whole block in flight at
    once; then each half dequantised in place (the scales read from the records while the copies fly). The right
    half and the rope part go first and are published as soon as they are dequantised, while the left half is still
    on its way. No registers hold a row in flight, so the copies' latency overlaps itself rather than the stores."""
    gl.static_assert(BLOCK_N == 4 * CHUNK, "a block is four chunks of rows")
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    slots = _block_slots(idx_row, start, end, CHUNK)
    for i2 in range(0, n_blocks, 2):  # two blocks per iteration: each stage's index is then known when compiling
        for stage in gl.static_range(2):
            i = i2 + stage
            if i < n_blocks:
                n0 = start + i * BLOCK_N
                mbarrier.wait(kv_free.index(stage), ((i // 2) & 1) ^ 1)
                raw1 = _as_bytes(c1_s.index(stage))
                raw0 = _as_bytes(c0_s.index(stage))
                for r in gl.static_range(0, BLOCK_N, CHUNK):
                    slot = slots[r // CHUNK]
                    valid = slot >= 0
                    record = cache_ptr + gl.where(valid, slot, 0).to(gl.int64) * WIDTH
                    _copy_bytes(raw1.slice(r, CHUNK), record + LH, valid)
                    rope = record.to(gl.pointer_type(gl.bfloat16), bitcast=True) + ROPE_AT
                    _copy_rows(kr_s.index(stage).slice(r, CHUNK), rope, valid, R)
                ASYNC_COMMIT()
                for r in gl.static_range(0, BLOCK_N, CHUNK):
                    slot = slots[r // CHUNK]
                    valid = slot >= 0
                    _copy_bytes(raw0.slice(r, CHUNK), cache_ptr + gl.where(valid, slot, 0).to(gl.int64) * WIDTH, valid)
                ASYNC_COMMIT()
                right_scales = _block_scales(cache_ptr, idx_row, n0, end, WIDTH, 2)  # read while the copies fly
                left_scales = _block_scales(cache_ptr, idx_row, n0, end, WIDTH, 0)
                slots = _block_slots(idx_row, n0 + BLOCK_N, end, CHUNK)
                ASYNC_WAIT(1)
                BARRIER()  # every thread's copies of the right half have landed
                _dequantize_in_place(raw1, c1_s.index(stage), right_scales, BY_BITS)
                fence_async_shared()
                mbarrier.arrive(right_ready.index(stage), count=1)
                ASYNC_WAIT(0)
                BARRIER()
                _dequantize_in_place(raw0, c0_s.index(stage), left_scales, BY_BITS)
                fence_async_shared()
                mbarrier.arrive(left_ready.index(stage), count=1)


@gluon.jit
def _scores_softmax_left(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, right_ready, left_ready, kv_free, p_ready,
                         p_free, idx_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h, split, H,
                         n_splits):  # fmt: skip
    """The first warpgroup, as ``mla_gluon._scores_softmax_left`` with an fp8_ds_mla cache, but with the list's -1
    entries masked and a running max that may still be -inf (nothing listed so far: P is zero, not NaN). At the end,
    1 / l (0 where nothing was listed) for the second warpgroup, then this half of the output and the lse."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([BLOCK_H, LH], gl.float32, O_LAYOUT)
    s = _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, 0, True)
    listed = gl.load(idx_row + start + tokens, mask=start + tokens < end, other=-1) >= 0
    s = warpgroup_mma_wait(0, deps=[s])
    for i in range(n_blocks):
        stage = i % 2
        s = gl.where(gl.expand_dims(listed, 0), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        mbarrier.wait(p_free, (i & 1) ^ 1)  # the second warpgroup is done with P_{i-1}
        p_s.store(p.to(gl.bfloat16))
        a_s.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
        pv = warpgroup_mma(p_s, c0_s.index(stage), o * alpha_o, is_async=True)
        nxt = i + 1
        if nxt < n_blocks:
            s_next = _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, nxt, True)
            at = start + nxt * BLOCK_N + tokens
            listed = gl.load(idx_row + at, mask=at < end, other=-1) >= 0
            # P_i x V_i done, S_{i+1}'s three products may still run: the stage is free (as in mla_gluon's split
            # kernel with EARLY_RELEASE)
            o = warpgroup_mma_wait(3, deps=[pv])
            mbarrier.arrive(kv_free.index(stage), count=1)
            s = warpgroup_mma_wait(0, deps=[s_next])
        else:
            o = warpgroup_mma_wait(0, deps=[pv])
            mbarrier.arrive(kv_free.index(stage), count=1)
    inv_l = gl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    mbarrier.wait(p_free, (n_blocks & 1) ^ 1)
    a_s.store(inv_l)
    mbarrier.arrive(p_ready, count=1)

    part, hmask = _part_rows(row, pid_h, split, H, n_splits, O_LAYOUT)
    _store_columns(part_out_ptr, o, gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, O_LAYOUT)), 1), part,
                   hmask, 0)  # fmt: skip
    lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) / LOG2E, float("-inf"))  # natural log
    gl.store(part_lse_ptr + part, gl.convert_layout(lse, gl.SliceLayout(1, O_LAYOUT)), mask=hmask)


@gluon.jit
def _sparse_split_kernel(
    q_ptr,
    cache_ptr,
    idx_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    H,
    topk,
    stride_qt,
    stride_qh,
    stride_it,
    n_splits,
    WIDTH: gl.constexpr,
    SPLIT: gl.constexpr,
    FP8: gl.constexpr,
    CHUNK: gl.constexpr,
    RIGHT_REGS: gl.constexpr,
    FILL_REGS: gl.constexpr,
    DIRECT: gl.constexpr,
    FP8_BY_BITS: gl.constexpr,
):
    """Heads ``64 program_id(1) + [0, 64)`` of query token ``program_id(0)`` over list entries ``SPLIT program_id(2) +
    [0, SPLIT)``: out [64, 512] and lse (natural log) at rows ``(t H + head) n_splits + split`` of ``part_out`` /
    ``part_lse`` (``DIRECT``: one span, the op's out and lse themselves, zeros and -inf where nothing is listed).
    ``cache_ptr``: the records, bf16 elements or (``FP8``) fp8_ds_mla bytes, ``WIDTH`` of them a slot. Launched with 4
    warps, to which the second and third warpgroups add 4 each."""
    t = gl.program_id(0)
    pid_h = gl.program_id(1)
    split = gl.program_id(2)
    idx_row = idx_ptr + t.to(gl.int64) * stride_it
    start = split * SPLIT
    end = _listed_end(idx_row, start, gl.minimum(start + SPLIT, topk))
    if start >= end:
        _empty_span(part_out_ptr, part_lse_ptr, t, pid_h, split, H, n_splits, DIRECT)
        return

    q0_s, q1_s, qr_s = _query_to_smem(q_ptr, t, 0, pid_h, H, stride_qt, 0, stride_qh)
    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LH], gl.bfloat16)
    rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.bfloat16)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], rope_layout)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], kr_s.layout)
    a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    right_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    left_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(right_ready.index(i), count=1)
        mbarrier.init(left_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)  # both consuming warpgroups release it
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    fence_async_shared()
    BARRIER()  # the query's stores are visible to the tensor cores
    qk_scale = scale * LOG2E  # exp2 domain
    gl.warp_specialize(
        [
            (_scores_softmax_left,
             (q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, right_ready, left_ready, kv_free, p_ready, p_free,
              idx_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, t, pid_h, split, H, n_splits)),
            (_right, (p_s, a_s, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, p_ready, p_free, None, None,
                      idx_row, part_out_ptr, start, end, t, pid_h, 1, split, H, n_splits, 64, True, False)),
            (_fill_fp8, (cache_ptr, idx_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, WIDTH,
                         CHUNK, FP8_BY_BITS)) if FP8 else
            (_fill_async, (cache_ptr, idx_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, WIDTH,
                           CHUNK)),
        ],
        [4, 4],
        [RIGHT_REGS, FILL_REGS],
    )  # fmt: skip


def declines(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, kv_lora_rank: int, kv_format: str):
    """Why this kernel cannot serve the call, or None where it can: an SM90 GPU, bf16 queries with unit stride in
    their last dim, latent 512 and rope 64, at least 64 heads, a bf16 or fp8_ds_mla cache starting 16-byte aligned,
    and a list with unit stride."""
    if not on_hopper(q):
        return "q is not on an SM90 (Hopper) GPU"
    if kv_format not in ("bf16", "fp8_ds_mla"):
        return f"kv_format {kv_format!r} is not bf16 or fp8_ds_mla"
    if q.dtype != torch.bfloat16 or q.stride(2) != 1:
        return f"q is {q.dtype} with stride {q.stride(2)} in its last dim, expected bf16 with stride 1"
    if kv_lora_rank != L.value or q.shape[2] != L.value + R.value:
        return f"latent {kv_lora_rank} and rope {q.shape[2] - kv_lora_rank}, expected {L.value} and {R.value}"
    if q.shape[1] < BLOCK_H.value:
        return f"{q.shape[1]} heads < {BLOCK_H.value}"
    if indices.stride(1) != 1:
        return f"indices' stride {indices.stride(1)} in its last dim, expected 1"
    if kv_cache.data_ptr() % 16:
        return "the cache does not start 16-byte aligned (its records are copied 16 bytes at a time)"
    return None


def launch(q, kv_cache, indices, part_out, part_lse, softmax_scale, fp8: bool, split: int, n_splits: int) -> None:
    """Fills ``part_out`` / ``part_lse`` as ``_sparse_split_kernel``'s contract says (the op's out and lse where
    ``n_splits`` is 1)."""
    tokens, heads, _ = q.shape
    records = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[2])
    _sparse_split_kernel[(tokens, -(-heads // BLOCK_H.value), n_splits)](
        q, records, indices, part_out, part_lse, softmax_scale, heads, indices.shape[1],
        q.stride(0), q.stride(1), indices.stride(0), n_splits,
        WIDTH=records.shape[1], SPLIT=split, FP8=fp8, CHUNK=CHUNK,
        RIGHT_REGS=RIGHT_REGS, FILL_REGS=FILL_REGS, DIRECT=n_splits == 1, FP8_BY_BITS=FP8_BY_BITS,
        num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
