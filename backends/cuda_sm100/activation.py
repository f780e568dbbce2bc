"""``silu_and_mul``: SwiGLU in fp32, optionally quantising the product to FP8 per 128 channels in the same pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline, QTensor

from ._triton import INTERPRET, PDL, cast, next_pow2, pdl_wait, placed, pow2_ceil, to_e4m3

BLOCK = 128  # one FP8 scale group
GROUPS = 8  # scale groups per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    y_ptr,
    s_ptr,
    masked_ptr,
    inter,
    max_m,
    limit,
    MASKED: tl.constexpr,
    QUANT: tl.constexpr,
    UE8M0: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """One row, GROUPS x BLOCK channels. With MASKED, rows at or past their expert's count are skipped."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    if MASKED:  # noqa: SIM102 (a constexpr test: it must stay its own statement in Triton)
        if row % max_m >= tl.load(masked_ptr + row // max_m):
            return
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # DeepSeek-V4's clipped SwiGLU
        gate = tl.minimum(gate, limit)
        up = tl.clamp(up, -limit, limit)
    y = gate / (1.0 + tl.exp(-gate)) * up
    if QUANT:
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4) / 448.0
        if UE8M0:
            scale = pow2_ceil(scale)
        q = to_e4m3(tl.clamp(y / scale[:, None], -448.0, 448.0), PREROUND)
        tl.store(y_ptr + row * inter + cols, q, mask=mask)
        n_groups = tl.cdiv(inter, BLOCK)
        tl.store(s_ptr + row * n_groups + groups, scale, mask=groups < n_groups)
    else:
        tl.store(y_ptr + row * inter + cols, cast(y, y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x, *, quantize, scale_format, masked_m, limit):
    inter = x.shape[-1] // 2
    x2 = x.reshape(x.shape[:-1].numel(), 2 * inter).contiguous()  # not -1: rows of no values are still rows
    rows = x2.shape[0]
    if quantize:
        y = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(rows, inter // BLOCK, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        s = torch.empty(1, dtype=torch.float32, device=x.device)  # unused
    if x2.numel():
        groups = min(GROUPS, next_pow2(triton.cdiv(inter, BLOCK)))
        grid = (rows, triton.cdiv(triton.cdiv(inter, BLOCK), groups))
        _silu_and_mul_kernel[grid](
            x2,
            y,
            s,
            s if masked_m is None else masked_m.contiguous(),  # read at masked_ptr + expert
            inter,
            x.shape[1] if masked_m is not None else 1,
            1.0 if limit is None else limit,
            MASKED=masked_m is not None,
            QUANT=quantize,
            UE8M0=scale_format == "ue8m0",
            CLAMP=limit is not None,
            BLOCK=BLOCK,
            GROUPS=groups,
            PREROUND=INTERPRET,
            launch_pdl=PDL,
        )
    lead = x.shape[:-1]
    if quantize:
        return QTensor(y.view(*lead, inter), s.view(*lead, inter // BLOCK), (1, BLOCK), scale_format)
    return y.view(*lead, inter)


def supports(x, *, quantize, scale_format, masked_m, limit) -> bool | Decline:
    return placed(x=x, masked_m=masked_m)
