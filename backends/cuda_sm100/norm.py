"""``rms_norm``: one program per row, the residual add fused in front; batch-invariant by construction."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import PDL, cast, next_pow2, on_device, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    h = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
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
    x2 = x.reshape(-1, hidden).contiguous()
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, hidden).contiguous() if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res,
            w.contiguous(),
            y,
            h,
            hidden,
            eps,
            HAS_RES=residual is not None,
            BLOCK=next_pow2(hidden),
            num_warps=8 if hidden >= 4096 else 4,
            launch_pdl=PDL,
        )
    return y.view(x.shape), (h.view(x.shape) if residual is not None else x)


def supports(x, w, eps, residual) -> bool:
    return on_device(x, w, residual) and x.shape[-1] <= 65536
