"""``mla_decode``'s split kernel for Hopper (SM90) in Gluon, Triton's lower-level language: a bf16 or fp8_ds_mla cache,
latent 512, rope 64, pages of a multiple of 64 tokens, at least 64 heads. ``attention.mla_decode`` launches it in place
of its ``tl`` split kernel where ``takes`` says so; the partial outputs, the splits and the merge are the same.

Why a second kernel: with 64 heads per program and two warpgroups, Triton's ``tl`` gives both warpgroups the same rows
of the chained products, so both compute the same scores (112 instead of 73 GFLOP issued at B=64, ctx 4096).
Here the warpgroups have different jobs (``gl.warp_specialize``), FlashMLA's division of the work:

- the first computes S = Q K^T of a 64-token block, its softmax, hands P and the row rescale factor to the second
  through shared memory, multiplies P by the left half of the latent, and (bf16 cache) refills that half of the
  block's stage by TMA as soon as it is done with it;
- the second multiplies each P by the right half of the latent, then (bf16 cache) refills the right half and the
  rope part of the stage (S of the block was done before P existed): they land first, and S of a block starts on
  them;
- with an fp8_ds_mla cache, a third fills the stages: it loads the e4m3 latent and its scales by pointer a few tokens
  at a time, stores it dequantised to bf16, and brings the rope part (bf16 already) by TMA.

Where the grid would leave SMs idle (a few rows, or batch-invariant mode's fixed spans), each (row, heads, span) gets
two programs instead: both compute S and the softmax, and the second warpgroup of each multiplies P by one of the
two latent halves (``HALVES``; the same bits as one program). In batch-invariant mode a few rows take three other
kernels instead: the scores of every block first, then every block's softmax, then P x V (``launch_scores_first``,
the same bits again).

The query (64 x 576) and two stages of 64 cached tokens in bf16 fill the shared memory (one program per SM), which
leaves no room for a raw fp8 stage. With a bf16 cache whole blocks come by TMA copies and the last, partial block of a
span is gathered by pointer with zeros past the span. Measured on the H200 beside the ``tl`` kernel:
benchmarks/NOTES.md, mla_decode: 2026-12-01 — a warp-specialized Gluon mla_decode; the fp8_ds_mla cache in the Gluon
kernel.
"""

from __future__ import annotations

import torch
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

from deepinfer.kv_cache import FP8_GROUP, fp8_ds_mla_offsets

from ._gluon import BARRIER, TMA_LOAD, TMA_STORE, launch_dependents, plain_rows, tma_descriptor, wait_previous
from ._triton import PDL, hopper, num_sms

BLOCK_H, BLOCK_N, L, R, LH = (gl.constexpr(v) for v in (64, 64, 512, 64, 256))  # heads, tokens, latent, rope, half
LOG2E = gl.constexpr(1.4426950408889634)
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
RIGHT_REGS = 192  # registers per thread of the second warpgroup (its [64, 256] fp32 accumulator takes 128)
GROUP = gl.constexpr(FP8_GROUP)  # fp8_ds_mla latent columns per scale
# the rope part's first column in an fp8_ds_mla record (after the e4m3 latent and its fp32 scales), bf16 units
ROPE_AT = gl.constexpr(fp8_ds_mla_offsets(L.value)[1] // 2)
# fp8_ds_mla: a third warpgroup dequantises the cache, CHUNK tokens at a time (loads two chunks ahead of the stores).
# Registers per thread of the second and the third warpgroup; the first gets the rest of 512 (224).
FP8_CHUNK, FP8_RIGHT_REGS, FP8_FILL_REGS = 8, 160, 120
# The first warpgroup lets a stage be refilled once its P x V of the block is done, with S of the next block still on
# the tensor cores, rather than after both: the refill (the left half by TMA, or the whole stage by the fp8_ds_mla
# filler once the second warpgroup is done too) gets S's time to land.
EARLY_RELEASE = True
# fp8_ds_mla: e4m3 bytes become bf16 by integer operations and two bf16 multiplies (``_e4m3_times_scale``) rather
# than through fp32 by conversion instructions: the same bits, 1.02-1.05x faster on an H100 (benchmarks/NOTES.md,
# sparse attention: 2026-12-07). The sparse kernel has a switch of its own (``sparse_mla_gluon.FP8_BY_BITS``).
FP8_BY_BITS = True
# ``_e4m3_times_scale``'s factors: the bits' 2^-120 undone, and the scale split at 2^7 so that neither factor overflows
TWO_POW_120 = gl.constexpr(2.0**120)
SCALE_SPLIT, INV_SCALE_SPLIT = gl.constexpr(128.0), gl.constexpr(1 / 128)


@gluon.jit
def _visible_limit(seq_lens_ptr, row, S_q):
    """Query row ``row`` (``S_q`` per sequence, the last one newest) sees the context positions below this: its
    sequence's length less the query rows after it."""
    return gl.load(seq_lens_ptr + row // S_q) - S_q + row % S_q + 1


@gluon.jit
def _block_row(table_row, start, j, below, PAGE: gl.constexpr):
    """The cache row of block ``j``'s first token (tokens ``start + 64 j + [0, 64)`` lie in one page) if ``j < below``
    (else the table is not read), for one block or a tensor of them: the loops load it ahead of their copies."""
    n0 = start + j * BLOCK_N
    return gl.load(table_row + n0 // PAGE, mask=j < below, other=0) * PAGE + n0 % PAGE


@gluon.jit
def _load_left(lat_desc, left_ready, c0_s, stage, row, pred):
    """TMA copy of a block's left latent half (cache row ``row`` on) into ``stage``, if ``pred``."""
    mbarrier.expect(left_ready.index(stage), lat_desc.block_type.nbytes, pred=pred)
    TMA_LOAD(lat_desc, [row, 0], left_ready.index(stage), c0_s.index(stage), pred=pred)


@gluon.jit
def _load_right(lat_desc, rope_desc, right_ready, c1_s, kr_s, stage, row, pred):
    """TMA copies of a block's right latent half and rope part into ``stage``, if ``pred``."""
    nbytes: gl.constexpr = lat_desc.block_type.nbytes + rope_desc.block_type.nbytes
    mbarrier.expect(right_ready.index(stage), nbytes, pred=pred)
    TMA_LOAD(lat_desc, [row, LH], right_ready.index(stage), c1_s.index(stage), pred=pred)
    TMA_LOAD(rope_desc, [row, L], right_ready.index(stage), kr_s.index(stage), pred=pred)


@gluon.jit
def _gather_block(cache_ptr, table_row, n0, end, c0_s, c1_s, kr_s, stage, PAGE: gl.constexpr, WIDTH: gl.constexpr):
    """Tokens ``n0 + [0, 64)`` of a span gathered by pointer into ``stage``, zeros at and past ``end`` (the cache past a
    sequence may hold NaN, which P x V must not see). 16 tokens at a time: products in flight hold most registers."""
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
    BARRIER()


@gluon.jit
def _fp8_chunk(cache_ptr, page, n0, end, PAGE: gl.constexpr, WIDTH: gl.constexpr, CHUNK: gl.constexpr):
    """The latent of tokens ``n0 + [0, CHUNK)`` of an fp8_ds_mla span, in cache page ``page``, as stored, zeros at and
    past ``end``: the two halves' e4m3 bytes and the four 128-column scales."""
    lat: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [gl.num_warps(), 1], [1, 0])
    first = cache_ptr + (page.to(gl.int64) * PAGE + n0 % PAGE) * WIDTH  # the chunk's first record
    tokens = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, lat))
    valid = n0 + tokens < end
    record = first + tokens * WIDTH
    at = gl.expand_dims(record, 1) + gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, lat)), 0)
    c0 = gl.load(at, mask=gl.expand_dims(valid, 1), other=0)
    c1 = gl.load(at + LH, mask=gl.expand_dims(valid, 1), other=0)
    scales = (record + L).to(gl.pointer_type(gl.float32), bitcast=True)
    s0 = gl.load(scales, mask=valid, other=0.0)
    s1 = gl.load(scales + 1, mask=valid, other=0.0)
    s2 = gl.load(scales + 2, mask=valid, other=0.0)
    s3 = gl.load(scales + 3, mask=valid, other=0.0)
    return c0, c1, s0, s1, s2, s3


