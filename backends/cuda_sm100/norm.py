"""``rms_norm`` (the residual add fused in front) and ``layer_norm``: one program per row, fp32 math; batch-invariant
by construction."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline

from ._triton import PDL, cast, next_pow2, pdl_wait, placed


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, H, x_stride, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h = h + tl.load(res_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        h = cast(h, h_ptr.dtype.element_ty)  # the residual stream is kept in x's dtype
        tl.store(h_ptr + row * H + cols, h, mask=mask)
        h = h.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, cast(h * tl.rsqrt(variance + eps) * w, y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x, w, eps, residual):
    hidden = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), hidden)  # not -1: rows of no values are still rows
    if x2.stride(-1) != 1:  # rows read at their own stride: a slice of wider rows is not copied
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else x2
    res = residual.reshape(x2.shape).contiguous() if residual is not None else x2
    if x2.numel():
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res,
            w.contiguous(),
            y,
            h,
            hidden,
            x2.stride(0),
            eps,
            HAS_RES=residual is not None,
            BLOCK=next_pow2(hidden),
            num_warps=8 if hidden >= 4096 else 4,
            launch_pdl=PDL,
        )
    return y.view(x.shape), (h.view(x.shape) if residual is not None else x)


def _width_fits(answer: bool | Decline, x) -> bool | Decline:
    if answer and x.shape[-1] > 65536:
        return Decline(f"x's rows of {x.shape[-1]} > 65536 elements")
    return answer


def supports(x, w, eps, residual) -> bool | Decline:
    return _width_fits(placed(x=x, w=w, residual=residual), x)


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    """``(x - mean) / sqrt(var + eps) * w + b`` of one row, the biased variance of the centred values, in fp32."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    centred = tl.where(mask, x - tl.sum(x, axis=0) / H, 0.0)
    variance = tl.sum(centred * centred, axis=0) / H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centred * tl.rsqrt(variance + eps) * w + b
    tl.store(y_ptr + row * H + cols, cast(y, y_ptr.dtype.element_ty), mask=mask)


def layer_norm(x, w, b, eps):
    hidden = x.shape[-1]
    x2 = x.reshape(x.shape[:-1].numel(), hidden).contiguous()  # not -1: rows of no values are still rows
    y = torch.empty_like(x2)
    if x2.numel():
        _layer_norm_kernel[(x2.shape[0],)](
            x2,
            w.contiguous(),
            b.contiguous(),
            y,
            hidden,
            eps,
            BLOCK=next_pow2(hidden),
            num_warps=8 if hidden >= 4096 else 4,
            launch_pdl=PDL,
        )
    return y.view(x.shape)


def layer_norm_supports(x, w, b, eps) -> bool | Decline:
    return _width_fits(placed(x=x, w=w, b=b), x)
