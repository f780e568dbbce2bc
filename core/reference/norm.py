"""Reference ``rms_norm``."""

from __future__ import annotations

import torch


def rms_norm(x, w, eps, residual):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h
