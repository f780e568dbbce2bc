"""``quantize_fp8``, ``gemm``, ``grouped_gemm`` with DeepSeek block scaling.

FP8 products accumulate per 128-wide K block in fp32 and apply both scales per block (as DeepGEMM does). bf16
products go to cuBLAS through torch by default; the Triton bf16 kernel is the batch-invariant variant. Kernels
whose tile shape never depends on M are batch-invariant: a row's result cannot depend on how many rows there are.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer import QTensor

from ._triton import INTERPRET, dot, on_device, pow2_ceil, to_e4m3

FP8_BLOCK = 128


# --- quantize_fp8 -------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, UE8M0: tl.constexpr, BLOCK: tl.constexpr, PREROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + cols).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4) / 448.0
    if UE8M0:
        scale = pow2_ceil(scale)
    tl.store(q_ptr + row * K + cols, to_e4m3(tl.clamp(x / scale, -448.0, 448.0), PREROUND))
    tl.store(s_ptr + row * (K // BLOCK) + group, scale)


def quantize_fp8(x, *, block, scale_format):
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x2.shape[0], k // block, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _quantize_kernel[(x2.shape[0], k // block)](
            x2, q, s, k, UE8M0=scale_format == "ue8m0", BLOCK=block, PREROUND=INTERPRET
        )
    return QTensor(q.view(x.shape), s.view(*x.shape[:-1], k // block), (1, block), scale_format)


def quantize_supports(x, *, block, scale_format) -> bool:
    return on_device(x) and block == triton.next_power_of_2(block) and block >= 16


# --- dense GEMM ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[N, K]^T; FP8: A scales [M, K/128], B scales [ceil(N/128), K/128], BLOCK_K = 128."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * grid_n)) // rows_in_group

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + k0 + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_n[:, None] * stride_bn + k0 + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if FP8:
            kb = k0 // BLOCK_K
            sa = tl.load(as_ptr + offs_m * (K // BLOCK_K) + kb, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptr + (offs_n // BLOCK_K) * (K // BLOCK_K) + kb, mask=mask_n, other=0.0)
            part = dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_DOT)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc = dot(a, tl.trans(b), acc, FP32_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def _tile(m: int, invariant: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); fixed in batch-invariant mode."""
    if invariant:
        return 64, 128, 4, 3
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def _launch_gemm(a, b, out, a_scale, b_scale, bias, invariant: bool) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return out
    fp8 = a_scale is not None
    block_m, block_n, warps, stages = _tile(m, invariant)
    if INTERPRET:  # the interpreter's row-independent dot materialises [BLOCK_M, BLOCK_K, BLOCK_N]: keep it <= 2^20
        block_m = min(block_m, 64)
    block_k = FP8_BLOCK if fp8 else 64
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    dummy = out
    _gemm_kernel[grid](
        a,
        b,
        out,
        a_scale if fp8 else dummy,
        b_scale if fp8 else dummy,
        bias if bias is not None else dummy,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        FP8=fp8,
        HAS_BIAS=bias is not None,
        FP32_DOT=INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=8,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _as_fp8(a, w: QTensor) -> QTensor:
    return a if isinstance(a, QTensor) else quantize_fp8(a, block=FP8_BLOCK, scale_format=w.scale_format)


def gemm_fp8(a, w, *, out_dtype, bias, invariant: bool = False):
    """A bf16 or FP8 activation against an FP8 block-scaled weight (bf16 ``a`` is quantised first)."""
    qa = _as_fp8(a, w)
    out = torch.empty(qa.shape[0], w.shape[0], dtype=out_dtype, device=qa.data.device)
    return _launch_gemm(
        qa.data.contiguous(), w.data.contiguous(), out, qa.scale.contiguous(), w.scale.contiguous(), bias, invariant
    )


def gemm_triton(a, w, *, out_dtype, bias):
    """bf16/fp16 x bf16/fp16 with a fixed tile: the batch-invariant dense product."""
    out = torch.empty(a.shape[0], w.shape[0], dtype=out_dtype, device=a.device)
    return _launch_gemm(a.contiguous(), w.contiguous(), out, None, None, bias, invariant=True)


@functools.cache
def _mm_widens() -> bool:
    """Whether this torch multiplies bf16 / fp16 matrices straight into an fp32 result (``torch.mm(out_dtype=)``)."""
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


def gemm_cublas(a, w, *, out_dtype, bias):
    """cuBLAS through torch, fp32 accumulation; not batch-invariant (cuBLAS picks algorithms by shape). An fp32
    result is never rounded to the input dtype on the way: bf16 / fp16 operands go straight into an fp32 result
    where torch can (logits over a large vocabulary: no fp32 copy of the weight each call), else through fp32
    copies of the operands."""
    if out_dtype == torch.float32 and a.dtype != torch.float32:
        if a.dtype == w.dtype and _mm_widens():
            out = torch.mm(a, w.t(), out_dtype=torch.float32)
            return out if bias is None else out + bias.float()
        a, w = a.float(), w.float()
    out = torch.nn.functional.linear(a, w)
    if bias is not None:
        return (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)


def fp8_supports(a, w, *, out_dtype, bias) -> bool:
    a_data = a.data if isinstance(a, QTensor) else a
    return (
        isinstance(w, QTensor)
        and on_device(a_data, w.data, bias)
        and a_data.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
    )


def triton_dense_supports(a, w, *, out_dtype, bias) -> bool:
    return (
        not isinstance(w, QTensor)
        and not isinstance(a, QTensor)
        and on_device(a, w, bias)
        and a.dtype in (torch.bfloat16, torch.float16)
    )


def cublas_supports(a, w, *, out_dtype, bias) -> bool:
    return not INTERPRET and not isinstance(w, QTensor) and not isinstance(a, QTensor) and on_device(a, w, bias)


# --- grouped GEMM -------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_m"])
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    as_ptr,
    bs_ptr,
    offsets_ptr,
    tile_offsets_ptr,
    masked_ptr,
    E,
    N,
    K,
    max_m,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    MASKED: tl.constexpr,
    FP8: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Contiguous: program (t, n) takes the t-th M tile over all experts (``tile_offsets`` = cumulative tiles per
    expert, computed on the device). Masked: program (e * tiles_per_expert + t, n). Rows never cross experts."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if MASKED:
        tiles = tl.cdiv(max_m, BLOCK_M)
        e = pid_m // tiles
        rows_in_expert = tl.load(masked_ptr + e)
        first = (pid_m % tiles) * BLOCK_M
        if first >= rows_in_expert:
            return
        row0 = e.to(tl.int64) * max_m + first
        row_end = e.to(tl.int64) * max_m + rows_in_expert
    else:
        ends = tl.load(tile_offsets_ptr + 1 + tl.arange(0, BLOCK_E), mask=tl.arange(0, BLOCK_E) < E, other=2147483647)
        e = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        if e >= E:
            return
        tile_start = tl.load(tile_offsets_ptr + e)
        row0 = (tl.load(offsets_ptr + e) + (pid_m - tile_start) * BLOCK_M).to(tl.int64)
        row_end = tl.load(offsets_ptr + e + 1).to(tl.int64)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < row_end, offs_n < N
    b_base = b_ptr + e.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + k0 + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + offs_n[:, None] * stride_bn + k0 + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if FP8:
            kb = k0 // BLOCK_K
            kbs = K // BLOCK_K
            sa = tl.load(as_ptr + offs_m * kbs + kb, mask=mask_m, other=0.0)
            sb = tl.load(
                bs_ptr + (e.to(tl.int64) * tl.cdiv(N, BLOCK_K) + offs_n // BLOCK_K) * kbs + kb, mask=mask_n, other=0.0
            )
            part = dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_DOT)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc = dot(a, tl.trans(b), acc, FP32_DOT)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def grouped_gemm(a, w, *, expert_offsets, masked_m, out_dtype):
    fp8 = isinstance(w, QTensor)
    if fp8:
        a = _as_fp8(a, w)
    a_data = a.data if fp8 else a
    experts, n, k = w.shape
    masked = masked_m is not None
    rows = a_data.shape[0] * a_data.shape[1] if masked else a_data.shape[0]
    out = torch.empty(*a_data.shape[:-1], n, dtype=out_dtype, device=a_data.device)
    if rows == 0 or n == 0:
        return out
    a2 = a_data.reshape(rows, k).contiguous()
    b = (w.data if fp8 else w).contiguous()
    block_m, block_n = 64, 128
    dummy = out
    if masked:
        grid_m = experts * triton.cdiv(a_data.shape[1], block_m)
        tile_offsets = offsets = dummy
    else:
        counts = expert_offsets[1:] - expert_offsets[:-1]
        tile_offsets = torch.zeros(experts + 1, dtype=torch.int32, device=a_data.device)
        tile_offsets[1:] = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0)
        grid_m, offsets = triton.cdiv(rows, block_m) + experts, expert_offsets
    _grouped_gemm_kernel[(grid_m, triton.cdiv(n, block_n))](
        a2,
        b,
        out.view(rows, n),
        a.scale.reshape(rows, -1).contiguous() if fp8 else dummy,
        w.scale.contiguous() if fp8 else dummy,
        offsets,
        tile_offsets,
        masked_m if masked else dummy,
        experts,
        n,
        k,
        a_data.shape[1] if masked else 0,
        a2.stride(0),
        b.stride(0),
        b.stride(1),
        n,
        MASKED=masked,
        FP8=fp8,
        FP32_DOT=INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=FP8_BLOCK if fp8 else 64,
        BLOCK_E=triton.next_power_of_2(experts),
        num_warps=4,
        num_stages=3,
    )
    return out


def grouped_supports(a, w, *, expert_offsets, masked_m, out_dtype) -> bool:
    a_data = a.data if isinstance(a, QTensor) else a
    w_data = w.data if isinstance(w, QTensor) else w
    dense_ok = isinstance(w, QTensor) or a_data.dtype in (torch.bfloat16, torch.float16)
    return dense_ok and on_device(a_data, w_data, expert_offsets, masked_m)
