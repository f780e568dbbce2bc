"""TEST DOUBLE of torch_npu's small fused operators (norms, rotary, SwiGLU) and the in-place scatter.

Contracts (op-plugin docs): ``npu_rms_norm`` (x of 2 to 8 dims, empty tensors allowed, gamma in the dtype of x or
fp32 for an fp16/bf16 x), ``npu_add_rms_norm`` (x of 1 to 8 dims, gamma in the dtype of x, no empty tensors; the
add result is returned in the input dtype), ``npu_rotary_mul`` (``x * r1 + rotate(x) * r2`` with ``half`` or
``interleave`` rotation; for a TND input the coefficients are ``T1D``), ``npu_swiglu`` (``silu(first half) *
second half``), ``npu_scatter_nd_update_`` (in place; int8 but not uint8 data).
"""

from __future__ import annotations

import torch

from ._common import contiguous, dtype_in, not_emulated, record, require

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _rms(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(h.dim() - gamma.dim(), h.dim()))
    rstd = torch.rsqrt(h.pow(2).mean(dim=dims, keepdim=True) + eps)
    return h * rstd * gamma.float(), rstd


def _check_gamma(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    require(1 <= gamma.dim() <= x.dim(), op, "gamma covers 1 to all of x's dims")
    require(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim() :]), op, "gamma must match x's trailing dims")


def _check_norm(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    dtype_in(x, FLOATS, op, "x")
    require(x.numel() > 0, op, "empty tensors are not supported")
    require(1 <= x.dim() <= 8, op, "x must have 1 to 8 dims")
    require(gamma.dtype == x.dtype, op, "gamma must have the dtype of x")
    _check_gamma(op, x, gamma)


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (TEST DOUBLE): returns ``(y, rstd fp32)``; rstd has x's leading dims (those gamma does not cover)
    and ones for the rest. Unlike ``npu_add_rms_norm``, the docs take x of 2 to 8 dims, allow empty tensors, and
    pair an fp16/bf16 x with a gamma of its dtype or fp32."""
    op = "npu_rms_norm"
    dtype_in(x, FLOATS, op, "x")
    require(2 <= x.dim() <= 8, op, "x (self) must have 2 to 8 dims")
    require(
        gamma.dtype == x.dtype or (gamma.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)),
        op,
        "gamma must have the dtype of x, or float32 for a float16/bfloat16 x",
    )
    _check_gamma(op, x, gamma)
    record(op, dtype=x.dtype, gamma_dtype=gamma.dtype, dims=x.dim())
    y, rstd = _rms(x.float(), gamma, epsilon)
    return y.to(x.dtype), rstd


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Add + RMSNorm (TEST DOUBLE): returns ``(y, rstd, x)`` with ``x = x1 + x2`` in the input dtype. The norm is
    taken of the fp32 sum (the docs do not say whether the kernel rounds it first)."""
    op = "npu_add_rms_norm"
    _check_norm(op, x1, gamma)
    require(x2.dtype == x1.dtype and x2.shape == x1.shape, op, "x2 must match x1 in dtype and shape")
    record(op, dtype=x1.dtype)
    h = x1.float() + x2.float()
    y, rstd = _rms(h, gamma, epsilon)
    return y.to(x1.dtype), rstd, h.to(x1.dtype)


def npu_rotary_mul(
    input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None
) -> torch.Tensor:
    """Rotary embedding (TEST DOUBLE), emulated for 3-D (TND) inputs with ``T1D`` coefficients."""
    op = "npu_rotary_mul"
    not_emulated(rotate is not None, op, "the rotate matrix")
    dtype_in(input, FLOATS, op, "input")
    require(input.dim() in (3, 4) and r1.dim() in (3, 4) and r2.dim() in (3, 4), op, "inputs must be 3-D or 4-D")
    not_emulated(input.dim() != 3, op, "4-D layouts")
    require(r1.dtype == input.dtype and r2.dtype == input.dtype, op, "r1 and r2 take the dtype of input (assumed)")
    require(rotary_mode in ("half", "interleave"), op, "rotary_mode is 'half' or 'interleave'")
    t, n, d = input.shape
    require(d % 2 == 0 and d < 896, op, "D must be even and below 896")
    require(n < 1000, op, "N must be below 1000")  # interleave's "B * N < 1000" names no B for TND (assumed N)
    layouts = {"T1D": (t, 1, d)} if rotary_mode == "interleave" else {"T1D": (t, 1, d), "TND": (t, n, d)}
    require(
        tuple(r1.shape) in layouts.values() and r2.shape == r1.shape,
        op,
        f"for a TND input, {rotary_mode} mode takes r1/r2 in layout {' or '.join(layouts)}",
    )
    record(op, rotary_mode=rotary_mode, shape=tuple(input.shape))
    x = input.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
    else:
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU (TEST DOUBLE): ``silu(A) * B`` with ``A, B`` the two halves of ``input`` along ``dim``."""
    op = "npu_swiglu"
    dtype_in(input, FLOATS, op, "input")
    contiguous(input, op, "input")
    require(input.numel() > 0, op, "empty tensors are not supported")
    require(input.shape[dim] % 2 == 0, op, "the split dim must be even")
    record(op, dtype=input.dtype, shape=tuple(input.shape))
    a, b = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def npu_scatter_nd_update_(input: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """In-place scatter of ``updates`` at ``indices`` (TEST DOUBLE). ``indices [N, depth]`` int32/int64 addresses
    the first ``depth`` dims of ``input``; ``updates`` is ``[N, *input.shape[depth:]]`` in the dtype of input."""
    op = "npu_scatter_nd_update_"
    dtype_in(input, (torch.float32, torch.float16, torch.bool, torch.bfloat16, torch.int64, torch.int8), op, "input")
    require(updates.dtype == input.dtype, op, "updates must have the dtype of input")
    require(indices.dtype in (torch.int32, torch.int64) and indices.dim() == 2, op, "indices are 2-D int32/int64")
    depth = indices.shape[1]
    require(1 <= depth <= input.dim() <= 8, op, "indices' last dim must address 1..input.dim() dims")
    require(tuple(updates.shape) == (indices.shape[0], *input.shape[depth:]), op, "updates must be [N, *tail]")
    bounds = torch.tensor(input.shape[:depth])
    idx = indices.long()
    require(bool(((idx >= 0) & (idx < bounds)).all()), op, "indices out of range")
    require(torch.unique(idx, dim=0).shape[0] == idx.shape[0], op, "duplicate indices (the update order is undefined)")
    record(op, dtype=input.dtype, n=indices.shape[0], depth=depth)
    input[tuple(idx.T)] = updates
    return input
