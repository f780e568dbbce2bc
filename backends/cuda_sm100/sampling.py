"""``sample``: temperature, top-k and top-p filtering with torch on the device, then a seeded exponential race in
Triton: the token is argmax(p / E) with E = -log(u) and u drawn by Philox from (the row's seed, the token id), so a
row's draw depends on nothing but its own seed and logits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import on_device


@triton.jit
def _race_kernel(probs_ptr, seeds_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        mask = idx < V
        p = tl.load(probs_ptr + row * V + idx, mask=mask, other=0.0)
        u = tl.rand(seed, idx)
        race = tl.where(mask, p / -tl.log(u), -1.0)  # u = 0 gives an infinite wait: never chosen
        better = race > best
        best = tl.where(better, race, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, V), axis=0))


def _filtered_probs(logits: torch.Tensor, temperature, top_p, top_k) -> torch.Tensor:
    vocab = logits.shape[1]
    x = logits.float() / torch.where(temperature == 0, 1.0, temperature)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    keep_sorted = sorted_x >= sorted_x.gather(1, (k - 1)[:, None])  # ties with the k-th are kept
    p_sorted = sorted_x.masked_fill(~keep_sorted, float("-inf")).softmax(dim=-1)
    before = p_sorted.cumsum(dim=-1) - p_sorted
    keep_sorted &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x.masked_fill(~keep, float("-inf")).softmax(dim=-1)


def sample(logits, temperature, top_p, top_k, seeds):
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    if batch == 0:
        return out
    probs = _filtered_probs(logits, temperature, top_p, top_k).contiguous()
    _race_kernel[(batch,)](probs, seeds, out, vocab, BLOCK=1024)
    return torch.where(temperature == 0, logits.argmax(dim=-1).to(torch.int32), out)


def supports(logits, temperature, top_p, top_k, seeds) -> bool:
    return on_device(logits, temperature, top_p, top_k, seeds)