# ``_e4m3_bits`` for four bytes in $2: bytes 0-1 into $0, 2-3 into $1, each byte below a copy of its sign bit
# (``prmt``'s sign-replicating selectors 8-b), shifted left by 4 and masked to bf16's sign, low 4 exponent bits and
# top 3 mantissa bits.
E4M3_BITS_ASM = gl.constexpr("""{
    .reg .b32 lo, hi;
    prmt.b32 lo, $2, 0, 0x9180;
    prmt.b32 hi, $2, 0, 0xb3a2;
    shl.b32 lo, lo, 4;
    shl.b32 hi, hi, 4;
    and.b32 $0, lo, 0x87f087f0;
    and.b32 $1, hi, 0x87f087f0;
}""")


@gluon.jit
def _e4m3_bits(raw):
    """Each e4m3 byte of ``raw`` (uint8) as the bf16 of its value times 2^-120, exactly: an e4m3 exponent field is
    bf16's less 120 and e4m3 subnormals become bf16 subnormals, so the sign goes to bit 15 and the other seven bits
    move up by 4. Six integer operations per four bytes. The e4m3 NaN pattern becomes a finite number (the cache
    never holds one)."""
    return gl.inline_asm_elementwise(E4M3_BITS_ASM, "=r,=r,r", [raw], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _e4m3_times_scale(raw, s_lo, s_hi):
    """``_dequantize_half`` by ``_e4m3_bits`` and two bf16 multiplies per value: by min(scale, 2^7) x 2^120, then by
    max(scale / 2^7, 1), each factor exact (the scales are powers of two) and neither overflowing, so every product
    is exact where the fp32 route's is."""
    first = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, raw.type.layout)), 0) < GROUP
    a_lo = gl.expand_dims((gl.minimum(s_lo, SCALE_SPLIT) * TWO_POW_120).to(gl.bfloat16), 1)
    a_hi = gl.expand_dims((gl.minimum(s_hi, SCALE_SPLIT) * TWO_POW_120).to(gl.bfloat16), 1)
    b_lo = gl.expand_dims(gl.maximum(s_lo * INV_SCALE_SPLIT, 1.0).to(gl.bfloat16), 1)
    b_hi = gl.expand_dims(gl.maximum(s_hi * INV_SCALE_SPLIT, 1.0).to(gl.bfloat16), 1)
    return _e4m3_bits(raw) * gl.where(first, a_lo, a_hi) * gl.where(first, b_lo, b_hi)


@gluon.jit
def _dequantize_half(raw, s_lo, s_hi, BY_BITS: gl.constexpr):
    """e4m3 bytes [CHUNK, 256] (two 128-column groups) times their groups' scales, as bf16 (``BY_BITS``: by
    ``_e4m3_times_scale``, the same bits)."""
    if BY_BITS:
        return _e4m3_times_scale(raw, s_lo, s_hi)
    else:
        first = gl.expand_dims(gl.arange(0, LH, layout=gl.SliceLayout(0, raw.type.layout)), 0) < GROUP
        scale = gl.where(first, gl.expand_dims(s_lo, 1), gl.expand_dims(s_hi, 1))
        return (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale).to(gl.bfloat16)


@gluon.jit
def _store_chunk(chunk, c0_s, c1_s, stage, r, BY_BITS: gl.constexpr):
    """A chunk from ``_fp8_chunk``, dequantised, into rows ``r + [0, CHUNK)`` of ``stage``."""
    c0, c1, s0, s1, s2, s3 = chunk
    c0_s.index(stage).slice(r, c0.shape[0]).store(_dequantize_half(c0, s0, s1, BY_BITS))
    c1_s.index(stage).slice(r, c0.shape[0]).store(_dequantize_half(c1, s2, s3, BY_BITS))


