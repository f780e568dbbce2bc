"""DeepSeek-V4's hyper-connections: ``hc_pre``, ``hc_post``, ``hc_head``, programs per token and span or D block.

``hc_pre`` and ``hc_head`` run three kernels: the projection of the flattened streams (sum of squares and the M dot
products over N*D in fp32, in 16 spans per token, then the spans' parts summed in a fixed order), then per (token,
D block) the collapse, where the first block also writes
post and comb (sigmoids, the softmax and the Sinkhorn iterations on an N x N tile). ``hc_post`` reads comb
transposed per token. Every token's arithmetic is the same whatever the batch: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline

from ._triton import PDL, cast, next_pow2, pdl_wait, placed

BLOCK_K = 512
BLOCK_D = 256
MIX_SPANS = 16  # programs per token of the projection: one alone read fn (M x N*D fp32, 1.5 MB for V4-Flash) slowly


@triton.jit
def _mix_kernel(x_ptr, fn_ptr, part_ptr, K, M, SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Span ``program_id(1)`` (``SPAN`` of the K = N*D flattened stream values) of token ``program_id(0)``: the M dot
    products of ``fn`` with it and its sum of squares, at ``part[t, span, :M]`` and ``part[t, span, M]``."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M,), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    for start in range(span * SPAN, span * SPAN + SPAN, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * K + k, mask=k < K, other=0.0).to(tl.float32)
        squares += x * x
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        acc += tl.sum(w * x[None, :], axis=1)
    row = part_ptr + (t * tl.num_programs(1) + span) * (M + 1)
    tl.store(row + m, acc, mask=m < M)
    tl.store(row + M, tl.sum(squares, axis=0))


@triton.jit
def _mix_sum_kernel(
    part_ptr, mix_ptr, K, M, norm_eps, SPANS: tl.constexpr, SPANS_P2: tl.constexpr, BLOCK_M: tl.constexpr
):
    """mix[t] = fn @ x[t] * rsqrt(mean(x[t]^2) + norm_eps) from the spans' parts, summed in a fixed order."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    s, m = tl.arange(0, SPANS_P2), tl.arange(0, BLOCK_M)
    at = part_ptr + (t * SPANS + s[:, None]) * (M + 1) + m[None, :]
    parts = tl.load(at, mask=(s[:, None] < SPANS) & (m[None, :] <= M), other=0.0)
    total = tl.sum(parts, axis=0)
    squares = tl.sum(tl.where(m == M, total, 0.0), axis=0)
    r = 1.0 / tl.sqrt_rn(squares / K + norm_eps)
    tl.store(mix_ptr + t * M + m, total * r, mask=m < M)


