"""Normalisation on Ascend: ``rms_norm`` -> ``npu_rms_norm`` / ``npu_add_rms_norm`` (torch_npu, op-plugin docs);
``layer_norm`` -> ``torch.nn.functional.layer_norm``.

``npu_add_rms_norm(x1, x2, gamma, epsilon)`` returns ``(y, rstd, x1 + x2)``: the sum comes back in the input
dtype and is the new residual stream ``h``. The docs do not say whether the norm is taken of the rounded sum (the
core's contract) or of the fp32 sum; the difference is below one bf16 rounding of ``y``. ``npu_rms_norm`` takes x of
2 to 8 dims, so a 1-D x goes in as one row. gamma of another dtype than x (which ``npu_add_rms_norm`` refuses;
``npu_rms_norm`` takes an fp32 one for an fp16/bf16 x) and empty x (which ``npu_add_rms_norm`` refuses) run plain
torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import Decline

from . import probe


def rms_norm_fused(x, w, eps, residual) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` through ``npu_rms_norm`` (no residual) or ``npu_add_rms_norm``."""
    npu = probe.torch_npu()
    x = x.contiguous()  # (the operators' docs name no strides)
    if residual is None:  # npu_rms_norm takes x of 2 to 8 dims (npu_add_rms_norm also 1)
        return npu.npu_rms_norm(x.view(1, -1) if x.dim() == 1 else x, w, epsilon=eps)[0].view(x.shape), x
    y, _, h = npu.npu_add_rms_norm(x, residual, w, epsilon=eps)
    return y, h


def rms_norm_fused_supports(x, w, eps, residual) -> bool | Decline:
    if not (answer := probe.placed(x=x, w=w, residual=residual)):
        return answer
    if w.dtype != x.dtype:
        return Decline(f"w is {w.dtype}, x {x.dtype}: expected one dtype")
    if x.numel() == 0:
        return Decline("x is empty")
    if x.dim() > 8:
        return Decline(f"x has {x.dim()} dimensions > 8")
    return True


def rms_norm_torch(x, w, eps, residual) -> tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.square().mean(dim=-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h


def layer_norm_torch(x, w, b, eps) -> torch.Tensor:
    """The contract's fp32 LayerNorm (biased variance), returned in x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps).to(x.dtype)
