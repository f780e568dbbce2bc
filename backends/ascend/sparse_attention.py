"""DeepSeek Sparse Attention on Ascend: ``write_index_cache``, ``indexer_topk``, ``sparse_mla``.

Fused operators (torch_npu, op-plugin docs ``docs/en/custom_APIs/torch_npu``; the 950's rules from the operators'
READMEs in CANN's ops-transformer):
- ``indexer_topk`` -> ``npu_lightning_indexer``: TND query with cumulative ``actual_seq_lengths_query``, PA_BSND key
  ``[blocks, block_size, 1, 128]`` with ``block_table`` and per-sequence ``actual_seq_lengths_key``, ``sparse_mode``
  3 (rightDownCausal: query i of a sequence's L sees positions <= n - L + i, the core's rule), ``sparse_count`` =
  topk. It returns logical positions within each sequence. The docs say nothing of their order, of ties or of what
  fills a row past the positions a query sees, so the wrapper re-establishes the core's contract from what is
  documented: it keeps the first ``min(topk, visible)`` entries that lie in the query's visible range, sorts them
  ascending, maps them through the block table to cache slots and pads with -1. The tie-break (the lower position)
  cannot be re-established from positions alone: the conformance's exact-tie case checks it (README assumption 23).
  Keys must be bf16/fp16, so an ``fp8_ds_index`` cache is dequantised first into bf16 pages (exactly: e4m3 times a
  power of two is a bf16 value). The 950 takes weights only in q's dtype: there they are rounded to bf16.
- ``sparse_mla`` -> ``npu_sparse_flash_attention`` (MLA-absorb, ``attention_mode`` 2, ``return_softmax_lse``). Our
  indices are cache slots with -1 anywhere; the operator takes positions in a sequence's KV, valid ones first. The
  wrapper gathers the distinct listed slots into contiguous nope and rope planes (the docs want contiguous key,
  value and key_rope; the core's cache interleaves them; ``fp8_ds_mla`` records are dequantised in that copy,
  exactly), passes the planes as ONE TND sequence with all queries as one TND batch and ``sparse_mode`` 0, and
  rewrites each row to row numbers in the planes: ascending, valid first, -1 last. lse = softmax_max +
  log(softmax_sum). ``npu_kv_quant_sparse_flash_attention`` would read the 656-byte records without the copy, but
  it returns no lse, which the contract requires.
- ``write_index_cache`` -> ``npu_scatter_nd_update_`` on the cache viewed as ``[slots, width]`` (an int8 view for
  ``fp8_ds_index``: the docs list int8, not uint8); fp8 records are packed in plain torch first.

Rows the operators leave undefined (a query with no slot listed) are overwritten with the contract's zeros and
``-inf`` lse. Other shapes run the plain-torch composites at the bottom of the file.
"""

from __future__ import annotations

import math

import torch

from deepinfer import Decline
from deepinfer.index_cache import pack_fp8_ds_index, unpack_fp8_ds_index
from deepinfer.reference import sparse_attention as reference

from . import probe
from .attention import MLA_HEADS, MLA_NOPE, MLA_ROPE, scatter_rows, unpack_records

LI_HEAD_DIM = 128  # the indexer's only documented head dim
LI_MAX_HEADS = 64
LI_950_HEADS = (8, 16, 24, 32, 64)
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
SFA_MAX_HEADS = 128
INT32_LIMIT = 2**31 - 1
NO_SLOT = -1
SCORES_PER_CHUNK = 1 << 24  # fp32 scores the composites hold at once

#: The conformance tolerance of ``indexer_topk`` where the indexer takes weights only in q's dtype (the 950).
BF16_WEIGHTS_TOLERANCE = (
    5e-3,
    "Ascend 950: npu_lightning_indexer takes weights only in the dtype of q, so the contract's fp32 head weights "
    "are rounded to bf16 (up to 2^-8 relative each), which moves a score by up to 2^-8 of its sum of |terms|. "
    "Through the test double at H=64, D=128, topk=2048 the worst gap was 1.5e-3 to 1.9e-3 over 10 seeds (median "
    "1.0e-3), against the default 1e-3; with fp32 weights (A2/A3) it is 0. Integer-valued inputs stay exact.",
)


def _block_size_ok(block_size: int) -> bool:
    return 0 < block_size <= 1024 and block_size % 16 == 0


# ---------------------------------------------------------------------------------------------------------------
# indexer_topk