@triton.jit
def _collapse_kernel(
    x_ptr,
    mix_ptr,
    base_ptr,
    scale_ptr,
    out_ptr,
    post_ptr,
    comb_ptr,
    D,
    M,
    eps,
    iters,
    N: tl.constexpr,
    N_P2: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    i = tl.arange(0, N_P2)
    valid = i < N
    pre = tl.load(mix_ptr + t * M + i, mask=valid, other=0.0) * tl.load(scale_ptr) + tl.load(
        base_ptr + i, mask=valid, other=0.0
    )
    pre = tl.where(valid, 1.0 / (1.0 + tl.exp(-pre)) + eps, 0.0)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    xs = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0)
    tl.store(out_ptr + t * D + d, cast(out, out_ptr.dtype.element_ty), mask=d < D)
    if not HEAD:  # noqa: SIM102 (a constexpr test: it must stay its own statement in Triton)
        if block == 0:
            post = tl.load(mix_ptr + t * M + N + i, mask=valid, other=0.0) * tl.load(scale_ptr + 1)
            post += tl.load(base_ptr + N + i, mask=valid, other=0.0)
            tl.store(post_ptr + t * N + i, 2.0 / (1.0 + tl.exp(-post)), mask=valid)
            j = tl.arange(0, N_P2)
            tile = valid[:, None] & (j[None, :] < N)
            at = 2 * N + i[:, None] * N + j[None, :]
            logits = tl.load(mix_ptr + t * M + at, mask=tile, other=0.0) * tl.load(scale_ptr + 2)
            logits = tl.where(tile, logits + tl.load(base_ptr + at, mask=tile, other=0.0), float("-inf"))
            e = tl.exp(logits - tl.max(tl.where(tile, logits, -3.0e38), axis=1)[:, None])
            e = tl.where(tile, e, 0.0)
            comb = tl.where(tile, e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None] + eps, 0.0)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
            for _ in range(iters - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
            tl.store(comb_ptr + t * N * N + i[:, None] * N + j[None, :], comb, mask=tile)


def _collapse(streams, fn, base, scale, eps, norm_eps, iters, head):
    tokens, n, d = streams.shape
    mixes = fn.shape[0]
    x = streams.contiguous()
    out = torch.empty(tokens, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=streams.device)
    if tokens:
        mix = torch.empty(tokens, mixes, dtype=torch.float32, device=streams.device)
        block_m = next_pow2(mixes)
        block_k = max(16, min(BLOCK_K, 8192 // block_m))
        span = max(block_k, triton.cdiv(triton.cdiv(n * d, MIX_SPANS), block_k) * block_k)
        spans = triton.cdiv(n * d, span)
        part = torch.empty(tokens, spans, mixes + 1, dtype=torch.float32, device=streams.device)
        _mix_kernel[(tokens, spans)](
            x, fn.contiguous(), part, n * d, mixes, SPAN=span, BLOCK_M=block_m, BLOCK_K=block_k, launch_pdl=PDL
        )
        _mix_sum_kernel[(tokens,)](
            part,
            mix,
            n * d,
            mixes,
            norm_eps,
            SPANS=spans,
            SPANS_P2=next_pow2(spans),
            BLOCK_M=next_pow2(mixes + 1),
            launch_pdl=PDL,
        )
        block_d = min(BLOCK_D, next_pow2(d))
        _collapse_kernel[(tokens, triton.cdiv(d, block_d))](
            x,
            mix,
            base.contiguous(),
            scale.contiguous(),
            out,
            post,
            comb,
            d,
            mixes,
            eps,
            iters,
            N=n,
            N_P2=next_pow2(n),
            HEAD=head,
            BLOCK_D=block_d,
            launch_pdl=PDL,
        )
    return out, post, comb


def hc_pre(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps):
    return _collapse(streams, fn, base, scale, eps, norm_eps, sinkhorn_iters, head=False)


def hc_head(streams, fn, base, scale, *, eps, norm_eps):
    return _collapse(streams, fn, base, scale, eps, norm_eps, 1, head=True)[0]


@triton.jit
def _post_kernel(
    o_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, N: tl.constexpr, N_P2: tl.constexpr, BLOCK_D: tl.constexpr
):
    """y[t, i] = post[t, i] * o[t] + sum_j comb[t, j, i] * x[t, j]."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, N_P2)
    valid = i < N
    comb_t = tl.load(
        comb_ptr + t * N * N + i[None, :] * N + i[:, None], mask=valid[:, None] & valid[None, :], other=0.0
    )
    xs = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)
    mixed = tl.sum(comb_t[:, :, None] * xs.to(tl.float32)[None, :, :], axis=1)
    o = tl.load(o_ptr + t * D + d, mask=d < D, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + i, mask=valid, other=0.0)
    y = post[:, None] * o[None, :] + mixed
    tl.store(
        y_ptr + t * N * D + i[:, None] * D + d[None, :],
        cast(y, y_ptr.dtype.element_ty),
        mask=valid[:, None] & (d[None, :] < D),
    )


def hc_post(block_out, streams, post, comb):
    tokens, n, d = streams.shape
    y = torch.empty(tokens, n, d, dtype=streams.dtype, device=streams.device)
    if tokens:
        block_d = min(BLOCK_D, next_pow2(d))
        _post_kernel[(tokens, triton.cdiv(d, block_d))](
            block_out.contiguous(),
            streams.contiguous(),
            post.contiguous(),
            comb.contiguous(),
            y,
            d,
            N=n,
            N_P2=next_pow2(n),
            BLOCK_D=block_d,
            launch_pdl=PDL,
        )
    return y


def _streams_fit(answer: bool | Decline, streams) -> bool | Decline:
    if answer and streams.shape[1] > 16:
        return Decline(f"streams holds {streams.shape[1]} streams > 16")
    return answer


def pre_supports(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps) -> bool | Decline:
    return _streams_fit(placed(streams=streams, fn=fn, base=base, scale=scale), streams)


def head_supports(streams, fn, base, scale, *, eps, norm_eps) -> bool | Decline:
    return _streams_fit(placed(streams=streams, fn=fn, base=base, scale=scale), streams)


def post_supports(block_out, streams, post, comb) -> bool | Decline:
    return _streams_fit(placed(block_out=block_out, streams=streams, post=post, comb=comb), streams)
