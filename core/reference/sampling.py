"""Reference ``sample`` (one row at a time, each with its own generator seeded by the row's seed) and
``apply_token_bitmask`` (each token's bit read out of its word)."""

from __future__ import annotations

import torch


def _keep_mask(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.numel():
        keep &= logits >= logits.topk(top_k).values[-1]
    if top_p < 1.0:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < top_p  # the smallest prefix reaching top_p (the first is always kept)
        keep &= torch.zeros_like(keep).scatter_(0, order, keep_sorted)
    return keep


def sample(logits, temperature, top_p, top_k, seeds):
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    for b in range(logits.shape[0]):
        row, temp = logits[b].float(), float(temperature[b])
        if temp == 0.0:
            out[b] = int(torch.argmax(row))
            continue
        row = row / temp
        keep = _keep_mask(row, int(top_k[b]), float(top_p[b]))
        probs = row.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        gen = torch.Generator(device=logits.device).manual_seed(int(seeds[b]))
        race = torch.empty_like(probs).exponential_(generator=gen)  # argmax p / Exp(1) draws from p
        out[b] = int(torch.argmax(probs / race))
    return out


def apply_token_bitmask(logits, bitmask):
    vocab = logits.shape[1]
    token = torch.arange(vocab, device=logits.device)
    words = bitmask.long()[:, token // 32]  # int64: the sign bit of the int32 word is an ordinary bit here
    allowed = (words >> (token % 32)) & 1 == 1
    return logits.masked_fill(~allowed, float("-inf"))