def _token_rows(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, tokens: int):
    """Per packed query: ``(sequence, visible)``, where query i of a sequence of L queries and n cached tokens sees
    ``visible = n - L + i + 1`` positions. No host synchronisation."""
    cu = cu_seqlens_q.long()
    lens_q = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens_q.numel(), device=cu.device), lens_q, output_size=tokens)
    i = torch.arange(tokens, device=cu.device) - cu[seq]
    return seq, seq_lens.long()[seq] - lens_q[seq] + i + 1


def positions_to_slots(
    positions: torch.Tensor, seq: torch.Tensor, visible: torch.Tensor, block_table: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The indexer's rows ``[T, K]`` of positions (any order; entries past the first ``min(K, visible)`` undefined)
    -> the core's rows: the kept positions' cache slots in ascending position order, then -1 (int32)."""
    k = positions.shape[1]
    pos = positions.long()
    col = torch.arange(k, device=pos.device)
    kept = (col[None, :] < visible.clamp(max=k)[:, None]) & (pos >= 0) & (pos < visible[:, None])
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(kept, pos, big), dim=-1).values  # ascending position, the unkept last
    valid = ordered != big
    ordered = torch.where(valid, ordered, 0)
    pages = block_table.long()[seq[:, None], ordered // block_size]
    return torch.where(valid, pages * block_size + ordered % block_size, NO_SLOT).to(torch.int32)


def _used_table(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, n_pages: int) -> torch.Tensor:
    """``block_table[:, :n_pages]`` with entries past each sequence's pages (not validated by the core, possibly
    -1) replaced by page 0, which is never read."""
    steps = torch.arange(n_pages, device=block_table.device) * block_size
    used = steps[None, :] < seq_lens.to(block_table.device)[:, None]
    return torch.where(used, block_table[:, :n_pages], 0).to(torch.int32).contiguous()


def _bf16_keys(index_cache, block_table, seq_lens, head_dim: int, dtype: torch.dtype):
    """The indexer's PA_BSND key ``[blocks, block_size, 1, head_dim]`` in ``dtype`` and its block table.

    bf16: the cache itself. fp8_ds_index: dequantised bf16 pages, exact. Either the pages the batch reads, in table
    order with a compact table, or the whole cache with the batch's table, whichever is fewer pages (one host
    synchronisation, for the longest sequence)."""
    num_blocks, block_size = index_cache.shape[:2]
    batch, width = block_table.shape
    if index_cache.dtype != torch.uint8:
        return index_cache.unsqueeze(2), _used_table(block_table, seq_lens, block_size, width)
    n_pages = max(1, math.ceil(int(seq_lens.max()) / block_size)) if batch else 1
    if batch * n_pages < num_blocks:
        index = _used_table(block_table, seq_lens, block_size, n_pages).reshape(-1).long()
        pages = index_cache.index_select(0, index)
        table = torch.arange(batch * n_pages, dtype=torch.int32, device=block_table.device).view(batch, n_pages)
    else:
        pages, table = index_cache, _used_table(block_table, seq_lens, block_size, width)
    keys = unpack_fp8_ds_index(pages, head_dim).to(dtype)  # e4m3 x 2^k: exact in bf16
    return keys.unsqueeze(2).contiguous(), table


def indexer_topk_lightning(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk) -> torch.Tensor:
    """``indexer_topk`` through ``npu_lightning_indexer`` (TND query, PA_BSND key, rightDownCausal)."""
    npu = probe.torch_npu()
    tokens, _, head_dim = q.shape
    if tokens == 0:
        return torch.empty(0, topk, dtype=torch.int32, device=q.device)
    block_size = index_cache.shape[1]
    key, table = _bf16_keys(index_cache, block_table, seq_lens, head_dim, q.dtype)
    # The 950 takes weights only in the dtype of q (README assumption 24); A2/A3 take the contract's fp32.
    w = weights if probe.has("dsa_fp32_weights") else weights.to(q.dtype)
    positions, _ = npu.npu_lightning_indexer(
        q.contiguous(),
        key,
        w.contiguous(),
        actual_seq_lengths_query=cu_seqlens_q[1:].to(torch.int32).contiguous(),  # TND: cumulative
        actual_seq_lengths_key=seq_lens.to(torch.int32).contiguous(),  # PA_BSND: per sequence
        block_table=table,
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=topk,
        sparse_mode=3,  # rightDownCausal: query i of L sees positions <= n - L + i
    )
    seq, visible = _token_rows(cu_seqlens_q, seq_lens, tokens)
    return positions_to_slots(positions[:, 0], seq, visible, block_table, block_size)


def indexer_topk_lightning_supports(
    q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk
) -> bool | Decline:
    """The documented envelope: bf16 q (the key takes q's dtype), head dim 128, query heads up to 64 (the 950: 8,
    16, 24, 32 or 64), page size a multiple of 16 up to 1024, sparse_count in [1, 2048] or 3072..8192 by 1024;
    fp8_ds_index keys are dequantised on the device, which needs e4m3 there."""
    heads, block_size = q.shape[1], index_cache.shape[1]
    tensors = dict(q=q, weights=weights, index_cache=index_cache, block_table=block_table)
    if not (answer := probe.placed(**tensors, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)):
        return answer
    if not (answer := probe.capable("dsa")):
        return answer
    if q.dtype != torch.bfloat16:
        return Decline(f"q is {q.dtype}, expected torch.bfloat16")
    if q.shape[2] != LI_HEAD_DIM:
        return Decline(f"q's head dim {q.shape[2]}, expected {LI_HEAD_DIM}")
    if probe.has("dsa_indexer_any_heads"):
        if not 1 <= heads <= LI_MAX_HEADS:
            return Decline(f"q has {heads} heads, expected 1 to {LI_MAX_HEADS}")
    elif heads not in LI_950_HEADS:
        return Decline(f"q has {heads} heads, expected one of {sorted(LI_950_HEADS)}")
    if topk not in LI_SPARSE_COUNTS:
        return Decline(f"topk {topk}: expected 1 to 2048, or 3072 to 8192 by 1024")
    if not _block_size_ok(block_size):
        return Decline(f"index_cache's pages of {block_size} tokens, expected a multiple of 16 up to 1024")
    if index_cache.dtype != torch.bfloat16 and not (answer := probe.capable("fp8_e4m3")):
        return answer
    if index_cache.shape[0] * block_size > INT32_LIMIT:
        return Decline("index_cache holds more tokens than int32 counts")
    return True


# ---------------------------------------------------------------------------------------------------------------
# sparse_mla


def compact_rows(indices: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``indices [T, K]`` (cache slots, -1 anywhere) -> row numbers in ``slots`` (sorted, distinct, holding every
    listed slot, possibly -1 too): each row ascending, valid entries first, -1 last, repeats kept (int32)."""
    listed = indices >= 0
    local = torch.searchsorted(slots, indices.long().clamp_min(0))
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(listed, local, big), dim=-1).values
    return torch.where(ordered == big, NO_SLOT, ordered).to(torch.int32)


