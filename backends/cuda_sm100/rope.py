"""``rope``: one program per (token, block of up to 16 heads); reads the core's cos/sin table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline

from ._triton import PDL, cast, next_pow2, pdl_wait, placed


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    table_ptr,
    out_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(table_ptr + pos * 2 * HALF + i)[None, :]
    sin = tl.load(table_ptr + pos * 2 * HALF + HALF + i)[None, :]
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    mask = heads < H
    if INTERLEAVED:
        first, second = 2 * i[None, :], 2 * i[None, :] + 1
    else:
        first, second = i[None, :], i[None, :] + HALF
    x_row = x_ptr + t * stride_xt + heads * stride_xh
    x1 = tl.load(x_row + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second, mask=mask, other=0.0).to(tl.float32)
    o_row = out_ptr + t * stride_ot + heads * stride_oh
    tl.store(o_row + first, cast(x1 * cos - x2 * sin, out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + second, cast(x2 * cos + x1 * sin, out_ptr.dtype.element_ty), mask=mask)


def rope(x, positions, cos_sin_cache, interleaved):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] and x.shape[1]:
        block_h = min(16, next_pow2(x.shape[1]))  # a decode step of one token still spreads over several programs
        _rope_kernel[(x.shape[0], triton.cdiv(x.shape[1], block_h))](
            x,
            positions.contiguous(),  # read at pos_ptr + t
            cos_sin_cache.contiguous(),
            out,
            x.shape[1],
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            HALF=x.shape[2] // 2,
            INTERLEAVED=interleaved,
            BLOCK_H=block_h,
            launch_pdl=PDL,
        )
    return out


def supports(x, positions, cos_sin_cache, interleaved) -> bool | Decline:
    half = x.shape[2] // 2
    answer = placed(x=x, positions=positions, cos_sin_cache=cos_sin_cache)
    if not answer:
        return answer
    if x.stride(2) != 1:
        return Decline("x's last dimension is not contiguous")
    if half != next_pow2(half):
        return Decline(f"x's rotary half {half} is not a power of two")
    return True
