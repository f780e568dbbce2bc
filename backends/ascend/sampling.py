"""Sampling on Ascend: ``sample`` in plain torch on the NPU (torch_npu has no per-request-seeded sampler), and
``apply_token_bitmask`` in plain torch (integer shifts and a masked fill, all native on the NPU).

Every row draws from its own counter-based random stream: the uniform for (row, token) is a 32-bit integer hash
of the row's seed and the token index, so a row's token depends only on its logits, parameters and seed, never
on the batch (no shared generator state, no host synchronisation). The draw is the Gumbel-max trick over the
kept tokens; filtering follows the contract (top-k keeps ties with the k-th value, top-p the smallest most-likely
prefix reaching p, both after the temperature).
"""

from __future__ import annotations

import torch

from deepinfer import Decline

from . import probe

MASK32 = 0xFFFFFFFF
MIX = 0x045D9F3B  # < 2^27, so products of 32-bit values stay inside int64


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * MIX) & MASK32
    h = h ^ (h >> 16)
    h = (h * MIX) & MASK32
    return h ^ (h >> 16)


def uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` uniforms in (0, 1): entry (b, i) depends only on ``seeds[b]`` and i."""
    index = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    low, high = seeds[:, None] & MASK32, (seeds[:, None] >> 32) & MASK32
    h = _mix(_mix(_mix(index + 0x9E3779B9) ^ high) ^ low)
    h = _mix(h ^ ((low * 3 + 0x7F4A7C15) & MASK32))
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample_torch(logits, temperature, top_p, top_k, seeds) -> torch.Tensor:
    """``sample`` with per-row hashed Gumbel noise (batch-invariant by construction)."""
    batch, vocab = logits.shape
    if batch == 0:
        return torch.zeros(0, dtype=torch.int32, device=logits.device)
    raw = logits.float()
    greedy = temperature == 0
    scaled = raw / torch.where(greedy, 1.0, temperature)[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k.long(), vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    keep = scaled >= kth
    probs = torch.softmax(torch.where(ordered >= kth, ordered, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely kept tokens
    in_p = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= torch.zeros_like(keep).scatter_(1, order, in_p)
    gumbel = -torch.log(-torch.log(uniforms(seeds.long(), vocab)))
    drawn = torch.argmax(torch.where(keep, scaled + gumbel, float("-inf")), dim=-1)
    return torch.where(greedy, torch.argmax(raw, dim=-1), drawn).to(torch.int32)


def sample_torch_supports(logits, temperature, top_p, top_k, seeds) -> bool | Decline:
    return probe.placed(logits=logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds)


def apply_token_bitmask_torch(logits, bitmask) -> torch.Tensor:
    token = torch.arange(logits.shape[1], device=logits.device)
    words = bitmask.long().index_select(1, token // 32)
    return logits.masked_fill((words >> (token % 32)) & 1 == 0, float("-inf"))
