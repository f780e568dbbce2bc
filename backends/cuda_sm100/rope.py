"""``rope``: one program per block of (token, head) rows, up to 16 heads by up to 64 / 16 tokens; reads the core's
cos/sin table."""

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
    T,
    H,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pdl_wait()
    # rows r of the program: token t0 + r // BLOCK_H, head h0 + r % BLOCK_H; each row's D channels load as one
    # contiguous run (16-byte vectors), and the interleaved pairs are split in registers
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (t < T) & (h < H)
    pos = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.int64)
    i = tl.arange(0, HALF)[None, :]
    cos = tl.load(table_ptr + pos[:, None] * 2 * HALF + i, mask=row_ok[:, None], other=0.0)
    sin = tl.load(table_ptr + pos[:, None] * 2 * HALF + HALF + i, mask=row_ok[:, None], other=0.0)
    x_row = (x_ptr + t * stride_xt + h * stride_xh)[:, None]
    o_row = (out_ptr + t * stride_ot + h * stride_oh)[:, None]
    if INTERLEAVED:
        d = tl.arange(0, 2 * HALF)[None, :]
        x = tl.load(x_row + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T * BLOCK_H, HALF, 2)))
        y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), (BLOCK_T * BLOCK_H, 2 * HALF))
        tl.store(o_row + d, cast(y, out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        x1 = tl.load(x_row + i, mask=row_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(x_row + HALF + i, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(o_row + i, cast(x1 * cos - x2 * sin, out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(o_row + HALF + i, cast(x2 * cos + x1 * sin, out_ptr.dtype.element_ty), mask=row_ok[:, None])


ROWS_PER_PROGRAM = 64  # (token, head) rows of D channels a program rotates


def rope(x, positions, cos_sin_cache, interleaved):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tokens, heads = x.shape[0], x.shape[1]
    if tokens and heads:
        block_h = min(16, next_pow2(heads))  # a decode step of one token still spreads over several programs
        block_t = min(max(1, ROWS_PER_PROGRAM // block_h), next_pow2(tokens))
        _rope_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(heads, block_h))](
            x,
            positions.contiguous(),  # read at pos_ptr + t
            cos_sin_cache.contiguous(),
            out,
            tokens,
            heads,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            HALF=x.shape[2] // 2,
            INTERLEAVED=interleaved,
            BLOCK_T=block_t,
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
