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

This file holds the ops' entry points, their ``supports``, the kernel choice and the launch geometry; the Triton
kernels are in ``attention_triton.py``, the Gluon ones in ``mla_gluon.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer import Decline
from deepinfer.kv_cache import FP8_GROUP, fp8_ds_mla_offsets

from ._triton import INTERPRET, PDL, cdiv, device_type, next_pow2, num_sms, on_device, placed, tma_ready
from .attention_triton import _bf16_copy_kernel, _mla_merge_kernel, _mla_split_kernel, _varlen_kernel, _write_kernel

try:
    from . import mla_gluon
except ImportError:  # a Triton without Gluon's Hopper language: the tl split kernel serves every call
    mla_gluon = None

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
# Default mode, where the grid is more than one program per multiprocessor: a last span of at most this share of a
# span is folded into the spans before it. Its programs would wait for a multiprocessor, then read a few blocks and
# write their rows' partials for the merge (at a 4k-token context plus the tokens decoded since: 2 spans, the second
# of a few blocks).
FOLD_SHARE = 0.25


@dataclass(frozen=True)
class MlaTile:
    """The Triton split kernel's launch tile. Measured on the H200 at B=64, ctx=4096 (benchmarks/tile_variants.py,
    NOTES.md): 64 heads with 8 warps beat 32 heads (bf16 cache 0.53 against 0.55 ms, fp8_ds_mla 0.61 against
    1.27 ms); a whole 64-token page per step beat 32 tokens (bf16 0.355 against 0.455 ms, fp8_ds_mla 0.406 against
    0.536 ms)."""

    block_h: int = 64  # heads per program: each program reads its span of the cache once for all of them
    block_n: int = 64  # context tokens per step (and per TMA copy of a block)
    num_warps: int = 8
    num_stages: int = 2


MLA_TILE = MlaTile()
# TMA copies beat pointer loads (bf16 0.314 against 0.339 ms, fp8_ds_mla 0.417 against 0.446 ms).
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


def _spans(programs_per_split: int, context: int, sms: int, invariant: bool) -> tuple[int, int]:
    """The KV spans covering ``context`` tokens, as (tokens per span, spans): ``_split_tokens``' spans, the last folded
    into the others (each lengthened by whole blocks) where ``FOLD_SHARE`` says so."""
    split = _split_tokens(programs_per_split, context, sms, invariant)
    n = cdiv(context, split)
    tail = context - (n - 1) * split
    if invariant or n == 1 or programs_per_split * n <= sms or tail > FOLD_SHARE * split:
        return split, n
    block = MLA_TILE.block_n
    span = cdiv(cdiv(context, n - 1), block) * block
    return span, cdiv(context, span)


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
    block_h = min(MLA_TILE.block_h, max(16, next_pow2(heads)))
    head_blocks = cdiv(heads, block_h)
    context = block_table.shape[1] * page
    sms = num_sms(q.device.index or 0)
    split, n_splits = _spans(batch * s_q * head_blocks, context, sms, invariant)
    fp8 = kv_format == "fp8_ds_mla"
    records = kv_cache.view(-1, kv_cache.shape[2])  # one row per cached token
    rope_records = records.view(torch.bfloat16) if fp8 else records
    rope_at = _rope_at(kv_lora_rank, fp8)
    tma = _mla_tma(records, rope_records, kv_lora_rank // 2, d_qk - kv_lora_rank, rope_at, MLA_TILE.block_n, page)
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
    tile = MLA_TILE
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
            TensorDescriptor.from_tensor(records, [tile.block_n, half]) if tma else flat,
            TensorDescriptor.from_tensor(rope_records, [tile.block_n, rope_dim]) if tma else flat,
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
            split,
            L=kv_lora_rank,
            R=rope_dim,
            WIDTH=kv_cache.shape[2],
            PAGE=page,
            ROPE_AT=rope_at,
            GH=_half_groups(kv_lora_rank),
            FP8=fp8,
            TMA=tma,
            BLOCK_H=grid.block_h,
            FP32_DOT=INTERPRET,
            DIRECT=n_splits == 1,
            BLOCK_N=tile.block_n,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
            launch_pdl=PDL,
        )
    if n_splits > 1:
        _mla_merge_kernel[(batch * s_q * heads,)](
            part_out, part_lse, out, lse, n_splits, L=kv_lora_rank, BLOCK_S=next_pow2(n_splits), CHUNK=8, launch_pdl=PDL
        )
    return out, lse


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


@dataclass(frozen=True)
class VarlenTile:
    """``attention_varlen``'s launch tile. Measured on the H200 at 4 x 4096 tokens, H=128, D 192/128 causal
    (benchmarks/tile_variants.py): 128 x 64 with 8 warps and 3 stages 6.49 ms, 128 x 128 with 2 stages 6.94 ms,
    64 x 64 with 4 warps 10.0 ms."""

    block_m: int = 128  # query rows per program (at most 64 in the interpreter, whose dot materialises the product)
    block_n: int = 64  # keys per step
    num_warps: int = 8
    num_stages: int = 3


VARLEN_TILE = VarlenTile()


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
    tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    out = torch.empty(tokens, heads, d_v, dtype=q.dtype, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or batch == 0:
        return out.zero_()
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()  # read at cu_ptr + b
    tile = VARLEN_TILE
    block_m = min(tile.block_m, 64) if INTERPRET else tile.block_m
    main = next_pow2(d_qk) // 2 if next_pow2(d_qk) != d_qk else d_qk
    tail = next_pow2(d_qk - main) if main != d_qk else 0
    if 0 < tail < 16:  # a dot needs K >= 16: pad the whole head dim instead (e.g. 40 -> 64)
        main, tail = next_pow2(d_qk), 0
    # at most every query in tiles plus one partial tile per sequence: the lengths stay on the device
    _varlen_kernel[(triton.cdiv(tokens, block_m) + batch - 1, heads)](
        q,
        k,
        v,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        batch,
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
        BLOCK_N=tile.block_n,
        BLOCK_B=next_pow2(batch),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
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
