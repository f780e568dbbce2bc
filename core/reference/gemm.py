"""Reference ``quantize_fp8``, ``gemm``, ``grouped_gemm``: dequantise to fp32 (FP8 and FP4 weights alike), multiply
in fp32."""

from __future__ import annotations

import torch

from ..qtensor import FP4Tensor, QTensor, quantize_rows
from ._math import matmul_nt


def quantize_fp8(x, *, block, scale_format):
    return quantize_rows(x, block, scale_format)


def _as_fp32(a, w) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(w, QTensor) and not isinstance(a, QTensor):
        a = quantize_rows(a, 128, w.scale_format)
    af = a.dequantize() if isinstance(a, QTensor) else a.float()
    wf = w.dequantize() if isinstance(w, (QTensor, FP4Tensor)) else w.float()
    return af, wf


def gemm(a, w, *, out_dtype, bias):
    af, wf = _as_fp32(a, w)
    out = matmul_nt(af, wf)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def grouped_gemm(a, w, *, expert_offsets, masked_m, out_dtype, out=None):
    del out  # a new result: the op copies it into `out`
    af, wf = _as_fp32(a, w)
    if masked_m is not None:
        out = torch.zeros(*af.shape[:2], wf.shape[1], dtype=torch.float32, device=af.device)
        for e, m in enumerate(masked_m.tolist()):
            out[e, :m] = matmul_nt(af[e, :m], wf[e])
        return out.to(out_dtype)
    out = torch.empty(af.shape[0], wf.shape[1], dtype=torch.float32, device=af.device)
    bounds = expert_offsets.tolist()
    for e in range(wf.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = matmul_nt(af[lo:hi], wf[e])
    return out.to(out_dtype)
