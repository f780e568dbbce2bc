"""Reference ``write_index_cache``, ``indexer_topk``, ``sparse_mla``: fp32 math, one sequence (or a few queries)
at a time."""

from __future__ import annotations

import torch

from ..index_cache import pack_fp8_ds_index, read_keys
from ..kv_cache import read_tokens
from .attention import SCORES_PER_CHUNK, _attend

NO_SLOT = -1


def write_index_cache(k, index_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots, rows = slot_mapping[keep], k[keep]
    flat = index_cache.view(-1, index_cache.shape[-1])
    if index_cache.dtype == torch.uint8:
        flat[slots] = pack_fp8_ds_index(rows)
    else:
        flat[slots] = rows.to(index_cache.dtype)


def sequence_slots(block_table_row: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """The cache slots (int64) of positions ``0 .. n-1`` of a sequence with this block table row."""
    pos = torch.arange(n, device=block_table_row.device)
    return block_table_row[pos // block_size].long() * block_size + pos % block_size


def indexer_scores(q, weights, keys, first_visible: int) -> torch.Tensor:
    """``I [L, n]`` fp32 of ``L`` consecutive queries ``q [L, H, D]`` over ``keys [n, D]``: query ``i`` sees
    positions ``< first_visible + i``; the positions it does not see score ``-inf``."""
    scores = torch.einsum("lhd,nd->lhn", q.float(), keys.float()).relu_()
    total = torch.einsum("lhn,lh->ln", scores, weights.float())
    i = torch.arange(q.shape[0], device=q.device)[:, None]
    p = torch.arange(keys.shape[0], device=q.device)[None, :]
    return total.masked_fill(p >= first_visible + i, float("-inf"))


def top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row of ``scores [L, n]`` (``-inf``: not visible), the ``min(topk, visible)`` positions of highest score
    (ties: the lower position) in ascending order, then ``-1``: ``[L, topk]`` int64."""
    rows, n = scores.shape
    out = torch.full((rows, topk), NO_SLOT, dtype=torch.int64, device=scores.device)
    if n == 0 or rows == 0:
        return out
    k = min(topk, n)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # stable: lower position first
    visible = scores.gather(1, order) > float("-inf")
    chosen = torch.where(visible, order, n).sort(dim=-1).values  # ascending, the unseen (n) last
    out[:, :k] = torch.where(chosen < n, chosen, NO_SLOT)
    return out


def indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk):
    tokens, heads, head_dim = q.shape
    block_size = index_cache.shape[1]
    out = torch.full((tokens, topk), NO_SLOT, dtype=torch.int32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        start, stop = cu[b], cu[b + 1]
        if stop == start or n == 0:  # no queries, or a padding sequence: nothing to keep
            continue
        slots = sequence_slots(block_table[b], n, block_size)
        keys = read_keys(index_cache, slots, head_dim)
        step = max(1, SCORES_PER_CHUNK // max(1, heads * n))  # queries scored at once
        for s in range(start, stop, step):
            e = min(stop, s + step)
            scores = indexer_scores(q[s:e], weights[s:e], keys, n - (stop - start) + (s - start) + 1)
            pos = top_positions(scores, topk)
            out[s:e] = torch.where(pos >= 0, slots[pos.clamp_min(0)], NO_SLOT).to(torch.int32)
    return out


def sparse_mla(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format):
    tokens, heads, _ = q.shape
    out = torch.zeros(tokens, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(tokens):  # one query at a time: a row's arithmetic never depends on the others
        slots = indices[t][indices[t] >= 0]
        if slots.numel():
            kv = read_tokens(kv_cache, slots, kv_lora_rank).unsqueeze(1)  # [n, 1, D_qk]
            visible = torch.ones(1, slots.numel(), dtype=torch.bool, device=q.device)
            o, row_lse = _attend(q[t : t + 1], kv, kv[..., :kv_lora_rank], visible, softmax_scale)
            out[t], lse[t] = o[0], row_lse[0]
    return out.to(q.dtype), lse
