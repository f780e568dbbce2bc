"""Reference ``compress_kv``, ``indexer_topk_entries``, ``sparse_attention_sinks``: fp32 math, one query at a time
where rows could otherwise influence each other's rounding."""

from __future__ import annotations

import torch

from .sparse_attention import NO_SLOT, top_positions


def compress_kv(kv, gate, position_bias):
    out = torch.empty(kv.shape[0], kv.shape[2], dtype=kv.dtype, device=kv.device)
    for w in range(kv.shape[0]):  # one window at a time: its sums never depend on the others
        weights = torch.softmax(gate[w].float() + position_bias.float(), dim=0).to(kv.dtype)
        out[w] = (weights.float() * kv[w].float()).sum(dim=0).to(kv.dtype)
    return out


def indexer_topk_entries(q, weights, keys, key_start, key_count, *, topk, max_count=None):
    tokens = q.shape[0]
    out = torch.full((tokens, topk), NO_SLOT, dtype=torch.int32, device=q.device)
    for t, (start, count) in enumerate(zip(key_start.tolist(), key_count.tolist())):
        if count == 0:
            continue
        k = keys[start : start + count].float()
        scores = torch.einsum("hd,nd->hn", q[t].float(), k).relu_()
        total = (scores * weights[t].float()[:, None]).sum(dim=0, keepdim=True)
        pos = top_positions(total, topk)[0]
        out[t] = torch.where(pos >= 0, pos + start, NO_SLOT).to(torch.int32)
    return out


def sparse_attention_sinks(q, kv, indices, sinks, *, softmax_scale):
    tokens, heads, dim = q.shape
    out = torch.zeros(tokens, heads, dim, dtype=torch.float32, device=q.device)
    for t in range(tokens):
        rows = indices[t][indices[t] >= 0].long()
        if rows.numel() == 0:
            continue
        v = kv[rows].float()  # [n, D]
        scores = (q[t].float() @ v.T) * softmax_scale  # [H, n]
        logits = torch.cat([scores, sinks.float()[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, :-1]
        out[t] = probs @ v
    return out.to(q.dtype)
