"""Reference ``rms_norm`` and ``layer_norm``."""

from __future__ import annotations

import torch


def rms_norm(x, w, eps, residual):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h


def layer_norm(x, w, b, eps):
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    return ((xf - mean) * torch.rsqrt(var + eps) * w.float() + b.float()).to(x.dtype)