@gluon.jit
def _dequantize_fp8(cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free,
                    PAGE: gl.constexpr, WIDTH: gl.constexpr, CHUNK: gl.constexpr, BY_BITS: gl.constexpr):  # fmt: skip
    """The third warpgroup, for an fp8_ds_mla cache: each block of the span into its stage once both other warpgroups
    are done with the stage's previous block, the latent dequantised to bf16 (zeros past the span), the rope part
    (bf16 already) by a TMA copy. Loads run two chunks ahead of the stores (registers hold three chunks), so that
    their latency overlaps the stores and the wait for a free stage."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    # a block lies in one page: its page number is loaded two blocks ahead, off the loads' critical path
    page = gl.load(table_row + start // PAGE)
    page_next = gl.load(table_row + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < end, other=0)
    now = _fp8_chunk(cache_ptr, page, start, end, PAGE, WIDTH, CHUNK)
    ahead = _fp8_chunk(cache_ptr, page, start + CHUNK, end, PAGE, WIDTH, CHUNK)
    for i2 in range(0, n_blocks, 2):  # two blocks per iteration: each stage's index is then known when compiling
        for stage in gl.static_range(2):
            i = i2 + stage
            if i < n_blocks:
                page, page_next, now, ahead = _fill_stage(
                    cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free,
                    i, stage, page, page_next, now, ahead, PAGE, WIDTH, CHUNK, BY_BITS,
                )  # fmt: skip


@gluon.jit
def _fill_stage(cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, i,
                stage: gl.constexpr, page, page_next, now, ahead, PAGE: gl.constexpr, WIDTH: gl.constexpr,
                CHUNK: gl.constexpr, BY_BITS: gl.constexpr):  # fmt: skip
    """Block ``i`` of the span (in page ``page``) into ``stage``, with the chunks ``now`` and ``ahead`` already loaded;
    returns the next block's and the one after's pages and their first two chunks."""
    n0 = start + i * BLOCK_N
    page_after = gl.load(table_row + (n0 + 2 * BLOCK_N) // PAGE, mask=n0 + 2 * BLOCK_N < end, other=0)
    mbarrier.wait(kv_free.index(stage), ((i // 2) & 1) ^ 1)
    mbarrier.expect(right_ready.index(stage), rope_desc.block_type.nbytes)  # one of right_ready's two arrivals
    TMA_LOAD(rope_desc, [page * PAGE + n0 % PAGE, ROPE_AT], right_ready.index(stage), kr_s.index(stage))
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        if r + 2 * CHUNK < BLOCK_N:
            nxt = _fp8_chunk(cache_ptr, page, n0 + r + 2 * CHUNK, end, PAGE, WIDTH, CHUNK)
        else:
            nxt = _fp8_chunk(cache_ptr, page_next, n0 + r + 2 * CHUNK, end, PAGE, WIDTH, CHUNK)
        _store_chunk(now, c0_s, c1_s, stage, r, BY_BITS)
        now = ahead
        ahead = nxt
    fence_async_shared()
    mbarrier.arrive(right_ready.index(stage), count=1)
    mbarrier.arrive(left_ready.index(stage), count=1)
    return page_next, page_after, now, ahead


@gluon.jit
def _query_to_smem(q_ptr, b, s, pid_h, H, stride_qb, stride_qs, stride_qh, at_once: gl.constexpr = False):
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
    if at_once:  # both halves' loads in flight together (128 registers per thread)
        q0 = gl.load(q_row + cols, mask=hmask, other=0.0)
        q1 = gl.load(q_row + LH + cols, mask=hmask, other=0.0)
        q0_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, q0)
        q_rope = gl.load(q_row + L + rope_cols, mask=hmask, other=0.0)
        q1_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, q1)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], rope_layout, q_rope)
    else:  # one part at a time, for kernels that cannot spare the registers
        q0 = gl.load(q_row + cols, mask=hmask, other=0.0)
        q0_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, q0)
        q1 = gl.load(q_row + LH + cols, mask=hmask, other=0.0)
        q1_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, LH], half_layout, q1)
        q_rope = gl.load(q_row + L + rope_cols, mask=hmask, other=0.0)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, R], rope_layout, q_rope)
    return q0_s, q1_s, qr_s


@gluon.jit
def _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, j, wait):
    """Issues S = Q K^T of block ``j`` (in stage ``j % 2``) asynchronously: the right latent half and the rope part
    first, then the left half, each once its copy has landed (``wait``; else the stage is filled already)."""
    stage = j % 2
    phase = (j // 2) & 1
    if wait:
        mbarrier.wait(right_ready.index(stage), phase)
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT)
    s = warpgroup_mma(q1_s, c1_s.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma(qr_s, kr_s.index(stage).permute((1, 0)), s, is_async=True)
    if wait:
        mbarrier.wait(left_ready.index(stage), phase)
    return warpgroup_mma(q0_s, c0_s.index(stage).permute((1, 0)), s, is_async=True)


@gluon.jit
def _part_rows(row, pid_h, split, H, n_splits, layout: gl.constexpr):
    """Rows of the partial outputs that this program's heads write, and which heads exist (in ``layout``'s rows)."""
    heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    return (row.to(gl.int64) * H + heads) * n_splits + split, heads < H


@gluon.jit
def _store_columns(part_out_ptr, o, inv_l, part, hmask, col0):
    """``o`` [64, W] times ``inv_l`` as columns ``col0 + [0, W)`` of the program's rows of ``part_out``, in its dtype
    (the bf16 output itself when the span is the whole context)."""
    cols = gl.expand_dims(gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o.type.layout)), 0)
    gl.store(part_out_ptr + gl.expand_dims(part * L + col0, 1) + cols, (o * inv_l).to(part_out_ptr.dtype.element_ty),
             mask=gl.expand_dims(hmask, 1))  # fmt: skip


@gluon.jit
def _empty_span(part_out_ptr, part_lse_ptr, row, pid_h, split, H, n_splits, DIRECT: gl.constexpr):
    """A span with no visible token: lse -inf, and (``DIRECT``: no merge follows) zeros in the output's rows."""
    part, hmask = _part_rows(row, pid_h, split, H, n_splits, O_LAYOUT)
    empty = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, O_LAYOUT))
    gl.store(part_lse_ptr + part, empty, mask=hmask)
    if DIRECT:
        rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        heads = pid_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, rows))
        at = part_out_ptr + gl.expand_dims((row.to(gl.int64) * H + heads) * L, 1)
        cols = gl.expand_dims(gl.arange(0, L, layout=gl.SliceLayout(0, rows)), 0)
        zeros = gl.zeros([BLOCK_H, L], part_out_ptr.dtype.element_ty, rows)
        gl.store(at + cols, zeros, mask=gl.expand_dims(heads < H, 1))


@gluon.jit
def _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr, table_row, start, end, j,
                  full, PAGE: gl.constexpr, WIDTH: gl.constexpr, FP8: gl.constexpr):  # fmt: skip
    """S of block ``j``, issued once the block is in its stage: its TMA copies or (``FP8``) its dequantisation waited
    for, or a bf16 cache's partial last block gathered first (the stage held block j - 2, whose consumers are done)."""
    wait = True  # for the filler's stores (fp8_ds_mla) or the copies of a whole block
    if not FP8:
        wait = j < full
        if not wait:
            _gather_block(cache_ptr, table_row, start + j * BLOCK_N, end, c0_s, c1_s, kr_s, j % 2, PAGE, WIDTH)
    return _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, j, wait)


@gluon.jit
def _scaled_scores(s, visible, qk_scale):
    """S [64 heads, 64 tokens] (unscaled) in the exp2 domain, -inf at the tokens not ``visible``."""
    return gl.where(gl.expand_dims(visible, 0), s * qk_scale, float("-inf"))


@gluon.jit
def _probs(s, m_i, m_new):
    """P of scaled scores against the new running max, and the rescale factor of what came before."""
    return gl.exp2(s - gl.expand_dims(m_new, 1)), gl.exp2(m_i - m_new)


