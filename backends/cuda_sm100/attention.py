"""``mla_decode``, ``attention_varlen``, ``write_kv_cache``.

``mla_decode`` is split-KV flash decoding over the paged latent cache: every (query row, head block, KV split)
program reduces one span of the context, then a second kernel merges the spans by their lse (where one span covers
the context, the split kernel writes the output and lse itself: the merge of one span is exact). The grid comes from
the block table's shape rather than from the sequence lengths, so a decode step needs no host synchronisation. By
default small batches take shorter spans, so that the grid fills the GPU; the batch-invariant variant keeps the span
fixed, so a row's result cannot depend on the batch. A program holds its output as two [heads, L/2] halves (a TMA box
is at most 256 wide) and reads whole 64-token blocks of a page by TMA copies; the last, partial block of a span is
gathered with masks. On Hopper, DeepSeek-V3's shapes (bf16 or fp8_ds_mla cache) go to the warp-specialized Gluon
split kernel in ``mla_gluon`` instead (same partial outputs, same merge, same direct output); at a few rows in
batch-invariant mode, the scores are computed first over the whole context in parallel, then their softmax, then
each span's P x V (``mla_gluon.launch_scores_first``, the same bits). Where the Gluon kernel runs in latent halves
in batch-invariant mode, an fp8_ds_mla cache is first dequantised once into a bf16 copy of the rows' tokens
(``_bf16_copy``), which the kernel reads as a bf16 cache (the same bits again). Each of these kernels is an
implementation of its own in the registry (``MLA_KERNELS``, ``mla_kernel_declines``): ``deepinfer info --ops
--shapes`` says which one a shape takes and why the ones before it decline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer import Decline
from deepinfer.kv_cache import FP8_GROUP, fp8_ds_mla_offsets

from ._triton import (
    INTERPRET,
    PDL,
    cast,
    cdiv,
    device_type,
    dot,
    next_pow2,
    num_sms,
    on_device,
    pdl_wait,
    placed,
    pow2_ceil,
    tma_ready,
    to_e4m3,
)

try:
    from . import mla_gluon
except ImportError:  # a Triton without Gluon's Hopper language: the tl split kernel serves every call
    mla_gluon = None

LOG2E = 1.4426950408889634
GROUP = tl.constexpr(FP8_GROUP)  # fp8_ds_mla latent columns per scale
# Context tokens per KV split in batch-invariant mode: from 32 rows of 128 heads on, 2048 costs at most 1.17x the
# default mode's spans; 1024 would cost up to 1.37x there, 4096 1.57x at 32 rows and ctx 4096. Smaller batches pay
# more: 2.7x at one row and ctx 4096 (1.7x with 1024). benchmarks/NOTES.md, mla_decode: 2026-12-01 — spans landed,
# and 2026-12-02 — batch-invariant spans against partial bytes.
SPLIT_TOKENS = 2048
# Adaptive spans (default mode): the longest (fewest partials to merge), the shortest (every split writes a
# [heads, L] fp32 partial: shorter spans cost more bytes than they save), and how full the grid must be before a
# longer span is taken, in programs per multiprocessor. benchmarks/NOTES.md, mla_decode, has the measurements
# (2026-12-01 — the fp8_ds_mla cache in the Gluon kernel; spans landed).
MAX_SPLIT_TOKENS, MIN_SPLIT_TOKENS, GRID_FILL = 4096, 64, 0.5
# Heads per program (each program reads its span of the cache once for all of them), tokens per step, warps, stages.
# Measured on the H200 at B=64, ctx=4096 (benchmarks/tile_variants.py, NOTES.md): 64 heads with 8 warps beat 32 heads
# (bf16 cache 0.53 against 0.55 ms, fp8_ds_mla 0.61 against 1.27 ms); a whole 64-token page per step beat 32 tokens
# (bf16 0.355 against 0.455 ms, fp8_ds_mla 0.406 against 0.536 ms); TMA copies beat pointer loads (bf16 0.314 against
# 0.339 ms, fp8_ds_mla 0.417 against 0.446 ms).
MLA_TILE = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
MLA_TMA = True  # whole blocks by TMA copies where the cache allows it (see ``_mla_tma``)
MLA_GLUON = True  # the warp-specialized Gluon kernels where they apply (see ``mla_kernel_declines``)
# The Gluon kernel gives each of two programs one latent half of P x V (``mla_gluon``'s ``HALVES``, the same bits)
# where its grid would otherwise give at most this share of the SMs a program.
MLA_HALVES_MAX_SHARE = 0.5
# Batch-invariant mode computes every block's scores first, then their softmax, then each span's P x V
# (``mla_gluon.launch_scores_first``, the same bits) where the split kernel would give at most this share of the SMs a
# program. On the H200 at 2-16 programs it takes 0.23-0.70x of the split kernel's time; at 32, 0.96-0.98x with bf16
# and 0.72-0.75x with fp8_ds_mla (``benchmarks/mla_scores_first.py``; benchmarks/HISTORY.md, 2026-12-04 — what bound
# the values kernel).
MLA_SCORES_FIRST_MAX_SHARE = 0.25
# Batch-invariant mode, fp8_ds_mla cache, where the Gluon split kernel runs in latent halves: both programs of a pair
# would dequantise every block of the span, so the latent is dequantised once into a bf16 copy of the rows' tokens
# first (``_bf16_copy``; exact: e4m3 times a power of two) and the kernel reads the copy as a bf16 cache. On the H200
# at 48-64 programs: 1.1-1.3x the default mode against 1.2-1.6x (benchmarks/HISTORY.md, 2026-12-04 — batch-invariant
# ``mla_decode`` at the shapes). Tokens per program of the copy: 32 and 16 took 0.95-0.98x the time of 64
# and 128.
MLA_FP8_COPY = True
MLA_FP8_COPY_TOKENS = 32


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
    L: tl.constexpr,
    R: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGE: tl.constexpr,
    ROPE_AT: tl.constexpr,
    GH: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    SPLIT: tl.constexpr,
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
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, limit)
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


def _split_tokens(programs_per_split: int, context: int, sms: int, invariant: bool) -> int:
    """Context tokens per KV split: ``SPLIT_TOKENS`` when ``invariant``; else ``MAX_SPLIT_TOKENS``, halved (down to
    ``MIN_SPLIT_TOKENS``) while the grid of ``programs_per_split x splits`` programs has fewer than ``GRID_FILL``
    programs per multiprocessor."""
    if invariant:
        return SPLIT_TOKENS
    split = MAX_SPLIT_TOKENS
    while split > MIN_SPLIT_TOKENS and programs_per_split * cdiv(context, split) < GRID_FILL * sms:
        split //= 2
    return split


def _rope_at(kv_lora_rank: int, fp8: bool) -> int:
    """The rope part's first column in a cache record, bf16 units: after the latent, and in an fp8_ds_mla record
    after its e4m3 bytes and fp32 scales."""
    return fp8_ds_mla_offsets(kv_lora_rank)[1] // 2 if fp8 else kv_lora_rank


def _half_groups(kv_lora_rank: int) -> int:
    """fp8_ds_mla scale groups per latent half (``_load_block``'s ``GH``; 1 where a half is narrower than a group)."""
    return max(kv_lora_rank // 2 // FP8_GROUP, 1)


def _mla_tma(records, rope_records, half: int, rope_dim: int, rope_at: int, block_n: int, page: int) -> bool:
    """Whether whole blocks can be read by TMA copies: ``MLA_TMA``, blocks inside a page, boxes of at most 256
    elements a side, 16-byte aligned rows and column offsets."""
    return (
        MLA_TMA
        and page % block_n == 0
        and max(half, rope_dim, block_n) <= 256
        and half * records.element_size() % 16 == 0
        and rope_at * 2 % 16 == 0
        and tma_ready(records, rope_records)
    )


@dataclass(frozen=True)
class MlaGrid:
    """The launch geometry of one ``mla_decode`` call: heads per program and head blocks, context tokens per KV split
    and splits, the GPU's multiprocessors, whether whole blocks are read by TMA copies, and the split kernels'
    programs (rows x head blocks x splits)."""

    block_h: int
    head_blocks: int
    split: int
    n_splits: int
    sms: int
    tma: bool
    programs: int


def mla_grid(q, kv_cache, block_table, kv_lora_rank: int, kv_format: str, invariant: bool) -> MlaGrid:
    """The geometry ``mla_decode`` launches with (a call with rows and pages)."""
    batch, s_q, heads, d_qk = q.shape
    page = kv_cache.shape[1]
    block_h = min(MLA_TILE["BLOCK_H"], max(16, next_pow2(heads)))
    head_blocks = cdiv(heads, block_h)
    context = block_table.shape[1] * page
    sms = num_sms(q.device.index or 0)
    split = _split_tokens(batch * s_q * head_blocks, context, sms, invariant)
    n_splits = cdiv(context, split)
    fp8 = kv_format == "fp8_ds_mla"
    records = kv_cache.view(-1, kv_cache.shape[2])  # one row per cached token
    rope_records = records.view(torch.bfloat16) if fp8 else records
    rope_at = _rope_at(kv_lora_rank, fp8)
    tma = _mla_tma(records, rope_records, kv_lora_rank // 2, d_qk - kv_lora_rank, rope_at, MLA_TILE["BLOCK_N"], page)
    return MlaGrid(block_h, head_blocks, split, n_splits, sms, tma, batch * s_q * head_blocks * n_splits)


# The kernels ``mla_decode`` chooses between, in the order they are tried (each a registered implementation:
# ``plugin.py``): the Gluon scores-first kernels (batch-invariant mode only), the Gluon split kernel in latent halves,
# the Gluon split kernel, the Triton split kernel (serves every supported call).
MLA_KERNELS = ("gluon-scores-first", "gluon-split-halves", "gluon-split", "triton-split")


def mla_kernel_declines(
    kernel: str, q, kv_cache, block_table, *, kv_lora_rank: int, kv_format: str, invariant: bool
) -> str | None:
    """Why ``kernel`` (one of ``MLA_KERNELS``) does not serve a supported call in the given mode, or None where it
    does. The Gluon kernels need ``MLA_GLUON`` and ``mla_gluon.declines``'s shapes; in latent halves where the grid
    gives at most ``MLA_HALVES_MAX_SHARE`` of the SMs a program, scores first (batch-invariant mode) at most
    ``MLA_SCORES_FIRST_MAX_SHARE``."""
    if kernel == "triton-split":
        return None
    if kernel == "gluon-scores-first" and not invariant:
        return "scores first serves batch-invariant mode only"
    if not MLA_GLUON:
        return "MLA_GLUON is off"
    if mla_gluon is None:
        return "this Triton has no Gluon Hopper language"
    if q.shape[0] == 0 or block_table.shape[1] == 0:
        return "no rows or no pages: nothing to launch"
    why = mla_gluon.declines(q, kv_cache, kv_lora_rank, kv_format, tma=True)  # the launch geometry only where needed
    if why is not None:
        return why
    grid = mla_grid(q, kv_cache, block_table, kv_lora_rank, kv_format, invariant)
    if not grid.tma:
        return mla_gluon.declines(q, kv_cache, kv_lora_rank, kv_format, tma=False)
    share = {"gluon-scores-first": MLA_SCORES_FIRST_MAX_SHARE, "gluon-split-halves": MLA_HALVES_MAX_SHARE}.get(kernel)
    if share is not None and grid.programs > share * grid.sms:
        return f"{grid.programs} programs > {share:g} x {grid.sms} SMs"
    return None


def mla_kernel(q, kv_cache, block_table, *, kv_lora_rank: int, kv_format: str, invariant: bool) -> str:
    """The first of ``MLA_KERNELS`` that serves the call: the one dispatch runs."""
    return next(
        k
        for k in MLA_KERNELS
        if mla_kernel_declines(
            k, q, kv_cache, block_table, kv_lora_rank=kv_lora_rank, kv_format=kv_format, invariant=invariant
        )
        is None
    )


def mla_decode(
    q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format, invariant=False, kernel=None
):
    """``ops.mla_decode`` by ``kernel`` (one of ``MLA_KERNELS``; None: ``mla_kernel``'s choice), with adaptive spans,
    or fixed ones where ``invariant``. The caller makes sure ``kernel`` serves the call (``mla_kernel_declines``)."""
    batch, s_q, heads, d_qk = q.shape
    seq_lens = seq_lens.contiguous()  # the kernels read entry b at seq_lens_ptr + b
    rope_dim = d_qk - kv_lora_rank
    out = torch.empty(batch, s_q, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    if block_table.shape[1] == 0:  # no pages: no query sees a position, and a grid of no KV span launches nothing
        return out.zero_(), lse.fill_(float("-inf"))
    page = kv_cache.shape[1]
    tile = dict(MLA_TILE)
    del tile["BLOCK_H"]
    grid = mla_grid(q, kv_cache, block_table, kv_lora_rank, kv_format, invariant)
    split, n_splits, tma = grid.split, grid.n_splits, grid.tma
    if kernel is None:
        kernel = mla_kernel(
            q, kv_cache, block_table, kv_lora_rank=kv_lora_rank, kv_format=kv_format, invariant=invariant
        )
    if n_splits == 1:  # one span covers the context: the split kernel writes the output, no merge
        part_out, part_lse = out.view(-1, kv_lora_rank), lse.view(-1)
    else:
        part_out = torch.empty(batch * s_q * heads * n_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch * s_q * heads * n_splits, dtype=torch.float32, device=q.device)
    fp8 = kv_format == "fp8_ds_mla"
    flat = kv_cache.view(-1)
    records = kv_cache.view(-1, kv_cache.shape[2])  # one row per cached token
    rope_records = records.view(torch.bfloat16) if fp8 else records
    rope_at = _rope_at(kv_lora_rank, fp8)
    half = kv_lora_rank // 2
    if kernel != "triton-split":
        args = (q, records, block_table, seq_lens, part_out, part_lse, softmax_scale, split, n_splits, page)
        if kernel == "gluon-scores-first":
            mla_gluon.launch_scores_first(*args)
        else:
            halves = kernel == "gluon-split-halves"
            if invariant and halves and fp8 and MLA_FP8_COPY:  # at most 66 spans of 2048 tokens: 156 MB of copy
                copy, copy_table = _bf16_copy(kv_cache, block_table, seq_lens, kv_lora_rank, rope_dim)
                args = (q, copy, copy_table, *args[3:])
            mla_gluon.launch_split(*args, halves=halves)
    else:
        _mla_split_kernel[(batch * s_q, grid.head_blocks, n_splits)](
            q,
            TensorDescriptor.from_tensor(records, [tile["BLOCK_N"], half]) if tma else flat,
            TensorDescriptor.from_tensor(rope_records, [tile["BLOCK_N"], rope_dim]) if tma else flat,
            flat,
            flat.view(torch.float32) if fp8 else flat,
            flat.view(torch.bfloat16) if fp8 else flat,
            block_table,
            seq_lens,
            part_out,
            part_lse,
            softmax_scale,
            s_q,
            heads,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            block_table.stride(0),
            n_splits,
            L=kv_lora_rank,
            R=rope_dim,
            WIDTH=kv_cache.shape[2],
            PAGE=page,
            ROPE_AT=rope_at,
            GH=_half_groups(kv_lora_rank),
            FP8=fp8,
            TMA=tma,
            SPLIT=split,
            BLOCK_H=grid.block_h,
            FP32_DOT=INTERPRET,
            DIRECT=n_splits == 1,
            **tile,
            launch_pdl=PDL,
        )
    if n_splits > 1:
        _mla_merge_kernel[(batch * s_q * heads,)](
            part_out, part_lse, out, lse, n_splits, L=kv_lora_rank, BLOCK_S=next_pow2(n_splits), CHUNK=8, launch_pdl=PDL
        )
    return out, lse


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


def _bf16_copy(kv_cache, block_table, seq_lens, kv_lora_rank: int, rope_dim: int):
    """The tokens of each sequence of an fp8_ds_mla cache as a bf16 cache of their own, and its block table: sequence
    ``b``'s pages are ``b * pages + [0, pages)`` (``pages`` = the table's width). Rows past a sequence's length are
    left unwritten; the split kernels never read them unmasked. The values are ``unpack_fp8_ds_mla``'s, exactly."""
    batch, pages = block_table.shape
    page = kv_cache.shape[1]
    reach = pages * page
    copy = torch.empty(batch * pages, page, kv_lora_rank + rope_dim, dtype=torch.bfloat16, device=kv_cache.device)
    flat = kv_cache.view(-1)
    block_n = MLA_FP8_COPY_TOKENS
    _bf16_copy_kernel[(batch, triton.cdiv(reach, block_n))](
        flat,
        flat.view(torch.float32),
        flat.view(torch.bfloat16),
        block_table,
        seq_lens,
        copy,
        block_table.stride(0),
        reach,
        L=kv_lora_rank,
        R=rope_dim,
        WIDTH=kv_cache.shape[2],
        PAGE=page,
        ROPE_AT=_rope_at(kv_lora_rank, True),
        GH=_half_groups(kv_lora_rank),
        BLOCK_N=block_n,
        launch_pdl=PDL,
    )
    table = torch.arange(batch * pages, dtype=block_table.dtype, device=block_table.device).view(batch, pages)
    return copy.view(batch * reach, -1), table


def mla_supports(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format) -> bool | Decline:
    """bf16 queries, power-of-two latent (at least 32: two halves of 16) and rope widths. An fp8_ds_mla record must
    be a multiple of 16 bytes (DeepSeek-V3's 656 is): Triton assumes 16-byte alignment for the per-token rows of
    ``slot * WIDTH`` and issues 16-byte loads, which fault on the 260- and 392-byte records of smaller latents (found
    with compute-sanitizer on the H200); those go to the reference."""
    rope_dim = q.shape[3] - kv_lora_rank
    if not on_device(q, kv_cache, block_table, seq_lens):
        return Decline(f"tensors are not on {device_type()}")
    if q.dtype != torch.bfloat16:
        return Decline(f"q is {q.dtype}, expected torch.bfloat16")
    if q.stride(3) != 1:
        return Decline("q's last dimension is not contiguous")
    if kv_lora_rank != next_pow2(kv_lora_rank) or kv_lora_rank < 32:
        return Decline(f"kv_lora_rank {kv_lora_rank} is not a power of two >= 32")
    if rope_dim != next_pow2(rope_dim) or rope_dim < 16:
        return Decline(f"rope width {rope_dim} is not a power of two >= 16")
    if block_table.stride(1) != 1:
        return Decline("block_table's rows are not contiguous")
    if not (kv_format == "bf16" or INTERPRET or kv_cache.shape[2] % 16 == 0):
        return Decline(f"fp8_ds_mla records of {kv_cache.shape[2]} bytes, not a multiple of 16")
    return True


def mla_kernel_supports(kernel: str, invariant: bool):
    """The ``supports`` of ``kernel``'s implementation (one of ``MLA_KERNELS``) in the given mode: ``mla_supports``,
    then ``mla_kernel_declines``."""

    def supports(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format) -> bool | Decline:
        answer = mla_supports(
            q,
            kv_cache,
            block_table,
            seq_lens,
            softmax_scale=softmax_scale,
            kv_lora_rank=kv_lora_rank,
            kv_format=kv_format,
        )
        if not answer:
            return answer
        why = mla_kernel_declines(
            kernel, q, kv_cache, block_table, kv_lora_rank=kv_lora_rank, kv_format=kv_format, invariant=invariant
        )
        return True if why is None else Decline(why)

    return supports


# --- attention_varlen (prefill) -----------------------------------------------------------------------------------

# Measured on the H200 at 4 x 4096 tokens, H=128, D 192/128 causal (benchmarks/tile_variants.py): 128 x 64 with 8
# warps and 3 stages 6.49 ms, 128 x 128 with 2 stages 6.94 ms, 64 x 64 with 4 warps 10.0 ms. The interpreter takes
# 64-row tiles (its dot materialises the whole product).
VARLEN_TILE = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


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
):
    pdl_wait()
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest rows of queries start first
    seq = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    len_q = tl.load(cu_q_ptr + seq + 1) - q_start
    if pid_m * BLOCK_M >= len_q:
        return
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


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
    tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    out = torch.empty(tokens, heads, d_v, dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or batch == 0:
        return out.zero_()
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # read at cu_ptr + b
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one sync per prefill
    tile = dict(VARLEN_TILE)
    block_m = min(tile.pop("BLOCK_M"), 64) if INTERPRET else tile.pop("BLOCK_M")
    main = next_pow2(d_qk) // 2 if next_pow2(d_qk) != d_qk else d_qk
    tail = next_pow2(d_qk - main) if main != d_qk else 0
    if 0 < tail < 16:  # a dot needs K >= 16: pad the whole head dim instead (e.g. 40 -> 64)
        main, tail = next_pow2(d_qk), 0
    _varlen_kernel[(triton.cdiv(max_q, block_m), batch, heads)](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        softmax_scale,
        heads // k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        D_QK=d_qk,
        D_V=d_v,
        BLOCK_DQK=main,
        BLOCK_DTAIL=tail,
        BLOCK_DV=next_pow2(d_v),
        CAUSAL=causal,
        BLOCK_M=block_m,
        FP32_DOT=INTERPRET,
        **tile,
        launch_pdl=PDL,
    )
    return out


def varlen_supports(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> bool | Decline:
    answer = placed(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if not answer:
        return answer
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            return Decline(f"{name}'s last dimension is not contiguous")
    if max(q.shape[2], v.shape[2]) > 256:
        return Decline(f"head dims {q.shape[2]} (q) and {v.shape[2]} (v): more than 256")
    return True


# --- write_kv_cache -----------------------------------------------------------------------------------------------


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


def write_kv_cache(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format):
    if latent.shape[0] == 0:
        return
    fp8 = kv_format == "fp8_ds_mla"
    flat = kv_cache.view(-1)
    rope_dim = latent.shape[1] - kv_lora_rank
    _write_kernel[(latent.shape[0],)](
        latent,
        slot_mapping.contiguous(),  # read at slots_ptr + t
        flat,
        flat.view(torch.float32) if fp8 else flat,
        flat.view(torch.bfloat16) if fp8 else flat,
        latent.stride(0),
        L=kv_lora_rank,
        R=rope_dim,
        BLOCK_R=next_pow2(rope_dim),
        WIDTH=kv_cache.shape[2],
        FP8=fp8,
        PREROUND=INTERPRET,
        launch_pdl=PDL,
    )


def write_supports(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format) -> bool | Decline:
    answer = placed(latent=latent, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if not answer:
        return answer
    if latent.stride(1) != 1:
        return Decline("latent's last dimension is not contiguous")
    if kv_lora_rank != next_pow2(kv_lora_rank):
        return Decline(f"kv_lora_rank {kv_lora_rank} is not a power of two")
    if kv_format != "bf16" and kv_lora_rank % FP8_GROUP:
        return Decline(f"kv_lora_rank {kv_lora_rank} is not a multiple of {FP8_GROUP} for {kv_format}")
    return True
