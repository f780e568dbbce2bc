"""Activations on Ascend: ``silu_and_mul`` -> ``npu_swiglu`` (torch_npu, op-plugin docs: ``silu(A) * B`` with A the
first half of the last dim, B the second).

With ``quantize=True`` the product is computed by ``npu_swiglu`` on an fp32 copy of x (the operator takes fp32)
and quantised per (1, 128) in plain torch, so the FP8 output is quantised from the fp32 product as the contract
says; ``npu_dynamic_block_quant`` takes only fp16/bf16 input, and quantising a bf16-rounded product would move
about one value in sixty-four by one e4m3 step.
"""

from __future__ import annotations

import torch

from deepinfer import QTensor

from . import probe
from .gemm import quantize_rows_torch


def silu_and_mul_swiglu(x, *, quantize, scale_format, masked_m) -> torch.Tensor | QTensor:
    """``silu_and_mul`` through ``npu_swiglu``, over every row (those past ``masked_m`` are unspecified)."""
    half = x.shape[-1] // 2
    if x.numel() == 0:
        y = x.new_zeros(*x.shape[:-1], half, dtype=torch.float32)
        return quantize_rows_torch(y, 128, scale_format) if quantize else y.to(x.dtype)
    npu = probe.torch_npu()
    if quantize:
        return quantize_rows_torch(npu.npu_swiglu(x.float().contiguous(), dim=-1), 128, scale_format)
    return npu.npu_swiglu(x.contiguous(), dim=-1)


def silu_and_mul_swiglu_supports(x, *, quantize, scale_format, masked_m) -> bool:
    return probe.on_device(x) and (not quantize or probe.has("fp8_e4m3"))