@gluon.jit
def _softmax_step(s, visible, qk_scale, m_i, l_i):
    """One block of the online softmax: S [64 heads, 64 tokens] (unscaled; ``visible``: its tokens inside the span)
    against the running max and sum (exp2 domain); returns P, the rescale factor of what came before, the new max and
    the new sum."""
    s = _scaled_scores(s, visible, qk_scale)
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p, alpha = _probs(s, m_i, m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _release_left(lat_desc, left_ready, kv_free, c0_s, stage, refill_row, refill, FP8: gl.constexpr):
    """The first warpgroup is done with the stage's left half: block i + 2's comes now (bf16), or the filler may
    take the stage once the second warpgroup is done too (fp8_ds_mla)."""
    if FP8:
        mbarrier.arrive(kv_free.index(stage), count=1)
    else:
        _load_left(lat_desc, left_ready, c0_s, stage, refill_row, refill)


@gluon.jit
def _scores_softmax_left(
    q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, right_ready, left_ready, kv_free, p_ready, p_free, lat_desc,
    cache_ptr, table_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h, split, H, n_splits,
    PAGE: gl.constexpr, WIDTH: gl.constexpr, FP8: gl.constexpr, HALVES: gl.constexpr, EARLY_RELEASE: gl.constexpr,
):  # fmt: skip
    """The first warpgroup. Block i: softmax of S_i; P_i and its row factor published to the second warpgroup;
    P_i x V_i[:, :256] issued and S_{i+1} behind it; once P_i x V_i is done (``EARLY_RELEASE``; else once S_{i+1} is
    too), with a bf16 cache the stage's left half refilled with block i + 2 (the second warpgroup refills the rest),
    with fp8_ds_mla the stage released to the third warpgroup, which fills every stage. At the end, 1 / l for the
    second warpgroup, then this half of the output and the lse. With ``HALVES`` P x V is all the second warpgroup's,
    and so are the refills: this one only computes S, the softmax and the lse."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    full = (end - start) // BLOCK_N  # whole blocks: a span starts on a block boundary, a block lies in one page
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([BLOCK_H, LH], gl.float32, O_LAYOUT)
    s = _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr, table_row, start, end,
                      0, full, PAGE, WIDTH, FP8)  # fmt: skip
    s = warpgroup_mma_wait(0, deps=[s])
    for i in range(n_blocks):
        stage = i % 2
        refill_row = 0
        if not FP8 and not HALVES:
            refill_row = _block_row(table_row, start, i + 2, full, PAGE)  # loaded early, used after the products
        p, alpha, m_i, l_i = _softmax_step(s, start + i * BLOCK_N + tokens < end, qk_scale, m_i, l_i)
        mbarrier.wait(p_free, (i & 1) ^ 1)  # the second warpgroup is done with P_{i-1}
        p_s.store(p.to(gl.bfloat16))
        a_s.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        nxt = i + 1
        if HALVES:
            if nxt < n_blocks:
                s = _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr, table_row,
                                  start, end, nxt, full, PAGE, WIDTH, FP8)  # fmt: skip
                s = warpgroup_mma_wait(0, deps=[s])
            if FP8:
                mbarrier.arrive(kv_free.index(stage), count=1)
        else:
            alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
            pv = warpgroup_mma(p_s, c0_s.index(stage), o * alpha_o, is_async=True)
            if nxt < n_blocks:
                s_next = _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr,
                                       table_row, start, end, nxt, full, PAGE, WIDTH, FP8)  # fmt: skip
                if EARLY_RELEASE:
                    o = warpgroup_mma_wait(3, deps=[pv])
                    _release_left(lat_desc, left_ready, kv_free, c0_s, stage, refill_row, i + 2 < full, FP8)
                    s = warpgroup_mma_wait(0, deps=[s_next])
                else:
                    o, s = warpgroup_mma_wait(0, deps=[pv, s_next])
                    _release_left(lat_desc, left_ready, kv_free, c0_s, stage, refill_row, i + 2 < full, FP8)
            else:
                o = warpgroup_mma_wait(0, deps=[pv])
                _release_left(lat_desc, left_ready, kv_free, c0_s, stage, refill_row, i + 2 < full, FP8)
    mbarrier.wait(p_free, (n_blocks & 1) ^ 1)
    a_s.store(1.0 / l_i)
    mbarrier.arrive(p_ready, count=1)

    part, hmask = _part_rows(row, pid_h, split, H, n_splits, O_LAYOUT)
    if not HALVES:
        inv_l = gl.expand_dims(gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, O_LAYOUT)), 1)
        _store_columns(part_out_ptr, o, inv_l, part, hmask, 0)
    lse = (m_i + gl.log2(l_i)) / LOG2E  # natural log (with HALVES both programs store the same values)
    gl.store(part_lse_ptr + part, gl.convert_layout(lse, gl.SliceLayout(1, O_LAYOUT)), mask=hmask)


@gluon.jit
def _right(p_s, a_s, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, p_ready, p_free, lat_desc, rope_desc,
           table_row, part_out_ptr, start, end, row, pid_h, half, split, H, n_splits, PAGE: gl.constexpr,
           FP8: gl.constexpr, HALVES: gl.constexpr):  # fmt: skip
    """The second warpgroup: P_i x V_i[:, 256:] for each block once P_i and its row factor are published; then, with a
    bf16 cache, the stage's right half and rope part refilled with block i + 2 (S_i is done before P_i exists). At
    the end, this half of the output scaled by the 1 / l the first warpgroup publishes last. With ``HALVES``: latent
    half ``half`` instead of the right one, and the whole stage refilled."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    full = (end - start) // BLOCK_N
    o = gl.zeros([BLOCK_H, LH], gl.float32, O_LAYOUT)
    for i in range(n_blocks):
        if not FP8:
            refill_row = _block_row(table_row, start, i + 2, full, PAGE)
        mbarrier.wait(p_ready, i & 1)
        alpha = gl.expand_dims(a_s.load(gl.SliceLayout(1, O_LAYOUT)), 1)
        if not HALVES:
            o = warpgroup_mma(p_s, c1_s.index(i % 2), o * alpha)
        elif half == 0:
            o = warpgroup_mma(p_s, c0_s.index(i % 2), o * alpha)
        else:
            o = warpgroup_mma(p_s, c1_s.index(i % 2), o * alpha)
        mbarrier.arrive(p_free, count=1)
        if FP8:
            mbarrier.arrive(kv_free.index(i % 2), count=1)
        else:
            _load_right(lat_desc, rope_desc, right_ready, c1_s, kr_s, i % 2, refill_row, i + 2 < full)
            if HALVES:
                _load_left(lat_desc, left_ready, c0_s, i % 2, refill_row, i + 2 < full)
    mbarrier.wait(p_ready, n_blocks & 1)
    inv_l = gl.expand_dims(a_s.load(gl.SliceLayout(1, O_LAYOUT)), 1)
    part, hmask = _part_rows(row, pid_h, split, H, n_splits, O_LAYOUT)
    _store_columns(part_out_ptr, o, inv_l, part, hmask, half * LH)


@gluon.jit
def _mla_split_kernel(
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
    span,
    PAGE: gl.constexpr,
    WIDTH: gl.constexpr,
    FP8: gl.constexpr,
    RIGHT_REGS: gl.constexpr,
    FILL_REGS: gl.constexpr,
    CHUNK: gl.constexpr,
    DIRECT: gl.constexpr,
    HALVES: gl.constexpr,
    EARLY_RELEASE: gl.constexpr,
    FP8_BY_BITS: gl.constexpr,
):
    """``attention._mla_split_kernel``'s contract (one (query row, 64 heads, KV split) per program). Launched with 4
    warps, to which the second warpgroup adds 4, and with ``FP8`` (an fp8_ds_mla cache at ``cache_ptr``, bytes;
    ``lat_desc`` None, ``rope_desc`` over the records seen as bf16) the third 4 more. ``DIRECT``: one split covers
    the context, and ``part_out`` / ``part_lse`` are the output and lse themselves (zeros where nothing is visible).
    ``HALVES``: twice the programs along the heads' axis, each pair of programs the same heads, each program's P x V
    one latent half, done by its second warpgroup (program ``2 h + c``: heads block ``h``, columns ``256 c + [0,
    256)``). Both compute the same S and softmax, and each output column comes from the same instructions on the same
    data as without ``HALVES``: the same bits. It frees the tensor cores of half of P x V where the grid leaves SMs
    idle."""
    row = gl.program_id(0)
    if HALVES:  # two programs per head block, one per latent half of P x V
        pid_h = gl.program_id(1) // 2
        half = gl.program_id(1) % 2
    else:
        pid_h = gl.program_id(1)
        half = 1  # the right one, the second warpgroup's
    split = gl.program_id(2)
    b = row // S_q
    s = row % S_q
    limit = _visible_limit(seq_lens_ptr, row, S_q)
    start = split * span
    end = gl.minimum(start + span, limit)
    if start >= end:
        _empty_span(part_out_ptr, part_lse_ptr, row, pid_h, split, H, n_splits, DIRECT)
        return

    q0_s, q1_s, qr_s = _query_to_smem(q_ptr, b, s, pid_h, H, stride_qb, stride_qs, stride_qh)
    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LH], gl.bfloat16)
    rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.bfloat16)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], rope_layout)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], kr_s.layout)
    a_s = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # a stage's right half and rope part landed / its left half landed / (fp8_ds_mla) its consumers are done with it
    right_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    left_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # P and its factor published
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # second warpgroup done with P
    for i in gl.static_range(2):
        mbarrier.init(right_ready.index(i), count=2 if FP8 else 1)  # fp8: the rope's copy and the latent's stores
        mbarrier.init(left_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)  # fp8 only: both warpgroups release it
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)

    table_row = table_ptr + b.to(gl.int64) * stride_table
    if not FP8:
        full = (end - start) // BLOCK_N
        for i in gl.static_range(2):
            first = _block_row(table_row, start, i, full, PAGE)
            _load_right(lat_desc, rope_desc, right_ready, c1_s, kr_s, i, first, i < full)
            _load_left(lat_desc, left_ready, c0_s, i, first, i < full)
    fence_async_shared()
    BARRIER()  # the query's stores are visible to the tensor cores
    qk_scale = scale * LOG2E  # exp2 domain
    # the argument tuples are written out in each call: a tuple assigned to a name loses its constexprs
    if FP8:
        gl.warp_specialize(
            [
                (_scores_softmax_left,
                 (q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, right_ready, left_ready, kv_free, p_ready, p_free,
                  lat_desc, cache_ptr, table_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h,
                  split, H, n_splits, PAGE, WIDTH, FP8, HALVES, EARLY_RELEASE)),
                (_right, (p_s, a_s, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, p_ready, p_free, lat_desc,
                          rope_desc, table_row, part_out_ptr, start, end, row, pid_h, half, split, H, n_splits, PAGE,
                          FP8, HALVES)),
                (_dequantize_fp8, (cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready,
                                   left_ready, kv_free, PAGE, WIDTH, CHUNK, FP8_BY_BITS)),
            ],
            [4, 4],
            [RIGHT_REGS, FILL_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_scores_softmax_left,
                 (q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, p_s, a_s, right_ready, left_ready, kv_free, p_ready, p_free,
                  lat_desc, cache_ptr, table_row, start, end, qk_scale, part_out_ptr, part_lse_ptr, row, pid_h,
                  split, H, n_splits, PAGE, WIDTH, FP8, HALVES, EARLY_RELEASE)),
                (_right, (p_s, a_s, c0_s, c1_s, kr_s, right_ready, left_ready, kv_free, p_ready, p_free, lat_desc,
                          rope_desc, table_row, part_out_ptr, start, end, row, pid_h, half, split, H, n_splits, PAGE,
                          FP8, HALVES)),
            ],
            [4],
            [RIGHT_REGS],
        )  # fmt: skip


