"""DeepSeek-V4's compressed attention on Ascend (``compress_kv``, ``indexer_topk_entries``,
``sparse_attention_sinks``): plain torch on the NPU, in fp32.

No documented torch_npu operator takes per-head sinks over a list of pool rows, nor a gated softmax pooling of
windows, nor a top-k over ragged ranges of compressed entries (``npu_lightning_indexer`` reads a paged cache by
position), so these are composites: gathers, batched products and ``torch.topk``, vectorised over the batch.
"""

from __future__ import annotations

import torch


def compress_kv_torch(kv, gate, position_bias):
    weights = torch.softmax(gate.float() + position_bias.float(), dim=1).to(kv.dtype)
    return (weights.float() * kv.float()).sum(dim=1).to(kv.dtype)


def indexer_topk_entries_torch(q, weights, keys, key_start, key_count, *, topk, max_count=None):
    tokens = q.shape[0]
    out = torch.full((tokens, topk), -1, dtype=torch.int32, device=q.device)
    width = (int(key_count.max()) if max_count is None else max_count) if tokens else 0
    if width == 0 or keys.shape[0] == 0:  # no key to score (every count is then 0)
        return out
    offs = torch.arange(width, device=q.device)
    rows = key_start.long()[:, None] + offs[None, :]  # [T, width]
    seen = offs[None, :] < key_count.long()[:, None]
    k = keys.float()[rows.clamp_max(keys.shape[0] - 1)]  # [T, width, D]
    scores = torch.einsum("thd,tnd->thn", q.float(), k).relu_()
    total = (scores * weights.float()[:, :, None]).sum(dim=1).masked_fill(~seen, float("-inf"))
    kk = min(topk, width)
    # stable descending sort: a tie goes to the lower row
    order = torch.sort(total, dim=-1, descending=True, stable=True).indices[:, :kk]
    keep = total.gather(1, order) > float("-inf")
    chosen = torch.where(keep, order, width).sort(dim=-1).values
    out[:, :kk] = torch.where(chosen < width, chosen + key_start.long()[:, None], -1).to(torch.int32)
    return out


def sparse_attention_sinks_torch(q, kv, indices, sinks, *, softmax_scale):
    tokens, heads, _ = q.shape
    if tokens == 0:
        return torch.empty_like(q)
    listed = indices >= 0
    v = kv.float()[indices.long().clamp_min(0)]  # [T, K, D]
    scores = torch.einsum("thd,tkd->thk", q.float(), v) * softmax_scale
    scores = scores.masked_fill(~listed[:, None, :], float("-inf"))
    logits = torch.cat([scores, sinks.float()[None, :, None].expand(tokens, heads, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, v).to(q.dtype)
