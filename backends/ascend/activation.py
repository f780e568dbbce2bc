"""Activations on Ascend: ``silu_and_mul`` -> ``npu_swiglu`` (torch_npu, op-plugin docs: ``silu(A) * B`` with A the
first half of the last dim, B the second).

With ``quantize=True`` the product is computed by ``npu_swiglu`` on an fp32 copy of x (the operator takes fp32)
and quantised per (1, 128) in plain torch, so the FP8 output is quantised from the fp32 product as the contract
says; ``npu_dynamic_block_quant`` takes only fp16/bf16 input, and quantising a bf16-rounded product would move
about one value in sixty-four by one e4m3 step.

With ``limit`` (DeepSeek-V4's clipped SwiGLU) the gate and up halves of an fp32 copy of x are clamped in torch
before ``npu_swiglu``, whose documented signature (``npu_swiglu(input, dim=-1)``) has no clamp. The copy is fp32 so
that the bound is the contract's fp32 ``limit`` (a bf16 clamp would round it); the product is cast back to x's dtype.
"""

from __future__ import annotations

import torch

from deepinfer import Decline, QTensor

from . import probe
from .gemm import quantize_rows_torch


def silu_and_mul_swiglu(x, *, quantize, scale_format, masked_m, limit) -> torch.Tensor | QTensor:
    """``silu_and_mul`` through ``npu_swiglu``, over every row (those past ``masked_m`` are unspecified)."""
    half = x.shape[-1] // 2
    if x.numel() == 0:
        y = x.new_zeros(*x.shape[:-1], half, dtype=torch.float32)
        return quantize_rows_torch(y, 128, scale_format) if quantize else y.to(x.dtype)
    npu = probe.torch_npu()
    if limit is not None:
        gate, up = x.float().chunk(2, dim=-1)
        clipped = torch.cat([gate.clamp(max=limit), up.clamp(min=-limit, max=limit)], dim=-1)
        y = npu.npu_swiglu(clipped, dim=-1)
        return quantize_rows_torch(y, 128, scale_format) if quantize else y.to(x.dtype)
    if quantize:
        return quantize_rows_torch(npu.npu_swiglu(x.float().contiguous(), dim=-1), 128, scale_format)
    return npu.npu_swiglu(x.contiguous(), dim=-1)


def silu_and_mul_swiglu_supports(x, *, quantize, scale_format, masked_m, limit) -> bool | Decline:
    answer = probe.placed(x=x)
    if answer and quantize:
        return probe.capable("fp8_e4m3")
    return answer