# --- scores first: batch-invariant mode at a few rows -----------------------------------------------------------

# Batch-invariant mode's spans are 2048 tokens, which leaves most SMs idle at a few rows, and each program's serial
# chain is mostly S = Q K^T of its 32 blocks. Here three kernels replace the split kernel, and only the last has a
# chain over the blocks:
# - scores: S of every block (as ``_scores`` does: the same bits) and each block's row maxima, over chunks of the
#   context in parallel (with fp8_ds_mla, also a bf16 copy of the dequantised latent);
# - probs: each block's P against the running max, which the maxima give without the chain (a max is exact in any
#   order), its row factor and row sums, one block per program;
# - values: P x V and the running sum of each span in the split kernel's order, one latent part per program (8 parts
#   while the grid fits the SMs once, else 4), VALUES_STAGES blocks in flight.
# The arithmetic is the split kernel's on the same values: the same bits.
SCORES_TOKENS = 512  # the scores kernel's largest chunk (``scores_tokens``)
SCORES_FP8_CHUNK = 16  # fp8_ds_mla: tokens per dequantising step of the scores kernel
VALUES_STAGES, VALUES_FILL_REGS = 4, 96  # the values kernel's stages, its filling warpgroup's registers per thread
SCORES_FIRST_PDL = PDL  # the probs and values kernels launched early, each waiting for the one before


