"""DeepSeek Sparse Attention (DSA): ``write_index_cache``, ``indexer_topk``, ``sparse_mla``.

``write_index_cache`` is one program per token: a bf16 copy, or DeepSeek's FP8 indexer key (e4m3 values and one
power-of-two fp32 scale per 128 values), rounded as ``deepinfer.index_cache.pack_fp8_ds_index`` rounds.

``indexer_topk`` scores, then selects. A scores kernel (one program per query token and span of positions) computes
``I[p] = sum_h w[h] * relu(q[h] . k[p])`` in fp32 for every position of the token's block-table row, reading keys
through the block table, and writes one int64 sort key per position: the score mapped to an order-preserving int32
in the high word, ``2^31 - 1 - p`` in the low word. The keys of a row are distinct and order (score descending,
position ascending) exactly as the contract breaks ties, so ``torch.topk`` over them picks the same set whatever its
internal algorithm; positions the query does not see get the smallest key of all. A last kernel (one program per
token, or per few tokens where topk is small) recovers the positions from the chosen keys, sorts them ascending, maps
them to cache slots through the block table and pads with ``-1``. The buffer is sized by the block table's capacity
(``max_blocks * block_size``), not by the sequence lengths, so nothing waits on the host and the whole op can be
captured in a CUDA graph; rows are taken in chunks that keep the buffer under ``TOPK_KEYS_BYTES``. Each row's work
depends on that row alone: the op is batch-invariant.

``sparse_mla`` is absorbed MLA over the listed slots: one program per (query token, block of heads[, span of the
index list]) gathers the cache rows of its slots ``BLOCK_N`` at a time, ``-1`` entries masked out (their scores to
``-inf``, their values to zero: the cache at a slot no one listed may hold anything, NaN included), and keeps an
online softmax in fp32 (exp2), the latent in two halves as ``mla_decode`` does. With one span per row it writes the
output and lse itself and is batch-invariant; the default mode may split a row's list into spans when the grid is
small, merged by ``mla_decode``'s merge kernel. In the default mode, a prefill chunk over an fp8_ds_mla cache first
dequantises the pages its lists name into a bf16 copy, each page once, and attends over the copy as a bf16 cache
(``_bf16_pages``): the same bits, since e4m3 times a power-of-two scale is exact in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline
from deepinfer.index_cache import FP8_GROUP

from ._triton import INTERPRET, PDL, cast, dot, next_pow2, num_sms, pdl_wait, placed, pow2_ceil, to_e4m3
from .attention import _bf16_copy, _dequantize, _mla_merge_kernel, _rope_at

try:
    from . import sparse_mla_gluon
except ImportError:  # a Triton without Gluon's Hopper language: the Triton kernel serves every call
    sparse_mla_gluon = None

_INTERPRET = tl.constexpr(INTERPRET)

# --- write_index_cache ------------------------------------------------------------------------------------------


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


def write_index_cache(k, index_cache, slot_mapping):
    tokens, head_dim = k.shape
    if tokens == 0:
        return
    fp8 = index_cache.dtype == torch.uint8
    flat = index_cache.view(-1)
    _write_index_kernel[(tokens,)](
        k,
        slot_mapping.contiguous(),  # read at slots_ptr + t
        flat,
        flat.view(torch.float32) if fp8 else flat,
        k.stride(0),
        D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        GROUPS=next_pow2(head_dim // FP8_GROUP),
        WIDTH=index_cache.shape[2],
        FP8=fp8,
        PREROUND=INTERPRET,
        launch_pdl=PDL,
    )


def write_supports(k, index_cache, slot_mapping) -> bool | Decline:
    where = placed(k=k, index_cache=index_cache, slot_mapping=slot_mapping)
    if where is not True:
        return where
    if k.stride(1) != 1:
        return Decline(f"k's stride {k.stride(1)} in its last dim, expected 1")
    if k.shape[1] > 8192:
        return Decline(f"k has {k.shape[1]} values a key, at most 8192")
    return True


# --- indexer_topk -----------------------------------------------------------------------------------------------

# Positions per scores program (a multiple of every BLOCK_N below): the program loads its query's [H, D] once and
# walks its span BLOCK_N positions at a time. At ctx 128K a query row has 64 programs.
TOPK_SPAN = 2048
# Heads >= 16: tl.dot of q [H, D] by keys [D, BLOCK_N], BLOCK_N = TOPK_DOT_ELEMENTS // BLOCK_H (128 at 64 heads).
TOPK_DOT_ELEMENTS, TOPK_DOT_WARPS, TOPK_DOT_STAGES = 8192, 8, 3
# Fewer heads: one [BLOCK_N, D] product per head.
TOPK_LOOP_BLOCK_N, TOPK_LOOP_WARPS = 64, 4
# The int64 sort keys of this many bytes at most per chunk of query rows (8 bytes per position of the table).
TOPK_KEYS_BYTES = 256 << 20
# Positions kept per row at most (one program sorts them): beyond, the reference serves. Short rows are sorted
# several to a program, up to TOPK_SORT_ELEMENTS entries.
TOPK_MAX, TOPK_SORT_ELEMENTS = 16384, 2048


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


def _scores_config(heads: int) -> dict:
    block_h = next_pow2(heads)
    if block_h >= 16:
        block_n = max(16, min(128, TOPK_DOT_ELEMENTS // block_h))
        return dict(
            BLOCK_H=block_h, BLOCK_N=block_n, USE_DOT=True, num_warps=TOPK_DOT_WARPS, num_stages=TOPK_DOT_STAGES
        )
    return dict(BLOCK_H=block_h, BLOCK_N=TOPK_LOOP_BLOCK_N, USE_DOT=False, num_warps=TOPK_LOOP_WARPS)


def indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk):
    tokens, heads, head_dim = q.shape
    out = torch.empty(tokens, topk, dtype=torch.int32, device=q.device)
    batch = block_table.shape[0]
    page = index_cache.shape[1]
    reach = block_table.shape[1] * page  # positions a block-table row can hold
    if tokens == 0 or reach == 0:
        return out.fill_(-1)
    k = min(topk, reach)
    seq = torch.empty(tokens, dtype=torch.int32, device=q.device)
    limit = torch.empty(tokens, dtype=torch.int32, device=q.device)
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()  # entry b read at ptr + b
    _token_rows_kernel[(batch,)](cu_seqlens_q, seq_lens, seq, limit, BLOCK=256, launch_pdl=PDL)
    fp8 = index_cache.dtype == torch.uint8
    flat = index_cache.view(-1)
    config = _scores_config(heads)
    span = triton.cdiv(TOPK_SPAN, config["BLOCK_N"]) * config["BLOCK_N"]  # whole blocks
    rows = max(1, min(tokens, TOPK_KEYS_BYTES // (8 * reach)))
    keys = torch.empty(rows, reach, dtype=torch.int64, device=q.device)
    for row0 in range(0, tokens, rows):
        n = min(rows, tokens - row0)
        _index_scores_kernel[(n, triton.cdiv(reach, span))](
            q,
            weights,
            flat,
            flat.view(torch.float32) if fp8 else flat,
            block_table,
            seq,
            limit,
            keys,
            row0,
            heads,
            reach,
            q.stride(0),
            q.stride(1),
            weights.stride(0),
            block_table.stride(0),
            D=head_dim,
            WIDTH=index_cache.shape[2],
            PAGE=page,
            FP8=fp8,
            SPAN=span,
            FP32_DOT=INTERPRET,
            **config,
            launch_pdl=PDL,
        )
        # Distinct keys: the set is the same whatever topk's algorithm; the order is the slots kernel's business.
        chosen = torch.topk(keys[:n], k, dim=1, sorted=False).values.contiguous()
        block_k = next_pow2(k)
        per_program = min(next_pow2(n), max(1, TOPK_SORT_ELEMENTS // block_k))
        _topk_slots_kernel[(triton.cdiv(n, per_program),)](
            chosen,
            block_table,
            seq,
            out,
            row0,
            n,
            k,
            topk,
            block_table.stride(0),
            PAGE=page,
            ROWS=per_program,
            BLOCK_K=block_k,
            num_warps=4 if per_program * block_k <= 1024 else 8,
            launch_pdl=PDL,
        )
    return out


def topk_supports(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk) -> bool | Decline:
    """A power-of-two head_dim of at most 256 and at most 128 heads (one program holds a query's [H, D]); at most
    ``TOPK_MAX`` positions kept per row (one program sorts them)."""
    where = placed(
        q=q, weights=weights, index_cache=index_cache, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
    )  # fmt: skip
    if where is not True:
        return where
    for name, t in (("q", q), ("weights", weights), ("block_table", block_table)):
        if t.stride(-1) != 1:
            return Decline(f"{name}'s stride {t.stride(-1)} in its last dim, expected 1")
    head_dim = q.shape[2]
    if head_dim != next_pow2(head_dim) or head_dim > 256:
        return Decline(f"head_dim {head_dim} is not a power of two <= 256")
    if q.shape[1] > 128:
        return Decline(f"{q.shape[1]} indexer heads, at most 128")
    if min(topk, block_table.shape[1] * index_cache.shape[1]) > TOPK_MAX:
        return Decline(f"topk {topk} positions kept a row, at most {TOPK_MAX}")
    return True


# --- sparse_mla -------------------------------------------------------------------------------------------------

# Heads per program, listed slots per step, warps, stages: mla_decode's tile (measured there on the H200); the latent
# halves are each [BLOCK_H, 256] fp32 at DeepSeek's 512.
SPARSE_TILE = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
# Default mode: a row's index list is split into spans (merged by lse) while the grid would give fewer than
# SPARSE_GRID_FILL programs per multiprocessor, down to spans of SPARSE_MIN_SPLIT entries.
SPARSE_GRID_FILL, SPARSE_MIN_SPLIT = 1.0, 256
# The warp-specialized Gluon kernel (``sparse_mla_gluon``) where it applies: 1.1-1.4x the Triton kernel's speed in
# every bench row on an H100 (``benchmarks/NOTES.md``).
SPARSE_MLA_GLUON = True
LIST_CHUNK = 1024  # index entries read at a time to find where a row's list ends
# Default mode, fp8_ds_mla cache: a chunk of at least FP8_COPY_MIN_TOKENS query tokens whose lists name the slots of
# the pages they touch at least FP8_COPY_MIN_REUSE times each on average (the tokens of one prompt, each choosing among
# the same cached tokens) has those pages dequantised once into a bf16 copy of at most FP8_COPY_MAX_BYTES, which the
# kernel reads as a bf16 cache: every program would otherwise dequantise every record it lists, and on an H100 the
# bf16 kernel runs a prefill chunk 1.4x as fast (379 against 267 TFLOP/s at 8k tokens: benchmarks/NOTES.md, sparse
# attention). Counting the pages synchronises with the host, once per call: a step of fewer rows never counts them,
# nor does one being captured into a CUDA graph; an eager step of as many decode or verification rows pays the
# synchronisation and then reads its records directly.
FP8_COPY_MIN_TOKENS = 512
FP8_COPY_MIN_REUSE = 4
FP8_COPY_MAX_BYTES = 1 << 30
FP8_COPY_ROW_PAGES = 2048  # pages per row of the copy kernel's grid (its second axis holds at most 65,535 programs)


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


def _sparse_split(programs: int, topk: int, kv_lora_rank: int, sms: int) -> int:
    """Index entries per span in default mode: the whole list, halved (down to ``SPARSE_MIN_SPLIT``) while the grid
    has fewer than ``SPARSE_GRID_FILL`` programs per multiprocessor. The merge kernel holds a row of a power-of-two
    latent: other latents keep the whole list."""
    split = next_pow2(topk)
    if kv_lora_rank != next_pow2(kv_lora_rank):
        return split
    while split > SPARSE_MIN_SPLIT and programs * triton.cdiv(topk, split) < SPARSE_GRID_FILL * sms:
        split //= 2
    return split


def _partials(out, lse, tokens: int, heads: int, n_splits: int, kv_lora_rank: int):
    """Where the kernels write: the op's out and lse themselves for one span, else fp32 partial rows to merge."""
    if n_splits == 1:
        return out.view(-1, kv_lora_rank), lse.view(-1)
    part_out = torch.empty(tokens * heads * n_splits, kv_lora_rank, dtype=torch.float32, device=out.device)
    return part_out, torch.empty(tokens * heads * n_splits, dtype=torch.float32, device=out.device)


def _merge(part_out, part_lse, out, lse, n_splits: int, kv_lora_rank: int) -> None:
    if n_splits > 1:
        _mla_merge_kernel[(out.shape[0] * out.shape[1],)](
            part_out, part_lse, out, lse, n_splits, L=kv_lora_rank, BLOCK_S=next_pow2(n_splits), CHUNK=8, launch_pdl=PDL
        )


def _bf16_pages(q, kv_cache, indices, kv_lora_rank: int):
    """The pages of an fp8_ds_mla ``kv_cache`` that ``indices`` lists, dequantised into a bf16 cache of their own
    ``[P', page, kv_lora_rank + rope_dim]`` (the listed pages first, in page order; ``attention._bf16_copy``), and
    ``indices`` renumbered into it (-1 kept); None where the copy would not pay or does not apply: too few query
    tokens, too few listed entries per slot of the listed pages, more than ``FP8_COPY_MAX_BYTES``, a step being
    captured, or a record the copy kernel does not read (a multiple of 16 bytes, power-of-two latent and rope parts,
    as ``mla_supports`` requires; DeepSeek's 656-byte records are). A listed page's unlisted slots are copied too and
    never read."""
    tokens, topk = indices.shape
    pages, page, width = kv_cache.shape
    rope_dim = q.shape[2] - kv_lora_rank
    shapes_ok = width % 16 == 0 and kv_lora_rank >= 32 and rope_dim >= 16
    shapes_ok = shapes_ok and kv_lora_rank == next_pow2(kv_lora_rank) and rope_dim == next_pow2(rope_dim)
    if tokens < FP8_COPY_MIN_TOKENS or not shapes_ok:
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    flat = indices.reshape(-1).long()
    listed = flat >= 0
    at = torch.where(listed, flat // page + 1, 0)  # 0: no page (-1 entries)
    used = torch.zeros(pages + 1, dtype=torch.int32, device=q.device).index_fill_(0, at, 1)
    used[0] = 0
    entries, n = torch.stack([listed.sum(), used.sum()]).tolist()  # the host synchronisation
    copy_bytes = n * page * 2 * (kv_lora_rank + rope_dim)
    if not n or entries < FP8_COPY_MIN_REUSE * n * page or copy_bytes > FP8_COPY_MAX_BYTES:
        return None
    position = used.cumsum(0, dtype=torch.int32) - 1  # a listed page's place in the copy, at its index in `at`
    renumbered = torch.where(listed, position[at].long() * page + flat % page, -1).to(torch.int32).view(tokens, topk)
    row_pages = min(n, FP8_COPY_ROW_PAGES)
    rows = triton.cdiv(n, row_pages)
    table = torch.zeros(rows * row_pages, dtype=torch.int32, device=q.device)
    table[:n] = used[1:].nonzero().squeeze(1).to(torch.int32)
    row_starts = torch.arange(rows, dtype=torch.int32, device=q.device) * (row_pages * page)
    counts = (n * page - row_starts).clamp(max=row_pages * page)  # the last row's unused pages are not written
    copy, _ = _bf16_copy(kv_cache, table.view(rows, row_pages), counts, kv_lora_rank, rope_dim)
    return copy.view(rows * row_pages, page, -1), renumbered


def sparse_mla_gluon_kernel(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format):
    """``sparse_mla`` by ``sparse_mla_gluon``'s warp-specialized kernel (spans as the Triton kernel's default mode)."""
    tokens, heads, _ = q.shape
    out = torch.empty(tokens, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    topk = indices.shape[1]
    head_blocks = triton.cdiv(heads, 64)
    split = _sparse_split(tokens * head_blocks, topk, kv_lora_rank, num_sms(q.device.index or 0))
    n_splits = triton.cdiv(topk, split)
    part_out, part_lse = _partials(out, lse, tokens, heads, n_splits, kv_lora_rank)
    fp8 = kv_format == "fp8_ds_mla"
    copied = _bf16_pages(q, kv_cache, indices, kv_lora_rank) if fp8 else None
    if copied is not None:
        (kv_cache, indices), fp8 = copied, False
    sparse_mla_gluon.launch(q, kv_cache, indices, part_out, part_lse, softmax_scale, fp8, split, n_splits)
    _merge(part_out, part_lse, out, lse, n_splits, kv_lora_rank)
    return out, lse


def sparse_gluon_supports(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format) -> bool | Decline:
    if not SPARSE_MLA_GLUON:
        return Decline("SPARSE_MLA_GLUON is off")
    if sparse_mla_gluon is None:
        return Decline("this Triton has no Gluon Hopper language")
    where = placed(q=q, kv_cache=kv_cache, indices=indices)
    if where is not True:
        return where
    why = sparse_mla_gluon.declines(q, kv_cache, indices, kv_lora_rank, kv_format)
    return Decline(why) if why else True


def sparse_mla(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format, invariant=False):
    tokens, heads, d_qk = q.shape
    rope_dim = d_qk - kv_lora_rank
    topk = indices.shape[1]
    out = torch.empty(tokens, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    tile = dict(SPARSE_TILE)
    block_h = min(tile.pop("BLOCK_H"), max(16, next_pow2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    split = next_pow2(topk)
    if not invariant:
        split = _sparse_split(tokens * head_blocks, topk, kv_lora_rank, num_sms(q.device.index or 0))
    n_splits = triton.cdiv(topk, split)
    part_out, part_lse = _partials(out, lse, tokens, heads, n_splits, kv_lora_rank)
    fp8 = kv_format == "fp8_ds_mla"
    copied = _bf16_pages(q, kv_cache, indices, kv_lora_rank) if fp8 and not invariant else None
    if copied is not None:
        (kv_cache, indices), fp8 = copied, False
    flat = kv_cache.view(-1)
    _sparse_mla_kernel[(tokens, head_blocks, n_splits)](
        q,
        flat,
        flat.view(torch.float32) if fp8 else flat,
        flat.view(torch.bfloat16) if fp8 else flat,
        indices,
        part_out,
        part_lse,
        softmax_scale,
        heads,
        topk,
        n_splits,
        q.stride(0),
        q.stride(1),
        indices.stride(0),
        L=kv_lora_rank,
        LH=max(16, next_pow2(kv_lora_rank) // 2),
        R=rope_dim,
        BLOCK_R=max(16, next_pow2(rope_dim)),
        WIDTH=kv_cache.shape[2],
        ROPE_AT=_rope_at(kv_lora_rank, fp8),
        FP8=fp8,
        SPLIT=split,
        BLOCK_H=block_h,
        LIST_CHUNK=min(LIST_CHUNK, next_pow2(split)),
        FP32_DOT=INTERPRET,
        **tile,
        launch_pdl=PDL,
    )
    _merge(part_out, part_lse, out, lse, n_splits, kv_lora_rank)
    return out, lse


def sparse_supports(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format) -> bool:
    """bf16 queries, a latent of at most 1024 and a rope part of at most 256 (any widths: the tiles are padded to
    powers of two and masked). Unlike ``mla_decode``, fp8_ds_mla records of any width are taken: the slots come from
    a load (``indices``), of which Triton assumes no divisibility, so a row offset ``slot * WIDTH`` is credited with
    WIDTH's own alignment only (4 bytes for the 260-byte records of kv_lora_rank 128)."""
    where = placed(q=q, kv_cache=kv_cache, indices=indices)
    if where is not True:
        return where
    if q.dtype != torch.bfloat16:
        return Decline(f"q is {q.dtype}, expected torch.bfloat16")
    if q.stride(2) != 1 or indices.stride(1) != 1:
        return Decline("q's or indices' last dim is not contiguous")
    if kv_lora_rank > 1024 or q.shape[2] - kv_lora_rank > 256:
        return Decline(f"latent {kv_lora_rank} and rope {q.shape[2] - kv_lora_rank}, at most 1024 and 256")
    return True
