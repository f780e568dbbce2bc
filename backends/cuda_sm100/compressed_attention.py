"""DeepSeek-V4's compressed attention: ``compress_kv``, ``indexer_topk_entries``, ``sparse_attention_sinks``.

- ``compress_kv``: one program per (window, channel block): the softmax over the window's slots of gate plus bias in
  fp32, the weights rounded to kv's dtype, the weighted sum in fp32.
- ``indexer_topk_entries``: one program per (query, block of its keys) scores the block against up to 64 heads at a
  time in tensor-core products over 128 columns at a time, then ``relu``, weighted, summed over heads (fp32);
  ``torch.sort`` (stable, descending) then keeps the best ``topk`` with ties to the lower row, and the kept rows are
  put in ascending order. A caller's ``max_count`` sizes the grid without reading the counts on the host (a CUDA
  graph's decode step).
- ``sparse_attention_sinks``: one program per (query, 16 heads) streams its listed rows in blocks: the heads' scores
  in one tensor-core product, an online softmax in fp32, the probabilities against the same rows as two products
  in kv's 16-bit dtype (the rounded probabilities, then their rounding error; fp32 inputs: fp32 products), and the
  sink folded into the final denominator. A row is read once per 16 heads, not once per head.

Each row's arithmetic is the same whatever else is in the batch: batch-invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline

from ._triton import INTERPRET, PDL, cast, dot, next_pow2, pdl_wait, placed

BLOCK_D = 128
SCORE_BLOCK_N = 64  # keys a program scores
ATTEND_BLOCK_H, ATTEND_BLOCK_N, ATTEND_WARPS = 16, 32, 4  # heads a program attends with, rows a step, warps


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, bias_ptr, out_ptr, S, D, S_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    pdl_wait()
    w = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, S_P2)
    mask = (s[:, None] < S) & (d[None, :] < D)
    at = w * S * D + s[:, None] * D + d[None, :]
    g = tl.load(gate_ptr + at, mask=mask, other=float("-inf")).to(tl.float32)
    g += tl.load(bias_ptr + s[:, None] * D + d[None, :], mask=mask, other=0.0)
    g = tl.where(mask, g, -3.0e38)  # padding lanes: finite, so an all-padding column gives no NaN
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    weights = cast(e / tl.sum(e, axis=0)[None, :], kv_ptr.dtype.element_ty).to(tl.float32)
    kv = tl.load(kv_ptr + at, mask=mask, other=0.0).to(tl.float32)
    out = tl.sum(tl.where(mask, weights * kv, 0.0), axis=0)
    tl.store(out_ptr + w * D + d, cast(out, out_ptr.dtype.element_ty), mask=d < D)


def compress_kv(kv, gate, position_bias):
    windows, slots, dim = kv.shape
    out = torch.empty(windows, dim, dtype=kv.dtype, device=kv.device)
    if windows:
        block_d = min(BLOCK_D, next_pow2(dim))
        _compress_kernel[(windows, triton.cdiv(dim, block_d))](
            kv.contiguous(),
            gate.contiguous(),
            position_bias.contiguous(),
            out,
            slots,
            dim,
            S_P2=next_pow2(slots),
            BLOCK_D=block_d,
            launch_pdl=PDL,
        )
    return out


@triton.jit
def _score_kernel(
    q_ptr, w_ptr, k_ptr, start_ptr, count_ptr, out_ptr, H, D, WIDTH, FP32_DOT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out[t, n] = sum_h w[t, h] relu(q[t, h] . keys[start[t] + n]) for n < count[t] in block ``program_id(1)`` of
    query ``program_id(0)``'s range, -inf after: the block's keys against ``BLOCK_H`` heads at a time, each a product
    accumulated over ``BLOCK_D`` columns at a time."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(start_ptr + t).to(tl.int64)
    seen = n < tl.load(count_ptr + t)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        scores = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)  # [n, h]
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            k = tl.load(k_ptr + (start + n)[:, None] * D + d[None, :], mask=seen[:, None] & (d[None, :] < D), other=0.0)
            q = tl.load(
                q_ptr + (t * H + h)[None, :] * D + d[:, None], mask=(h[None, :] < H) & (d[:, None] < D), other=0.0
            )
            scores = dot(k, q, scores, FP32_DOT)
        w = tl.load(w_ptr + t * H + h, mask=h < H, other=0.0)
        total += tl.sum(tl.maximum(scores, 0.0) * w[None, :], axis=1)
    tl.store(out_ptr + t * WIDTH + n, tl.where(seen, total, float("-inf")), mask=n < WIDTH)


def indexer_topk_entries(q, weights, keys, key_start, key_count, *, topk, max_count=None):
    tokens, heads, dim = q.shape
    out = torch.full((tokens, topk), -1, dtype=torch.int32, device=q.device)
    width = (int(key_count.max()) if max_count is None else max_count) if tokens else 0  # the scores' columns
    if width == 0:
        return out
    if q.dtype != keys.dtype:  # one dtype for the product; fp32 where either is
        q, keys = q.float(), keys.float()
    scores = torch.empty(tokens, width, dtype=torch.float32, device=q.device)
    _score_kernel[(tokens, triton.cdiv(width, SCORE_BLOCK_N))](
        q.contiguous(),
        weights.contiguous(),
        keys.contiguous(),
        key_start.contiguous(),
        key_count.contiguous(),
        scores,
        heads,
        dim,
        width,
        FP32_DOT=INTERPRET,
        BLOCK_H=min(64, max(16, next_pow2(heads))),
        BLOCK_D=min(128, max(16, next_pow2(dim))),
        BLOCK_N=SCORE_BLOCK_N,
        launch_pdl=PDL,
    )
    k = min(topk, width)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: the lower row first
    keep = scores.gather(1, order) > float("-inf")
    chosen = torch.where(keep, order, width).sort(dim=-1).values
    out[:, :k] = torch.where(chosen < width, chosen + key_start.long()[:, None], -1).to(torch.int32)
    return out


@triton.jit
def _attend_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, H, D, K, scale, FP32_DOT: tl.constexpr, SPLIT_P: tl.constexpr,
    D_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Heads ``BLOCK_H program_id(1) + [0, BLOCK_H)`` of query ``program_id(0)`` over its listed rows, ``BLOCK_N``
    a step: scores of all the block's heads in one product, an online softmax in fp32, the probabilities against the
    same rows (``SPLIT_P``: as two products of kv's 16-bit dtype, the rounded probabilities and their rounding
    error); the sink folded into the final denominator."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_P2)
    q_mask = (h[:, None] < H) & (d[None, :] < D)
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + d[None, :], mask=q_mask, other=0.0)
    m = tl.full((BLOCK_H,), -3.0e38, tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_P2), tl.float32)
    for n0 in range(0, K, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        row = tl.load(idx_ptr + t * K + n, mask=n < K, other=-1).to(tl.int64)
        listed = row >= 0
        v = tl.load(kv_ptr + row[:, None] * D + d[None, :], mask=listed[:, None] & (d[None, :] < D), other=0.0)
        s = dot(q, tl.trans(v), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), FP32_DOT) * scale
        s = tl.where(listed[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        p_hi = p.to(v.dtype)
        acc = dot(p_hi, v, acc * alpha[:, None], FP32_DOT)
        if SPLIT_P:  # p's rounding error in a second product: p to about twice the 16-bit dtype's precision
            acc = dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc, FP32_DOT)
        m = m_new
    sink = tl.load(sink_ptr + h, mask=h < H, other=0.0)
    top = tl.maximum(m, sink)
    alpha = tl.exp(m - top)
    out = acc * (alpha / (denom * alpha + tl.exp(sink - top)))[:, None]
    tl.store(out_ptr + (t * H + h)[:, None] * D + d[None, :], cast(out, out_ptr.dtype.element_ty), mask=q_mask)


def sparse_attention_sinks(q, kv, indices, sinks, *, softmax_scale):
    tokens, heads, dim = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.dtype != kv.dtype:  # one dtype for the products; fp32 where either is
        q, kv = q.float(), kv.float()
    if tokens and heads:
        _attend_kernel[(tokens, triton.cdiv(heads, ATTEND_BLOCK_H))](
            q.contiguous(),
            kv.contiguous(),
            indices.contiguous(),
            sinks.contiguous(),
            out,
            heads,
            dim,
            indices.shape[1],
            float(softmax_scale),
            FP32_DOT=INTERPRET,
            SPLIT_P=kv.dtype != torch.float32,
            D_P2=max(16, next_pow2(dim)),
            BLOCK_H=ATTEND_BLOCK_H,
            BLOCK_N=ATTEND_BLOCK_N,
            num_warps=ATTEND_WARPS,
            launch_pdl=PDL,
        )
    return out


def compress_supports(kv, gate, position_bias) -> bool | Decline:
    answer = placed(kv=kv, gate=gate, position_bias=position_bias)
    if answer and kv.shape[1] > 256:
        return Decline(f"kv has {kv.shape[1]} slots per window > 256")
    return answer


def topk_supports(q, weights, keys, key_start, key_count, *, topk, max_count=None) -> bool | Decline:
    answer = placed(q=q, weights=weights, keys=keys, key_start=key_start, key_count=key_count)
    if answer and q.shape[2] > 1024:
        return Decline(f"q's head dim {q.shape[2]} > 1024")
    return answer


def attend_supports(q, kv, indices, sinks, *, softmax_scale) -> bool | Decline:
    answer = placed(q=q, kv=kv, indices=indices, sinks=sinks)
    if answer and q.shape[2] > 1024:
        return Decline(f"q's head dim {q.shape[2]} > 1024")
    return answer