@gluon.jit
def _mla_scores_kernel(
    q_ptr,
    lat_desc,
    rope_desc,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    scores_ptr,
    maxima_ptr,
    latent_desc,
    scale,
    S_q,
    H,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_table,
    reach,
    PAGE: gl.constexpr,
    WIDTH: gl.constexpr,
    TOKENS: gl.constexpr,
    FP8: gl.constexpr,
    CHUNK: gl.constexpr,
    PDL: gl.constexpr,
    FP8_BY_BITS: gl.constexpr,
):
    """S = Q K^T (fp32, unscaled) of one (query row, 64 heads, ``TOKENS`` context tokens) per program: each visible
    64-token block's [64 heads, 64 tokens] tile at ``scores[row, head block, block]`` (row-major tiles; a partial last
    block's columns past the sequence hold S of zeros), and each head's max of S times ``scale`` (in the exp2 domain)
    over the block's visible tokens at ``maxima[row, head block, block]``: a max is exact in any order, so these are
    the split kernel's. Blocks past the sequence are not written. ``FP8``: an
    fp8_ds_mla cache (``cache_ptr`` bytes, ``lat_desc`` None), each block dequantised into its stage ``CHUNK`` tokens
    at a time, as the split kernel's third warpgroup does, while the block before is multiplied; the programs of the
    first head block and the last query row of each sequence also copy the dequantised latent to ``latent_desc``
    ([batch x ``reach``, 512] bf16, zeros past the sequence) for ``_mla_values_kernel``. ``PDL``: the probs kernel may
    launch at once (and waits for this one to finish)."""
    launch_dependents(PDL)
    row = gl.program_id(0)
    pid_h = gl.program_id(1)
    chunk = gl.program_id(2)
    b = row // S_q
    limit = _visible_limit(seq_lens_ptr, row, S_q)
    start = chunk * TOKENS
    end = gl.minimum(start + TOKENS, limit)
    if start >= end:
        return
    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LH], gl.bfloat16)
    rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], gl.bfloat16)
    c0_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    c1_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, LH], half_layout)
    kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, R], rope_layout)
    right_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    left_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(right_ready.index(i), count=1)
        mbarrier.init(left_ready.index(i), count=1)
    table_row = table_ptr + b.to(gl.int64) * stride_table
    full = (end - start) // BLOCK_N
    if FP8:
        _dequantize_block(cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready, 0, PAGE, WIDTH,
                          CHUNK, FP8_BY_BITS)  # fmt: skip
    else:
        for i in gl.static_range(2):
            first = _block_row(table_row, start, i, full, PAGE)
            _load_right(lat_desc, rope_desc, right_ready, c1_s, kr_s, i, first, i < full)
            _load_left(lat_desc, left_ready, c0_s, i, first, i < full)
    # the query's loads run under the first copies (fp8_ds_mla: both halves at once, 1-4% faster on the H200; a bf16
    # cache's two products in flight leave no registers for it)
    q0_s, q1_s, qr_s = _query_to_smem(q_ptr, b, row % S_q, pid_h, H, stride_qb, stride_qs, stride_qh, at_once=FP8)
    fence_async_shared()
    BARRIER()  # the query's stores are visible to the tensor cores

    blocks = gl.num_programs(2) * (TOKENS // BLOCK_N)  # blocks of the context, per (row, head block)
    first_block = (row.to(gl.int64) * gl.num_programs(1) + pid_h) * blocks + start // BLOCK_N
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    qk_scale = scale * LOG2E
    if FP8:
        writer = (pid_h == 0) & (row % S_q == S_q - 1)  # the row that sees the whole sequence
        for j in range(n_blocks):
            mbarrier.wait(right_ready.index(j % 2), (j // 2) & 1)  # the rope part's copy
            scores = _scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, j, False)
            if writer:
                at = b * reach + start + j * BLOCK_N
                TMA_STORE(latent_desc, [at, 0], c0_s.index(j % 2))
                TMA_STORE(latent_desc, [at, LH], c1_s.index(j % 2))
            if j + 1 < n_blocks:  # the other stage held block j - 1, whose product is done
                tma.store_wait(2)  # and whose copies are done
                _dequantize_block(cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, right_ready, j + 1,
                                  PAGE, WIDTH, CHUNK, FP8_BY_BITS)  # fmt: skip
            scores = warpgroup_mma_wait(0, deps=[scores])
            _store_block_scores(scores, scores_ptr, maxima_ptr, first_block + j, start + j * BLOCK_N, end, qk_scale)
        tma.store_wait(0)
    else:
        ahead = _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr, table_row,
                              start, end, 0, full, PAGE, WIDTH, False)  # fmt: skip
        for j in range(n_blocks):
            scores = warpgroup_mma_wait(0, deps=[ahead])
            refill = _block_row(table_row, start, j + 2, full, PAGE)
            _load_right(lat_desc, rope_desc, right_ready, c1_s, kr_s, j % 2, refill, j + 2 < full)
            _load_left(lat_desc, left_ready, c0_s, j % 2, refill, j + 2 < full)
            if j + 1 < n_blocks:  # the next block's product runs while this one's scores are stored
                ahead = _block_scores(q0_s, q1_s, qr_s, c0_s, c1_s, kr_s, right_ready, left_ready, cache_ptr,
                                      table_row, start, end, j + 1, full, PAGE, WIDTH, False)  # fmt: skip
            _store_block_scores(scores, scores_ptr, maxima_ptr, first_block + j, start + j * BLOCK_N, end, qk_scale)


@gluon.jit
def _store_block_scores(scores, scores_ptr, maxima_ptr, block, n0, end, qk_scale):
    """S of a block (tokens ``n0 + [0, 64)``) as the row-major tile ``block`` of ``scores_ptr``, and each head's max of
    its scaled scores at the tokens before ``end`` at ``maxima_ptr[block]``."""
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    tile = gl.expand_dims(heads * BLOCK_N, 1) + gl.expand_dims(tokens, 0)
    gl.store(scores_ptr + block * (BLOCK_H * BLOCK_N) + tile, scores)
    gl.store(maxima_ptr + block * BLOCK_H + heads, gl.max(_scaled_scores(scores, n0 + tokens < end, qk_scale), axis=1))


@gluon.jit
def _dequantize_block(cache_ptr, rope_desc, table_row, start, end, c0_s, c1_s, kr_s, ready, i, PAGE: gl.constexpr,
                      WIDTH: gl.constexpr, CHUNK: gl.constexpr, BY_BITS: gl.constexpr):  # fmt: skip
    """Block ``i`` of an fp8_ds_mla span into stage ``i % 2``: the latent dequantised to bf16 (zeros past ``end``),
    the rope part by a TMA copy that arrives on ``ready``."""
    n0 = start + i * BLOCK_N
    page = gl.load(table_row + n0 // PAGE)
    stage = i % 2
    mbarrier.expect(ready.index(stage), rope_desc.block_type.nbytes)
    TMA_LOAD(rope_desc, [page * PAGE + n0 % PAGE, ROPE_AT], ready.index(stage), kr_s.index(stage))
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        _store_chunk(_fp8_chunk(cache_ptr, page, n0 + r, end, PAGE, WIDTH, CHUNK), c0_s, c1_s, stage, r, BY_BITS)
    fence_async_shared()
    BARRIER()


@gluon.jit
def _gather_columns(cache_ptr, table_row, n0, end, col0, v_s, PAGE: gl.constexpr, WIDTH: gl.constexpr):
    """Latent columns ``col0 + [0, W)`` of tokens ``n0 + [0, 64)`` gathered by pointer into ``v_s``, zeros at and past
    ``end`` (the cache past a sequence may hold NaN, which P x V must not see)."""
    W: gl.constexpr = v_s.shape[1]
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
    CHUNK: gl.constexpr = 16
    cols = gl.expand_dims(col0 + gl.arange(0, W, layout=gl.SliceLayout(0, rows)), 0)
    for r in gl.static_range(0, BLOCK_N, CHUNK):
        pos = n0 + r + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, rows))
        valid = pos < end
        page = gl.load(table_row + pos // PAGE, mask=valid, other=0)
        base = gl.expand_dims((page.to(gl.int64) * PAGE + pos % PAGE) * WIDTH, 1)
        v_s.slice(r, CHUNK).store(gl.load(cache_ptr + base + cols, mask=gl.expand_dims(valid, 1), other=0.0))


@gluon.jit
def _mla_probs_kernel(scores_ptr, maxima_ptr, probs_ptr, factors_ptr, seq_lens_ptr, scale, S_q, SPLIT: gl.constexpr,
                      PDL: gl.constexpr):  # fmt: skip
    """The online softmax of one (query row, 64 heads, 64-token block) per program, over ``_mla_scores_kernel``'s
    scores and block maxima (grid: rows x head blocks x the scores' blocks per row). The running max before the block
    is the max of the maxima of its span's earlier blocks (a max is exact in any order), so every block's P is the
    split kernel's without the chain: P as bf16 at ``probs`` (the scores' tile order), and at ``factors[block]`` three
    rows of 64 heads: the row factor of what came before (``alpha``), P's row sums (fp32, before the rounding), and
    the running max after the block. Blocks past the sequence are not written. ``PDL``: launched early, it lets the
    values kernel launch and waits for the scores kernel to finish."""
    launch_dependents(PDL)
    wait_previous(PDL)
    row = gl.program_id(0)
    block = gl.program_id(2)
    SPAN_BLOCKS: gl.constexpr = SPLIT // BLOCK_N
    first = block // SPAN_BLOCKS * SPAN_BLOCKS  # the span's first block
    limit = _visible_limit(seq_lens_ptr, row, S_q)
    end = gl.minimum((first + SPAN_BLOCKS) * BLOCK_N, limit)
    n0 = block * BLOCK_N
    if n0 >= end:
        return
    tile = (row.to(gl.int64) * gl.num_programs(1) + gl.program_id(1)) * gl.num_programs(2) + block
    earlier_layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [gl.num_warps(), 1], [1, 0])
    k = gl.arange(0, SPAN_BLOCKS, layout=gl.SliceLayout(1, earlier_layout))
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, earlier_layout))
    earlier = maxima_ptr + (tile - block + first + gl.expand_dims(k, 1)) * BLOCK_H + gl.expand_dims(h, 0)
    earlier = gl.load(earlier, mask=gl.expand_dims(first + k < block, 1), other=float("-inf"))
    heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
    tokens = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.convert_layout(gl.max(earlier, axis=0), heads.type.layout)
    m_new = gl.maximum(m_i, gl.load(maxima_ptr + tile * BLOCK_H + heads))
    at = tile * (BLOCK_H * BLOCK_N) + gl.expand_dims(heads * BLOCK_N, 1) + gl.expand_dims(tokens, 0)
    p, alpha = _probs(_scaled_scores(gl.load(scores_ptr + at), n0 + tokens < end, scale * LOG2E), m_i, m_new)
    gl.store(probs_ptr + at, p.to(gl.bfloat16))
    factors = factors_ptr + tile * (3 * BLOCK_H) + heads
    gl.store(factors, alpha)
    gl.store(factors + BLOCK_H, gl.sum(p, axis=1))
    gl.store(factors + 2 * BLOCK_H, m_new)