def _planes(rows: torch.Tensor, kv_lora_rank: int, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous bf16 nope ``[U, R]`` and rope ``[U, rope]`` of gathered cache rows (fp8 dequantised, exactly)."""
    if kv_format == "bf16":
        return rows[:, :kv_lora_rank].contiguous(), rows[:, kv_lora_rank:].contiguous()
    nope, rope = unpack_records(rows, kv_lora_rank)
    return nope.contiguous(), rope.contiguous()


def sparse_mla_sfa(
    q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mla`` through ``npu_sparse_flash_attention``: the listed slots become one TND key sequence."""
    npu = probe.torch_npu()
    tokens, heads, _ = q.shape
    zeros = q.new_zeros(tokens, heads, kv_lora_rank)
    no_lse = torch.full((tokens, heads), float("-inf"), device=q.device)
    if tokens == 0:
        return zeros, no_lse
    # Sorted distinct entries, -1 first where a row has padding: its size is the one host synchronisation. The -1
    # entry stays (dropping it would cost another) and becomes a spare row (slot 0) that no index points to.
    slots = torch.unique(indices).long()
    if slots.numel() == 1 and int(slots[0]) < 0:  # nothing listed anywhere
        return zeros, no_lse
    rows = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots.clamp_min(0))
    nope, rope = _planes(rows, kv_lora_rank, kv_format)
    key = nope.unsqueeze(1)  # [U, KV_N = 1, 512]; MLA-absorb: key and value are the same tensor
    out, softmax_max, softmax_sum = npu.npu_sparse_flash_attention(
        q[..., :kv_lora_rank].contiguous(),
        key,
        key,
        compact_rows(indices, slots).unsqueeze(1).contiguous(),  # [T, KV_N = 1, topk]
        softmax_scale,
        actual_seq_lengths_query=torch.tensor([tokens], dtype=torch.int32, device=q.device),  # one TND batch
        actual_seq_lengths_kv=torch.tensor([slots.numel()], dtype=torch.int32, device=q.device),
        query_rope=q[..., kv_lora_rank:].contiguous(),
        key_rope=rope.unsqueeze(1),
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="TND",
        sparse_mode=0,  # the list is the mask
        attention_mode=2,  # MLA-absorb
        return_softmax_lse=True,
    )
    # softmax_max / softmax_sum are [KV_N, T, N]; max of the scaled scores (README assumption 26).
    lse = (softmax_max[0] + torch.log(softmax_sum[0])).float()
    sees = (indices >= 0).any(dim=1)  # a row with nothing listed is undefined for the operator: zeros, -inf
    out = torch.where(sees[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, torch.where(sees[:, None], lse, no_lse)


def sparse_mla_sfa_supports(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format) -> bool | Decline:
    """The documented envelope: bf16 q, nope 512 + rope 64, query heads 1..128 on the 950, powers of two up to 128
    on A2/A3; fp8_ds_mla is dequantised on the device, which needs e4m3 there."""
    heads = q.shape[1]
    if not (answer := probe.placed(q=q, kv_cache=kv_cache, indices=indices)):
        return answer
    if not (answer := probe.capable("dsa")):
        return answer
    if q.dtype != torch.bfloat16:
        return Decline(f"q is {q.dtype}, expected torch.bfloat16")
    if kv_lora_rank != MLA_NOPE or q.shape[2] != MLA_NOPE + MLA_ROPE:
        return Decline(f"kv_lora_rank {kv_lora_rank} and q's width {q.shape[2]}, expected {MLA_NOPE} and 576")
    if probe.has("dsa_sfa_any_heads"):
        if not 1 <= heads <= SFA_MAX_HEADS:
            return Decline(f"q has {heads} heads, expected 1 to {SFA_MAX_HEADS}")
    elif heads not in MLA_HEADS:
        return Decline(f"q has {heads} heads, expected one of {MLA_HEADS}")
    if kv_format != "bf16" and not (answer := probe.capable("kv_fp8_ds_mla")):
        return answer
    if kv_cache.shape[0] * kv_cache.shape[1] > INT32_LIMIT:
        return Decline("kv_cache holds more tokens than int32 counts")
    return True


# ---------------------------------------------------------------------------------------------------------------
# write_index_cache


def write_index_cache_scatter(k, index_cache, slot_mapping) -> None:
    """``write_index_cache`` through ``npu_scatter_nd_update_``."""
    scatter_rows(index_cache, slot_mapping, k, None if index_cache.dtype == torch.bfloat16 else pack_fp8_ds_index)


def write_index_cache_scatter_supports(k, index_cache, slot_mapping) -> bool | Decline:
    answer = probe.placed(k=k, index_cache=index_cache, slot_mapping=slot_mapping)
    if answer and index_cache.dtype != torch.bfloat16:
        return probe.capable("fp8_e4m3")
    return answer


# ---------------------------------------------------------------------------------------------------------------
# Plain-torch composites (run on the NPU for shapes the fused operators do not take).


# The indexer's composite is the reference's plain torch (one sequence at a time, fp32 scores, a stable sort), which
# runs on the NPU as on any torch device.
indexer_topk_torch = reference.indexer_topk


def sparse_mla_torch(
    q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of queries at a time: gathers each row's listed tokens and attends in fp32 (a repeated slot counts
    each time it is listed; a row with nothing listed gives zeros and -inf)."""
    tokens, heads, d_qk = q.shape
    topk = indices.shape[1]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    out = torch.zeros(tokens, heads, kv_lora_rank, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), device=q.device)
    step = max(1, SCORES_PER_CHUNK // max(1, topk * max(d_qk, heads)))
    for s in range(0, tokens, step):
        e = min(tokens, s + step)
        idx = indices[s:e].long()
        listed = idx >= 0
        rows = flat.index_select(0, idx.clamp_min(0).reshape(-1))
        if kv_format == "bf16":
            kv = rows.float()
        else:
            nope, rope = unpack_records(rows, kv_lora_rank)
            kv = torch.cat([nope.float(), rope.float()], dim=-1)
        kv = kv.view(e - s, topk, d_qk).masked_fill(~listed[..., None], 0.0)  # -1 entries read slot 0: zeroed
        scores = torch.einsum("thd,tkd->thk", q[s:e].float(), kv) * softmax_scale
        scores = scores.masked_fill(~listed[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[s:e] = torch.einsum("thk,tkd->thd", p, kv[..., :kv_lora_rank])
        lse[s:e] = row_lse
    return out.to(q.dtype), lse
