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

from deepinfer import Decline
from deepinfer.index_cache import FP8_GROUP

from ._triton import INTERPRET, PDL, next_pow2, num_sms, placed
from .attention import _bf16_copy, _mla_merge_kernel, _rope_at
from .sparse_attention_triton import (
    _index_scores_kernel,
    _sparse_mla_kernel,
    _token_rows_kernel,
    _topk_slots_kernel,
    _write_index_kernel,
)

try:
    from . import sparse_mla_gluon
except ImportError:  # a Triton without Gluon's Hopper language: the Triton kernel serves every call
    sparse_mla_gluon = None

# --- write_index_cache ------------------------------------------------------------------------------------------


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