@gluon.jit
def _mla_values_kernel(
    p_desc,
    f_desc,
    v_desc,
    factors_ptr,
    cache_ptr,
    table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    S_q,
    H,
    stride_table,
    n_splits,
    blocks,
    reach,
    PAGE: gl.constexpr,
    WIDTH: gl.constexpr,
    SPLIT: gl.constexpr,
    PARTS: gl.constexpr,
    STAGES: gl.constexpr,
    DIRECT: gl.constexpr,
    FP8: gl.constexpr,
    FILL_REGS: gl.constexpr,
    PDL: gl.constexpr,
):
    """``_mla_split_kernel``'s contract over ``_mla_probs_kernel``'s P and factors (``p_desc``: P as [rows x head
    blocks x ``blocks`` x 64, 64] bf16; ``f_desc``: each block's row factors and row sums, the first 128 of its 192
    factors): one (query row, 64 heads, KV split, latent part of ``L / PARTS`` columns) per program (program
    ``PARTS h + c`` along the heads' axis: head block ``h``, part ``c``). Launched with 4 warps, which multiply each
    block's P by the part in the split kernel's order (``_values_products``), and 4 more that fill ``STAGES`` stages
    of P, its factors and the latent (``_values_fill``). ``FP8``: an fp8_ds_mla cache, whose latent ``v_desc`` reads
    from the scores kernel's bf16 copy ([batch x ``reach``, 512]) instead. ``PDL``: launched early, its set-up and the
    cache rows overlap the probs kernel, whose results it reads only after ``_values_fill`` has waited for it."""
    launch_dependents(PDL)
    W: gl.constexpr = L // PARTS
    row = gl.program_id(0)
    pid_h = gl.program_id(1) // PARTS
    col0 = gl.program_id(1) % PARTS * W
    split = gl.program_id(2)
    b = row // S_q
    limit = _visible_limit(seq_lens_ptr, row, S_q)
    start = split * SPLIT
    end = gl.minimum(start + SPLIT, limit)
    if start >= end:
        _empty_span(part_out_ptr, part_lse_ptr, row, pid_h, split, H, n_splits, DIRECT)
        return
    p_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_H, BLOCK_N], p_desc.layout)
    f_s = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 2 * BLOCK_H], f_desc.layout)
    v_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, W], gl.bfloat16)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, W], v_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # copies and stores landed
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())  # the products are done
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the copies' expected bytes, then the stores
        mbarrier.init(free.index(i), count=1)
    fence_async_shared()
    tile0 = (row * (gl.num_programs(1) // PARTS) + pid_h) * blocks + start // BLOCK_N  # the span's first block
    table_row = table_ptr + b.to(gl.int64) * stride_table
    gl.warp_specialize(
        [
            (_values_products, (p_s, f_s, v_s, ready, free, factors_ptr, part_out_ptr, part_lse_ptr, tile0, start, end,
                                col0, row, pid_h, split, H, n_splits, W, STAGES)),
            (_values_fill, (p_desc, f_desc, v_desc, p_s, f_s, v_s, ready, free, cache_ptr, table_row, b * reach,
                            tile0, start, end, col0, PAGE, WIDTH, STAGES, SPLIT // BLOCK_N, FP8, PDL)),
        ],
        [4],
        [FILL_REGS],
    )  # fmt: skip


@gluon.jit
def _values_products(p_s, f_s, v_s, ready, free, factors_ptr, part_out_ptr, part_lse_ptr, tile0, start, end, col0,
                     row, pid_h, split, H, n_splits, W: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """P x V of each block on the program's latent part, the accumulator scaled by the block's row factor first, and
    the running sum, in the split kernel's order. At the end, the part's output times 1 / l, and the lse from the
    running max after the last block."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W, 16])
    rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    factors = _factor_rows(f_s)
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    o = gl.zeros([BLOCK_H, W], gl.float32, o_layout)
    l_i = gl.zeros([BLOCK_H], gl.float32, rows)
    mbarrier.wait(ready.index(0), 0)
    alpha = factors.index(0).load(rows)
    for i in range(n_blocks):
        stage = i % STAGES
        o = warpgroup_mma(p_s.index(stage), v_s.index(stage), o * gl.expand_dims(alpha, 1), is_async=True)
        l_i = l_i * alpha + factors.index(2 * stage + 1).load(rows)
        ahead = (i + 1) % STAGES  # the next block's stage and factor, waited for while the product runs
        mbarrier.wait(ready.index(ahead), ((i + 1) // STAGES) & 1, pred=i + 1 < n_blocks)
        alpha = factors.index(2 * ahead).load(rows)
        o = warpgroup_mma_wait(0, deps=[o])
        mbarrier.arrive(free.index(stage), count=1)
    m_i = gl.load(factors_ptr + (tile0 + n_blocks - 1) * (3 * BLOCK_H) + 2 * BLOCK_H + gl.arange(0, BLOCK_H, rows))
    part, hmask = _part_rows(row, pid_h, split, H, n_splits, o_layout)
    _store_columns(part_out_ptr, o, gl.expand_dims(1.0 / l_i, 1), part, hmask, col0)
    lse = (m_i + gl.log2(l_i)) / LOG2E  # every part's program stores the same values
    gl.store(part_lse_ptr + part, lse, mask=hmask)


@gluon.jit
def _values_fill(p_desc, f_desc, v_desc, p_s, f_s, v_s, ready, free, cache_ptr, table_row, copy_row, tile0, start, end,
                 col0, PAGE: gl.constexpr, WIDTH: gl.constexpr, STAGES: gl.constexpr, SPAN_BLOCKS: gl.constexpr,
                 FP8: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """Block ``i`` into stage ``i % STAGES`` once the products are done with block ``i - STAGES``: P, its factors and
    the latent part by TMA copies, but for a bf16 cache's partial last block, gathered with zeros past the span.
    Every block's cache row is looked up at the start, into shared memory (``FP8``: rows of the latent's copy from
    ``copy_row`` on, every block whole)."""
    n_blocks = gl.cdiv(end - start, BLOCK_N)
    full = n_blocks if FP8 else (end - start) // BLOCK_N
    spread: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [gl.num_warps(), 1], [1, 0])
    k = gl.arange(0, SPAN_BLOCKS, layout=gl.SliceLayout(1, spread))
    if FP8:
        first_rows = copy_row + start + k * BLOCK_N
    else:
        first_rows = _block_row(table_row, start, k, n_blocks, PAGE)
    rows_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    rows_s = gl.allocate_shared_memory(gl.int32, [SPAN_BLOCKS, 1], rows_layout, gl.expand_dims(first_rows, 1))
    rows_s = plain_rows(rows_s, [SPAN_BLOCKS, 1])
    BARRIER()  # the table is visible to the filling warps
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    wait_previous(PDL)  # P, its factors and the latent's copy come from the kernels before
    nbytes: gl.constexpr = p_desc.block_type.nbytes + f_desc.block_type.nbytes
    for i in range(n_blocks):
        stage = i % STAGES
        v_row = gl.max(rows_s.index(i).load(one), axis=0)
        mbarrier.wait(free.index(stage), ((i // STAGES) & 1) ^ 1)
        whole = i < full
        mbarrier.expect(ready.index(stage), nbytes + v_desc.block_type.nbytes, pred=whole)
        mbarrier.expect(ready.index(stage), nbytes, pred=not whole)
        TMA_LOAD(v_desc, [v_row, col0], ready.index(stage), v_s.index(stage), pred=whole)
        TMA_LOAD(p_desc, [(tile0 + i) * BLOCK_H, 0], ready.index(stage), p_s.index(stage))
        TMA_LOAD(f_desc, [tile0 + i, 0], ready.index(stage), f_s.index(stage))
        if not FP8:  # noqa: SIM102 (compiled only for a bf16 cache)
            if i == full:
                _gather_columns(cache_ptr, table_row, start + i * BLOCK_N, end, col0, v_s.index(stage), PAGE, WIDTH)
                fence_async_shared()
        mbarrier.arrive(ready.index(stage), count=1)


@gluon.jit
def _factor_rows(f_s):
    """The factors' stages as [2 x stages, 64] plain rows (their TMA layout has no swizzle)."""
    return plain_rows(f_s, [2 * f_s.shape[0], BLOCK_H])


def on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an SM90 GPU (wgmma is Hopper's)."""
    return t.is_cuda and hopper(t.device.index or 0)


def declines(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, kv_format: str, tma: bool) -> str | None:
    """Why this kernel cannot serve the call, or None where it can: it needs an SM90 GPU, latent 512 and rope 64, at
    least 64 heads, pages of a multiple of 64 tokens (a block lies in one page), and a cache whose records TMA can
    read (``tma``: the whole bf16 record, or the bf16 rope part of an fp8_ds_mla record)."""
    if not on_hopper(q):
        return "q is not on an SM90 (Hopper) GPU"
    if kv_format not in ("bf16", "fp8_ds_mla"):
        return f"kv_format {kv_format!r} is not bf16 or fp8_ds_mla"
    if not tma:
        return "the cache's records cannot be read by TMA copies"
    if kv_lora_rank != L.value or q.shape[3] != L.value + R.value:
        return f"latent {kv_lora_rank} and rope {q.shape[3] - kv_lora_rank}, expected {L.value} and {R.value}"
    if kv_cache.shape[1] % BLOCK_N.value:
        return f"pages of {kv_cache.shape[1]} tokens, not a multiple of {BLOCK_N.value}"
    if q.shape[2] < BLOCK_H.value:
        return f"{q.shape[2]} heads < {BLOCK_H.value}"
    return None


def takes(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, kv_format: str, tma: bool) -> bool:
    """Whether this kernel can serve the call (``declines`` gives None)."""
    return declines(q, kv_cache, kv_lora_rank, kv_format, tma) is None


def _descriptor(records: torch.Tensor, cols: int) -> TensorDescriptor:
    """A TMA descriptor of 64-token boxes of ``cols`` bf16 columns over the cache's records (an fp8_ds_mla record's
    rope part is bf16)."""
    return tma_descriptor(records.view(torch.bfloat16), [BLOCK_N.value, cols], gl.bfloat16)


def launch_split(
    q, records, block_table, seq_lens, part_out, part_lse, softmax_scale, split, n_splits, page, halves=False
) -> None:
    """Fills ``part_out`` / ``part_lse`` as ``attention._mla_split_kernel`` does; ``records``: the cache as one row per
    cached token ([tokens, 576] bf16 or [tokens, 656] fp8_ds_mla bytes); ``halves``: the kernel's ``HALVES``."""
    fp8 = records.dtype == torch.uint8
    if fp8:  # the latent is dequantised by the kernel; TMA copies bring the rope part only
        descriptors = (None, _descriptor(records, R.value))
        regs = {"RIGHT_REGS": FP8_RIGHT_REGS, "FILL_REGS": FP8_FILL_REGS}
    else:
        descriptors = (_descriptor(records, LH.value), _descriptor(records, R.value))
        regs = {"RIGHT_REGS": RIGHT_REGS, "FILL_REGS": 0}
    batch, s_q, heads, _ = q.shape
    _mla_split_kernel[(batch * s_q, -(-heads // BLOCK_H.value) * (2 if halves else 1), n_splits)](
        q, *descriptors, records, block_table, seq_lens, part_out, part_lse, softmax_scale, s_q, heads,
        q.stride(0), q.stride(1), q.stride(2), block_table.stride(0), n_splits, split,
        PAGE=page, WIDTH=records.shape[1], FP8=fp8, CHUNK=FP8_CHUNK, DIRECT=n_splits == 1, HALVES=halves,
        EARLY_RELEASE=EARLY_RELEASE, FP8_BY_BITS=FP8_BY_BITS,
        **regs,
        num_warps=4, enable_fp_fusion=True,  # the FFMAs it was measured with (Triton 3.10 turns fusion off)
    )  # fmt: skip


def scores_tokens(rows: int, head_blocks: int, reach: int, sms: int) -> int:
    """The scores kernel's chunk of a table reaching ``reach`` tokens: ``SCORES_TOKENS``, halved down to 64 while the
    grid that gives still fits in ``sms`` (a chunk's blocks run in series, so one or two rows leave most SMs idle at
    256; more programs than SMs make it slower again: benchmarks/NOTES.md, mla_decode: 2026-12-03 — the scores
    kernel's chunk; 2026-12-04 — what bounds the values kernel). The chunk decides only which program computes a
    block's scores, never how: the bits are the same."""
    tokens = SCORES_TOKENS
    while tokens > BLOCK_N.value and rows * head_blocks * -(-reach // (tokens // 2)) <= sms:
        tokens //= 2
    return tokens


def values_parts(programs: int, sms: int) -> int:
    """Latent parts per (row, head block, span) of the values kernel: 8 while ``programs`` x 8 fit ``sms`` at once, else
    4 (each part's program streams its P again: benchmarks/NOTES.md, mla_decode: 2026-12-04 — every block's softmax
    in parallel, then P x V). The bits do not depend on it."""
    return 8 if programs * 8 <= sms else 4


def launch_scores_first(
    q, records, block_table, seq_lens, part_out, part_lse, softmax_scale, split, n_splits, page
) -> None:
    """``launch_split``'s contract by ``_mla_scores_kernel``, ``_mla_probs_kernel`` and ``_mla_values_kernel``."""
    fp8 = records.dtype == torch.uint8
    batch, s_q, heads, _ = q.shape
    head_blocks = -(-heads // BLOCK_H.value)
    reach = block_table.shape[1] * page
    tokens = scores_tokens(batch * s_q, head_blocks, reach, num_sms(q.device.index or 0))
    chunks = -(-reach // tokens)
    blocks = chunks * tokens // BLOCK_N.value
    tile = [BLOCK_H.value, BLOCK_N.value]
    scores = torch.empty(batch * s_q * head_blocks * blocks * tile[0], tile[1], dtype=torch.float32, device=q.device)
    maxima = torch.empty(batch * s_q * head_blocks * blocks, tile[0], dtype=torch.float32, device=q.device)
    lat_desc = None if fp8 else _descriptor(records, LH.value)  # an fp8_ds_mla latent is dequantised by the kernels
    latent = torch.empty(batch * reach, L.value, dtype=torch.bfloat16, device=q.device) if fp8 else None
    _mla_scores_kernel[(batch * s_q, head_blocks, chunks)](
        q, lat_desc, _descriptor(records, R.value), records, block_table, seq_lens, scores, maxima,
        _descriptor(latent, LH.value) if fp8 else None, softmax_scale, s_q, heads,
        q.stride(0), q.stride(1), q.stride(2), block_table.stride(0), reach,
        PAGE=page, WIDTH=records.shape[1], TOKENS=tokens, FP8=fp8, CHUNK=SCORES_FP8_CHUNK, PDL=SCORES_FIRST_PDL,
        FP8_BY_BITS=FP8_BY_BITS, num_warps=4, enable_fp_fusion=True,
    )  # fmt: skip
    probs = torch.empty_like(scores, dtype=torch.bfloat16)
    factors = torch.empty(maxima.shape[0] * 3, tile[0], dtype=torch.float32, device=q.device)
    _mla_probs_kernel[(batch * s_q, head_blocks, blocks)](
        scores, maxima, probs, factors, seq_lens, softmax_scale, s_q, SPLIT=split, PDL=SCORES_FIRST_PDL, num_warps=4,
        enable_fp_fusion=True, launch_pdl=SCORES_FIRST_PDL,
    )  # fmt: skip
    p_desc = tma_descriptor(probs, tile, gl.bfloat16)
    f_desc = tma_descriptor(factors.view(-1, 3 * tile[0]), [1, 2 * tile[0]], gl.float32)
    parts = values_parts(batch * s_q * head_blocks * n_splits, num_sms(q.device.index or 0))
    v_desc = _descriptor(latent if fp8 else records, L.value // parts)
    _mla_values_kernel[(batch * s_q, head_blocks * parts, n_splits)](
        p_desc, f_desc, v_desc, factors, records, block_table, seq_lens, part_out, part_lse, s_q, heads,
        block_table.stride(0), n_splits, blocks, reach,
        PAGE=page, WIDTH=records.shape[1], SPLIT=split, PARTS=parts, STAGES=VALUES_STAGES,
        DIRECT=n_splits == 1, FP8=fp8, FILL_REGS=VALUES_FILL_REGS, PDL=SCORES_FIRST_PDL, num_warps=4,
        enable_fp_fusion=True, launch_pdl=SCORES_FIRST_PDL,
    )  # fmt: skip
