"""Reference ``rope``."""

from __future__ import annotations

import torch


def rope(x, positions, cos_sin_cache, interleaved):
    half = x.shape[-1] // 2
    table = cos_sin_cache[positions.long()].unsqueeze(1)  # [T, 1, D]
    cos, sin = table[..., :half], table[..., half:]
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
