"""``moe_route`` (fused group-limited top-k), the one-process ``ep_dispatch`` / ``ep_combine``, the index work and
row copies of the core's multi-rank normal-mode ``ep_dispatch``, and the weighted sum of its ``ep_combine``.

``normal`` dispatch sorts (token, expert) pairs by expert on the device and moves rows with a gather kernel; it
needs the number of valid pairs on the host (the output size). ``low_latency`` dispatch has fixed shapes and no host
synchronisation: one program per expert lays out that expert's rows, then one program per pair copies its row (three
launches in all, for the decode steps that CUDA graphs replay). Combine sums each token's k rows in slot order in
fp32 (batch-invariant), one kernel for the one-process handle, for the rows a multi-rank normal-mode combine brings
back and for its per-rank partial sums. Over a process group, normal mode keeps the core's protocol and exchanges
(``ep.dispatch_normal``) and replaces its torch index work with three kernels: the sender counts its pairs and
copies per program, then writes each copy with its record at its place in send order; the receiver copies each
pair's row into the layout. Low-latency mode keeps the core's all-gather of the routing
(``ep.dispatch_low_latency``); two kernels rank every pair of the gathered routing per destination and copy this
rank's rows (the core's torch code takes about 70 device ops for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer import Decline, QTensor
from deepinfer.ops import DispatchHandle, ExpertLayout
from deepinfer.reference import ep

from ._triton import PDL, cast, next_pow2, pdl_wait, placed


@triton.jit
def sqrt_softplus(x):
    """DeepSeek-V4's router score ``sqrt(log(1 + exp(x)))``, as ``max(x, 0) + log1p(exp(-|x|))`` with log1p taken
    from ``log(1 + t)`` corrected for the rounding of ``1 + t`` (exact to a few ulps where ``t`` is tiny)."""
    t = tl.exp(-tl.abs(x))
    u = 1.0 + t
    exact = u == 1.0
    log1p = tl.where(exact, t, tl.log(u) * (t / tl.where(exact, 1.0, u - 1.0)))
    return tl.sqrt_rn(tl.maximum(x, 0.0) + log1p)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    E,
    scaling,
    HAS_BIAS: tl.constexpr,
    SOFTMAX: tl.constexpr,
    SQRTSOFTPLUS: tl.constexpr,
    RENORM: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    expert = g * GROUP_SIZE + j
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    x = tl.load(logits_ptr + t * E + expert, mask=valid, other=float("-inf"))
    if SOFTMAX:
        e = tl.exp(x - tl.max(tl.max(x, axis=1), axis=0))
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    elif SQRTSOFTPLUS:
        scores = sqrt_softplus(x)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        best = tl.max(choice, axis=1)
        if SOFTMAX:
            group_score = best
        else:  # sum of the two best experts of each group
            first = tl.argmax(choice, axis=1)
            second = tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
            group_score = best + second
        group_score = tl.where(tl.arange(0, BLOCK_G) < N_GROUP, group_score, float("-inf"))
        keep = tl.zeros((BLOCK_G,), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(group_score, axis=0)
            keep = tl.where(tl.arange(0, BLOCK_G) == pick, 1, keep)
            group_score = tl.where(tl.arange(0, BLOCK_G) == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None] != 0, choice, float("-inf"))
    flat_choice = tl.reshape(choice, (BLOCK_G * BLOCK_S,))
    flat_scores = tl.reshape(scores, (BLOCK_G * BLOCK_S,))
    flat_expert = tl.reshape(expert, (BLOCK_G * BLOCK_S,))
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    for i in tl.static_range(TOP_K):
        pick = tl.argmax(flat_choice, axis=0)
        hit = tl.arange(0, BLOCK_G * BLOCK_S) == pick
        ids = tl.where(k == i, tl.sum(tl.where(hit, flat_expert, 0), axis=0), ids)
        weights = tl.where(k == i, tl.sum(tl.where(hit, flat_scores, 0.0), axis=0), weights)
        flat_choice = tl.where(hit, float("-inf"), flat_choice)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def moe_route(logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring):
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        group_size = experts // n_group
        _route_kernel[(tokens,)](
            logits.contiguous(),
            bias.contiguous() if bias is not None else logits,  # read at bias_ptr + expert
            weights,
            ids,
            experts,
            routed_scaling_factor,
            HAS_BIAS=bias is not None,
            SOFTMAX=scoring == "softmax",
            SQRTSOFTPLUS=scoring == "sqrtsoftplus",
            RENORM=renormalize,
            N_GROUP=n_group,
            GROUP_SIZE=group_size,
            TOPK_GROUP=topk_group,
            TOP_K=top_k,
            BLOCK_G=next_pow2(n_group),
            BLOCK_S=next_pow2(group_size),
            BLOCK_K=next_pow2(top_k),
            launch_pdl=PDL,
        )
    return weights, ids


def route_supports(
    logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring
) -> bool | Decline:
    answer = placed(logits=logits, bias=bias)
    if not answer:
        return answer
    if logits.shape[1] > 1024:
        return Decline(f"logits has {logits.shape[1]} experts > 1024")
    if top_k > 32:
        return Decline(f"top_k {top_k} > 32")
    return True


# --- dispatch / combine (one process) -----------------------------------------------------------------------------


LOST = -2  # pair_rows entry of a pair dropped by capacity overflow


@dataclass
class GpuHandle(DispatchHandle):
    """pair_rows [T, k] int32: the received row of each (token, slot), -1 if skipped, LOST if dropped by capacity
    overflow; weights [T, k] fp32."""

    pair_rows: torch.Tensor = None
    weights: torch.Tensor = None


@triton.jit
def _gather_rows_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, H, BLOCK: tl.constexpr):
    """dst[dst_rows[p]] = src[src_rows[p]] for each pair p with dst_rows[p] >= 0."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    dst_row = tl.load(dst_rows_ptr + p).to(tl.int64)
    if dst_row < 0:
        return
    src_row = tl.load(src_rows_ptr + p).to(tl.int64)
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < H
        tl.store(dst_ptr + dst_row * H + cols, tl.load(src_ptr + src_row * H + cols, mask=mask), mask=mask)


def _move_rows(x, src_rows: torch.Tensor, dst_rows: torch.Tensor, lead: tuple[int, ...]):
    """A new buffer [*lead, H] (or QTensor) with row ``dst_rows[p]`` = ``x[src_rows[p]]``; other rows unset."""

    def move(src: torch.Tensor) -> torch.Tensor:
        width = src.shape[-1]
        raw = src.view(torch.uint8) if src.dtype == torch.float8_e4m3fn else src
        dst = torch.empty(*lead, width, dtype=raw.dtype, device=src.device)
        if src_rows.numel():
            _gather_rows_kernel[(src_rows.numel(),)](
                raw.contiguous(), dst, src_rows, dst_rows, width, BLOCK=512, launch_pdl=PDL
            )
        return dst.view(src.dtype) if src.dtype == torch.float8_e4m3fn else dst

    if isinstance(x, QTensor):
        return QTensor(move(x.data), move(x.scale), x.block, x.scale_format)
    return move(x)


@triton.jit
def _expert_rows_kernel(
    ids_ptr,
    w_ptr,
    pair_rows_ptr,
    recv_ids_ptr,
    recv_w_ptr,
    masked_m_ptr,
    overflow_ptr,
    P,
    capacity,
    LOST_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program e: the pairs naming expert e, in (token, slot) order, take its rows ``e * capacity + 0, 1, ...``;
    pairs past ``capacity`` are lost (``LOST_ROW``, and the overflow flag is set). Writes the pairs' rows, the ids and
    weights of expert e's rows (-1 and 0 where unused) and ``masked_m[e]``; program 0 also marks skipped pairs -1."""
    pdl_wait()
    e = tl.program_id(0)
    count = tl.full((), 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = ids == e
        slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        delivered = hit & (slot < capacity)
        row = e * capacity + slot
        tl.store(pair_rows_ptr + p, tl.where(delivered, row, LOST_ROW), mask=hit)
        if e == 0:
            tl.store(pair_rows_ptr + p, -1, mask=(p < P) & (ids < 0))
        tl.store(recv_ids_ptr + row, e, mask=delivered)
        tl.store(recv_w_ptr + row, tl.load(w_ptr + p, mask=delivered, other=0.0), mask=delivered)
        count += tl.sum(hit.to(tl.int32), axis=0)
    kept = tl.minimum(count, capacity)
    tl.store(masked_m_ptr + e, kept)
    for s0 in range(kept, capacity, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        tl.store(recv_ids_ptr + e * capacity + s, -1, mask=s < capacity)
        tl.store(recv_w_ptr + e * capacity + s, 0.0, mask=s < capacity)
    if count > capacity:
        tl.store(overflow_ptr, 1)


@triton.jit
def _send_rows_kernel(
    x_ptr,
    scale_ptr,
    recv_ptr,
    recv_scale_ptr,
    pair_rows_ptr,
    H,
    S,
    K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program p (pair): copies token ``p // K``'s row (and scale row) to its received row, if it has one."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(pair_rows_ptr + p).to(tl.int64)
    if row < 0:
        return
    t = p // K
    for c0 in range(0, H, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        tl.store(recv_ptr + row * H + cols, tl.load(x_ptr + t * H + cols, mask=cols < H), mask=cols < H)
    if HAS_SCALE:
        cols = tl.arange(0, BLOCK_S)
        tl.store(recv_scale_ptr + row * S + cols, tl.load(scale_ptr + t * S + cols, mask=cols < S), mask=cols < S)


def _dispatch_low_latency(x, ids, weights, num_experts: int, capacity: int):
    tokens, k = ids.shape
    device = ids.device
    pairs = tokens * k
    size = num_experts * capacity
    pair_rows = torch.empty(pairs, dtype=torch.int32, device=device)
    recv_ids = torch.empty(size, dtype=torch.int32, device=device)
    recv_w = torch.empty(size, dtype=torch.float32, device=device)
    masked_m = torch.empty(num_experts, dtype=torch.int32, device=device)
    overflow = torch.zeros((), dtype=torch.bool, device=device)
    _expert_rows_kernel[(num_experts,)](
        ids.reshape(-1).contiguous(),
        weights.reshape(-1).contiguous(),
        pair_rows,
        recv_ids,
        recv_w,
        masked_m,
        overflow.view(torch.uint8),
        pairs,
        capacity,
        LOST_ROW=LOST,
        BLOCK=1024,
        launch_pdl=PDL,
    )
    data = (x.data if isinstance(x, QTensor) else x).contiguous()
    raw = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
    recv = torch.empty(num_experts, capacity, raw.shape[1], dtype=raw.dtype, device=device)
    scale = recv_scale = None
    if isinstance(x, QTensor):
        scale = x.scale.reshape(tokens, -1).contiguous()
        recv_scale = torch.empty(num_experts, capacity, scale.shape[1], dtype=scale.dtype, device=device)
    if pairs:
        _send_rows_kernel[(pairs,)](
            raw,
            scale,
            recv,
            recv_scale,
            pair_rows,
            raw.shape[1],
            0 if scale is None else scale.shape[1],
            K=k,
            HAS_SCALE=scale is not None,
            BLOCK=1024,
            BLOCK_S=next_pow2(1 if scale is None else scale.shape[1]),
            launch_pdl=PDL,
        )
    if isinstance(x, QTensor):
        recv_x = QTensor(
            recv.view(data.dtype), recv_scale.view(num_experts, capacity, *x.scale.shape[1:]), x.block, x.scale_format
        )
    else:
        recv_x = recv
    lead = (num_experts, capacity)
    handle = GpuHandle(
        tokens,
        "low_latency",
        lead,
        pair_rows=pair_rows.view(tokens, k),
        weights=weights.contiguous(),
        overflow=overflow,
    )
    return recv_x, recv_ids.view(lead), recv_w.view(lead), ExpertLayout(masked_m=masked_m), handle


def _dispatch_normal(x, ids, weights, num_experts: int):
    tokens, k = ids.shape
    device = ids.device
    flat = ids.reshape(-1).long()
    valid = flat >= 0
    keys = torch.where(valid, flat, num_experts)
    order = torch.sort(keys, stable=True).indices  # pairs by expert, then by token; skipped pairs last
    sorted_ids = keys[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts[:num_experts], 0)]).int()
    received = int(valid.sum())  # the output size: the one host synchronisation of this mode
    rank = torch.arange(flat.numel(), device=device)
    rows = torch.where(rank < received, rank, -1)
    recv_x = _move_rows(x, (order // k).to(torch.int32), rows.to(torch.int32), (received,))
    target = torch.where(rows >= 0, rows, received)  # skipped pairs land in a spare last entry
    recv_ids = torch.full((received + 1,), -1, dtype=torch.int32, device=device)
    recv_w = torch.zeros(received + 1, dtype=torch.float32, device=device)
    recv_ids[target] = sorted_ids.to(torch.int32)
    recv_w[target] = weights.reshape(-1)[order]
    pair_rows = torch.empty(flat.numel(), dtype=torch.int32, device=device)
    pair_rows[order] = rows.to(torch.int32)
    handle = GpuHandle(tokens, "normal", (received,), pair_rows=pair_rows.view(tokens, k), weights=weights.contiguous())
    return recv_x, recv_ids[:received], recv_w[:received], ExpertLayout(expert_offsets=offsets), handle


def ep_dispatch(x, ids, weights, *, num_experts, group, mode, capacity, placement=None):
    if group is not None and mode == "low_latency":
        return ep.dispatch_low_latency(
            x, ids, weights, group=group, placement=placement, capacity=capacity, place=_place_pairs
        )
    if group is not None:
        return ep.dispatch_normal(
            x,
            ids,
            weights,
            group=group,
            placement=placement,
            count=_count_pairs,
            pack=_pack_copies,
            unpack=_unpack_pairs,
        )
    if mode == "low_latency":
        return _dispatch_low_latency(x, ids, weights, num_experts, capacity)
    return _dispatch_normal(x, ids, weights, num_experts)


def dispatch_supports(x, ids, weights, *, num_experts, group, mode, capacity, placement=None) -> bool | Decline:
    """One process with experts in their natural order; or a group of 2 to ``PACK_MAX_WORLD`` ranks with rows a
    whole number of int32 words, in low-latency mode, or in normal mode with at most ``PACK_MAX_KEYS`` / world
    experts per rank. Other placements, modes and groups go to the core."""
    answer = placed(x=x, ids=ids, weights=weights)
    if not answer:
        return answer
    if group is None:
        if placement is None or tuple(placement.local_experts) == (tuple(range(num_experts)),):
            return True
        return Decline("one process with a placement other than the experts in their natural order")
    world = ep.group_rank_size(group)[1]
    if not 1 < world <= PACK_MAX_WORLD:
        return Decline(f"group of {world} ranks, expected 2 to {PACK_MAX_WORLD}")
    if ep.Payload.of(x).word.itemsize < 4:
        return Decline("x's rows are not a whole number of int32 words")
    keys = world * max(len(e) for e in placement.local_experts)
    if mode != "low_latency" and keys > PACK_MAX_KEYS:
        return Decline(f"normal mode over {world} ranks x experts per rank = {keys} > {PACK_MAX_KEYS}")
    return True


# ----------------------------------------------------------------------------------------------------------------
# Multi-rank normal dispatch: the core's protocol and exchanges (``ep.dispatch_normal``), with fused kernels for the
# sender's and the receiver's index work and row copies (``ep.count_pairs`` / ``pack_copies`` / ``unpack_pairs``).
# The sender's kernels see a block of tokens per program; their pair ranks within (destination, local expert) take a
# one-hot tile of BT * KP pairs x NK keys, so BT shrinks as the keys grow.

PACK_MAX_WORLD = 64
PACK_MAX_KEYS = 1024  # world x experts per rank; more go to the core's torch code
PACK_TILE = 8192  # elements of the one-hot tile


@dataclass(frozen=True)
class _Counted:
    ids: torch.Tensor  # [T, k] int32, contiguous
    stats: torch.Tensor  # [programs, world + world * width] int32: copies per destination, pairs per key
    meta: dict


@triton.jit
def _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K: tl.constexpr, KP: tl.constexpr):
    """Per pair of tokens ``t`` [BT] and slots [KP]: destination rank (W for a skipped or padding pair), local
    expert, validity, by the placement's replica rule."""
    j = tl.arange(0, KP)
    m = (t[:, None] < T) & (j[None, :] < K)
    e = tl.load(ids_ptr + t[:, None] * K + j[None, :], mask=m, other=-1)
    valid = e >= 0
    e = tl.where(valid, e, 0).to(tl.int64)
    copy = (t[:, None] + me) % tl.load(holders_ptr + e)
    d = tl.load(rank_ptr + e * COPIES + copy)
    local = tl.load(local_ptr + e * COPIES + copy)
    return tl.where(valid, d, W), local, valid


@triton.jit
def _count_kernel(
    ids_ptr, holders_ptr, rank_ptr, local_ptr, sent_ptr, stats_ptr, T, me, W, WIDTH, COPIES,
    K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr, NK: tl.constexpr,
):  # fmt: skip
    """Pairs per (destination, local expert) and copies per destination into ``sent`` (atomics); this program's
    copies per destination and pairs per key (destination * WIDTH + local expert) into its row of ``stats``."""
    pdl_wait()
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    d, local, valid = _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K, KP)
    tl.atomic_add(sent_ptr + d * (WIDTH + 1) + local, tl.full(local.shape, 1, tl.int64), mask=valid)
    w = tl.arange(0, BW)
    copies = tl.sum(tl.max((d[:, :, None] == w[None, None, :]).to(tl.int32), axis=1), axis=0)
    row = stats_ptr + pid * (W + W * WIDTH)
    tl.store(row + w, copies, mask=w < W)
    tl.atomic_add(sent_ptr + w * (WIDTH + 1) + WIDTH, copies.to(tl.int64), mask=w < W)
    keys = tl.reshape(tl.where(valid, d * WIDTH + local, -1), (BT * KP,))
    nk = tl.arange(0, NK)
    tl.store(row + W + nk, tl.sum((keys[:, None] == nk[None, :]).to(tl.int32), axis=0), mask=nk < W * WIDTH)


@triton.jit
def _pack_kernel(
    ids_ptr, holders_ptr, rank_ptr, local_ptr, w_ptr, x_ptr, send_ptr, pair_pos_ptr, copy_pos_ptr, stats_ptr, cum_ptr,
    T, me, W, WIDTH, COPIES, NPROG, ROW, SEND_ROW, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
    BW: tl.constexpr, NK: tl.constexpr, BWID: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Writes each copy (x's row, then its record) at its place in send order (destination, token), that place per
    (token, destination) (-1: no copy), and each pair's position in (destination, token, slot) order. ``cum`` is
    ``stats`` summed over programs (inclusive); rows are int32 words. A record is 4 x K int32: local expert (-1: not
    this copy's), weight bits, rank within the pair's (destination, local expert), rank within its destination."""
    pdl_wait()
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    d, local, valid = _pair_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, t, T, me, W, COPIES, K, KP)
    S = W + W * WIDTH
    mine, last = cum_ptr + pid * S, cum_ptr + (NPROG - 1) * S
    own = stats_ptr + pid * S
    # Copies and pairs of earlier programs, and of all programs, per destination and per key.
    w = tl.arange(0, BW)
    wm = w < W
    before_c = tl.load(mine + w, mask=wm, other=0) - tl.load(own + w, mask=wm, other=0)
    total_c = tl.load(last + w, mask=wm, other=0)
    start_c = tl.cumsum(total_c, axis=0) - total_c + before_c
    nk = tl.arange(0, NK)
    km = nk < W * WIDTH
    before_k = tl.load(mine + W + nk, mask=km, other=0) - tl.load(own + W + nk, mask=km, other=0)
    kw = W + w[:, None] * WIDTH + tl.arange(0, BWID)[None, :]
    kwm = wm[:, None] & (tl.arange(0, BWID)[None, :] < WIDTH)
    before_p = tl.sum(tl.load(mine + kw, mask=kwm, other=0) - tl.load(own + kw, mask=kwm, other=0), axis=1)
    total_p = tl.sum(tl.load(last + kw, mask=kwm, other=0), axis=1)
    start_p = tl.cumsum(total_p, axis=0) - total_p

    flat_valid = tl.reshape(valid, (BT * KP,))
    hit = (d[:, :, None] == w[None, None, :]).to(tl.int32)  # [BT, KP, BW]
    by_dest = tl.reshape(hit, (BT * KP, BW))
    dest_rank = tl.sum(by_dest * (before_p[None, :] + tl.cumsum(by_dest, axis=0) - by_dest), axis=1)
    pair_pos = tl.where(flat_valid, tl.sum(by_dest * start_p[None, :], axis=1) + dest_rank, tl.sum(total_p, axis=0))
    keys = tl.reshape(tl.where(valid, d * WIDTH + local, -1), (BT * KP,))
    by_key = (keys[:, None] == nk[None, :]).to(tl.int32)
    key_rank = tl.sum(by_key * (before_k[None, :] + tl.cumsum(by_key, axis=0) - by_key), axis=1)
    j = tl.arange(0, KP)
    jk = (t[:, None] < T) & (j[None, :] < K)
    tj = t[:, None] * K + j[None, :]
    tl.store(pair_pos_ptr + tj, tl.reshape(pair_pos, (BT, KP)).to(tl.int64), mask=jk)

    present = tl.max(hit, axis=1)  # [BT, BW]
    pos_c = start_c[None, :] + tl.cumsum(present, axis=0) - present
    weight_bits = tl.load(w_ptr + tj, mask=jk, other=0.0).to(tl.int32, bitcast=True)
    key_rank = tl.reshape(key_rank, (BT, KP))
    dest_rank = tl.reshape(dest_rank, (BT, KP))
    tm = t < T
    for dd in range(0, W):
        here = (tl.sum(tl.where(w[None, :] == dd, present, 0), axis=1) > 0) & tm
        pos = tl.sum(tl.where(w[None, :] == dd, pos_c, 0), axis=1).to(tl.int64)
        tl.store(copy_pos_ptr + t * W + dd, tl.where(here, pos, -1), mask=tm)
        row = pos * SEND_ROW
        mine_j = d == dd
        rec = send_ptr + row[:, None] + ROW + j[None, :]
        rm = here[:, None] & (j[None, :] < K)
        tl.store(rec, tl.where(mine_j, local, -1).to(tl.int32), mask=rm)
        tl.store(rec + K, tl.where(mine_j, weight_bits, -1), mask=rm)
        tl.store(rec + 2 * K, tl.where(mine_j, key_rank, -1), mask=rm)
        tl.store(rec + 3 * K, tl.where(mine_j, dest_rank, -1), mask=rm)
        for c0 in range(0, ROW, BC):
            cols = c0 + tl.arange(0, BC)
            cm = cols[None, :] < ROW
            v = tl.load(x_ptr + t[:, None].to(tl.int64) * ROW + cols[None, :], mask=tm[:, None] & cm)
            tl.store(send_ptr + row[:, None] + cols[None, :], v, mask=here[:, None] & cm)


def _pack_meta(tab, world: int, k: int) -> dict:
    kp, nk = next_pow2(k), next_pow2(world * tab.width)
    bt = max(1, min(32, PACK_TILE // (kp * nk)))
    return dict(K=k, KP=kp, BT=bt, BW=next_pow2(world + 1), NK=nk)


def _count_pairs(ids, tab, me: int, world: int):
    tokens, k = ids.shape
    meta = _pack_meta(tab, world, k)
    nprog = triton.cdiv(tokens, meta["BT"])
    ids32 = ids.to(torch.int32).contiguous()
    sent = torch.zeros(world, tab.width + 1, dtype=torch.int64, device=ids.device)
    stats = torch.empty(nprog, world + world * tab.width, dtype=torch.int32, device=ids.device)
    if tokens:
        _count_kernel[(nprog,)](
            ids32, tab.holders, tab.rank, tab.local, sent, stats, tokens, me, world, tab.width, tab.rank.shape[1],
            **meta,
            launch_pdl=PDL,
        )  # fmt: skip
    return sent, _Counted(ids32, stats, meta)


def _pack_copies(x, payload, ids, weights, tab, me: int, world: int, counted: _Counted):
    tokens, k = ids.shape
    xw = payload.to_words(x).contiguous().view(torch.int32)
    row = xw.shape[1]
    rec = ep.RECORD_FIELDS * k
    send = torch.empty(min(world, k) * tokens, row + rec, dtype=torch.int32, device=ids.device)
    pair_pos = torch.empty(tokens, k, dtype=torch.int64, device=ids.device)
    copy_pos = torch.empty(tokens, world, dtype=torch.int64, device=ids.device)
    stats = counted.stats
    if tokens:
        _pack_kernel[(stats.shape[0],)](
            counted.ids, tab.holders, tab.rank, tab.local, weights.float().contiguous(), xw, send, pair_pos, copy_pos,
            stats, stats.cumsum(0, dtype=torch.int32), tokens, me, world, tab.width, tab.rank.shape[1],
            stats.shape[0], row, row + rec, BWID=next_pow2(tab.width), BC=256, **counted.meta,
            launch_pdl=PDL,
        )  # fmt: skip
    return send.view(payload.word), pair_pos, copy_pos


@triton.jit
def _unpack_kernel(
    buf_ptr, gid_ptr, expert_base_ptr, source_base_ptr, copy_start_ptr, out0_ptr, out1_ptr, ids_ptr, w_ptr,
    final_ptr, copy_rows_ptr, copy_w_ptr, C, W, E_LOCAL, BUF_ROW, ROW, SPLIT, K: tl.constexpr, BCP: tl.constexpr,
    BW: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Slot ``program_id(1)`` of received copies ``c``: the pair's layout row from its record and its source's
    bases; its copy's words go to that row of ``out0`` (the first SPLIT) and ``out1`` (the rest), with its id and
    weight; ``final[receive index] = row``, ``copy_rows[c, slot] = row`` and ``copy_w[c, slot]`` its weight (-1 and 0
    for a slot not sent here)."""
    pdl_wait()
    c = tl.program_id(0) * BCP + tl.arange(0, BCP)
    j = tl.program_id(1)
    cm = c < C
    rec = buf_ptr + c.to(tl.int64) * BUF_ROW + ROW + j
    local = tl.load(rec, mask=cm, other=-1)
    mask = cm & (local >= 0)
    w = tl.arange(0, BW)
    ends = tl.load(copy_start_ptr + 1 + w, mask=w < W, other=2**62)
    source = tl.sum((c[:, None] >= ends[None, :]).to(tl.int32), axis=1)
    row = tl.load(expert_base_ptr + source * E_LOCAL + local, mask=mask, other=0) + tl.load(rec + 2 * K, mask=mask)
    weight = tl.load(rec + K, mask=mask, other=0).to(tl.float32, bitcast=True)
    tl.store(copy_rows_ptr + c.to(tl.int64) * K + j, tl.where(mask, row, -1).to(tl.int64), mask=cm)
    tl.store(copy_w_ptr + c.to(tl.int64) * K + j, weight, mask=cm)
    tl.store(final_ptr + tl.load(source_base_ptr + source, mask=mask, other=0) + tl.load(rec + 3 * K, mask=mask), row,
             mask=mask)  # fmt: skip
    tl.store(ids_ptr + row, tl.load(gid_ptr + local, mask=mask), mask=mask)
    tl.store(w_ptr + row, weight, mask=mask)
    src = buf_ptr + c.to(tl.int64)[:, None] * BUF_ROW
    for c0 in range(0, ROW, BC):
        cols = c0 + tl.arange(0, BC)[None, :]
        v = tl.load(src + cols, mask=mask[:, None] & (cols < ROW))
        tl.store(out0_ptr + row[:, None] * SPLIT + cols, v, mask=mask[:, None] & (cols < SPLIT))
        rest = mask[:, None] & (cols >= SPLIT) & (cols < ROW)
        tl.store(out1_ptr + row[:, None] * (ROW - SPLIT) + cols - SPLIT, v, mask=rest)


def _unpack_pairs(buf, payload, k: int, num_recv: int, tables, global_ids):
    dev = buf.device
    b32 = buf.view(torch.int32)
    row = b32.shape[1] - ep.RECORD_FIELDS * k
    parts = payload.alloc(num_recv, dev)
    out32 = [p.view(torch.int32) for p in parts]
    recv_ids = torch.empty(num_recv, dtype=torch.int32, device=dev)
    recv_w = torch.empty(num_recv, dtype=torch.float32, device=dev)
    final = torch.empty(num_recv, dtype=torch.int64, device=dev)
    copy_rows = torch.empty(b32.shape[0], k, dtype=torch.int64, device=dev)
    copy_w = torch.empty(b32.shape[0], k, dtype=torch.float32, device=dev)
    world, e_local = tables.expert_base.shape
    if num_recv:
        bcp = 16
        _unpack_kernel[(triton.cdiv(b32.shape[0], bcp), k)](
            b32, global_ids, tables.expert_base, tables.source_base, tables.copy_start, out32[0], out32[-1],
            recv_ids, recv_w, final, copy_rows, copy_w, b32.shape[0], world, e_local, b32.shape[1], row,
            payload.spans[0][1] // 4, K=k, BCP=bcp, BW=next_pow2(world), BC=256,
            launch_pdl=PDL,
        )  # fmt: skip
    return parts, recv_ids, recv_w, final, copy_rows, copy_w


# ----------------------------------------------------------------------------------------------------------------
# Multi-rank low-latency dispatch: the core's exchange (``ep.dispatch_low_latency``), with two kernels for the
# receiver's index work and row copies (``ep.place_pairs``): one program per (destination, local expert) of the whole
# group ranks that key's pairs of the gathered routing in (slot, j) order, then one program per pair copies a row
# held here.


@triton.jit
def _gathered_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, p, P, per_rank, WIDTH, COPIES, K: tl.constexpr):
    """Per flat pair ``p`` of the gathered routing (slot ``p // K`` holds token ``slot % per_rank`` of rank ``slot //
    per_rank``): its key, destination * WIDTH + local expert by the placement's replica rule (-1 for a skipped or
    padding pair), and its expert id."""
    e = tl.load(ids_ptr + p, mask=p < P, other=-1)
    valid = e >= 0
    e64 = tl.where(valid, e, 0).to(tl.int64)
    slot = p // K
    copy = (slot % per_rank + slot // per_rank) % tl.load(holders_ptr + e64, mask=valid, other=1)
    d = tl.load(rank_ptr + e64 * COPIES + copy, mask=valid, other=0)
    local = tl.load(local_ptr + e64 * COPIES + copy, mask=valid, other=0)
    return tl.where(valid, d * WIDTH + local, -1), e


@triton.jit
def _place_kernel(
    ids_ptr, w_ptr, holders_ptr, rank_ptr, local_ptr, rows_ptr, mine_ptr, lost_ptr, recv_ids_ptr, recv_w_ptr,
    masked_m_ptr, overflow_ptr, P, per_rank, me, WIDTH, COPIES, N_LOCAL, max_m, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``key`` (destination * WIDTH + local expert): its pairs, in flat order, take ranks 0, 1, ...; those
    below ``max_m`` are delivered. Writes each of its pairs' ``rows`` (layout row where held here, else -1) and
    ``mine``, marks the slots of pairs past ``max_m`` in ``lost`` and sets ``overflow``; for a key of this rank, the
    ids and weights of its rows (-1 and 0 where unused) and its ``masked_m``. Program 0 also writes the skipped
    pairs (-1, not mine)."""
    pdl_wait()
    key = tl.program_id(0)
    lidx = key % WIDTH
    own = (key // WIDTH == me) & (lidx < N_LOCAL)
    count = tl.full((), 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        keys, e = _gathered_keys(ids_ptr, holders_ptr, rank_ptr, local_ptr, p, P, per_rank, WIDTH, COPIES, K)
        hit = keys == key
        rank = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        delivered = hit & (rank < max_m) & (tl.zeros((BLOCK,), tl.int32) + own.to(tl.int32) > 0)  # own, per lane
        row = lidx * max_m + rank
        tl.store(rows_ptr + p, tl.where(delivered, row, -1).to(tl.int64), mask=hit)
        tl.store(mine_ptr + p, delivered.to(tl.int8), mask=hit)
        tl.store(lost_ptr + p // K, tl.full((BLOCK,), 1, tl.int8), mask=hit & (rank >= max_m))
        if key == 0:
            skipped = (p < P) & (keys < 0)
            tl.store(rows_ptr + p, tl.full((BLOCK,), -1, tl.int64), mask=skipped)
            tl.store(mine_ptr + p, tl.zeros((BLOCK,), tl.int8), mask=skipped)
        tl.store(recv_ids_ptr + row, e, mask=delivered)
        tl.store(recv_w_ptr + row, tl.load(w_ptr + p, mask=delivered, other=0.0), mask=delivered)
        count += tl.sum(hit.to(tl.int32), axis=0)
    if own:
        kept = tl.minimum(count, max_m)
        tl.store(masked_m_ptr + lidx, kept)
        for s0 in range(kept, max_m, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            tl.store(recv_ids_ptr + lidx * max_m + s, tl.full((BLOCK,), -1, tl.int32), mask=s < max_m)
            tl.store(recv_w_ptr + lidx * max_m + s, tl.zeros((BLOCK,), tl.float32), mask=s < max_m)
    if count > max_m:
        tl.store(overflow_ptr, 1)


@triton.jit
def _place_rows_kernel(src_ptr, out0_ptr, out1_ptr, rows_ptr, SRC_ROW, ROW, SPLIT, K: tl.constexpr, BC: tl.constexpr):
    """Program p (pair): if held here, its slot's payload words (``ROW`` int32, the first ``SPLIT`` to ``out0``, the
    rest to ``out1``) go to its layout row."""
    pdl_wait()
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + p)
    if row < 0:
        return
    src = src_ptr + (p // K) * SRC_ROW
    for c0 in range(0, ROW, BC):
        cols = c0 + tl.arange(0, BC)
        v = tl.load(src + cols, mask=cols < ROW)
        tl.store(out0_ptr + row * SPLIT + cols, v, mask=cols < SPLIT)
        tl.store(out1_ptr + row * (ROW - SPLIT) + cols - SPLIT, v, mask=(cols >= SPLIT) & (cols < ROW))


def _place_pairs(g_x, g_ids, g_w, payload, tab, me: int, world: int, per_rank: int, max_m: int):
    dev = g_ids.device
    slots, k = g_ids.shape
    n_local = len(tab.global_ids[me])
    size = n_local * max_m
    src = g_x.view(torch.int32)
    parts = payload.alloc(size, dev)
    out32 = [p.view(torch.int32) for p in parts]
    recv_ids = torch.empty(size, dtype=torch.int32, device=dev)
    recv_w = torch.empty(size, dtype=torch.float32, device=dev)
    masked_m = torch.empty(n_local, dtype=torch.int32, device=dev)
    overflow = torch.zeros((), dtype=torch.bool, device=dev)
    rows = torch.empty(slots, k, dtype=torch.int64, device=dev)
    mine = torch.empty(slots, k, dtype=torch.bool, device=dev)
    lost = torch.zeros(slots, dtype=torch.bool, device=dev)
    _place_kernel[(world * tab.width,)](
        g_ids.contiguous(), g_w.contiguous(), tab.holders, tab.rank, tab.local, rows, mine.view(torch.int8),
        lost.view(torch.int8), recv_ids, recv_w, masked_m, overflow.view(torch.int8), slots * k, max(per_rank, 1), me,
        tab.width, tab.rank.shape[1], n_local, max_m, K=k, BLOCK=1024,
        launch_pdl=PDL,
    )  # fmt: skip
    if slots and size:
        _place_rows_kernel[(slots * k,)](
            src, out32[0], out32[-1], rows, src.stride(0), src.shape[1], payload.spans[0][1] // 4, K=k, BC=1024,
            launch_pdl=PDL,
        )  # fmt: skip
    return ep.Placed(parts, recv_ids, recv_w, masked_m, overflow, rows, mine, lost)


@triton.jit
def _combine_kernel(y_ptr, rows_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):  # slot order: the sum never depends on other tokens
        row = tl.load(rows_ptr + t * K + j).to(tl.int64)
        if row >= 0:
            w = tl.load(w_ptr + t * K + j)
            acc += w * tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        elif row == -2:  # a row lost to capacity overflow: the token's result is NaN, never silently short
            acc += float("nan")
    tl.store(out_ptr + t * H + cols, cast(acc, out_ptr.dtype.element_ty), mask=mask)


def _weighted_sum(rows: torch.Tensor, pair_rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] = sum_j weights[t, j] * rows[pair_rows[t, j]]`` for ``out [T, H]`` (contiguous): each product rounded
    to fp32, added to a zero fp32 accumulator in slot order (no fused multiply-add), then rounded to out's dtype. A
    pair row of -1 is skipped; ``LOST`` makes the token NaN. ``rows [R, H]``, ``pair_rows [T, k]`` int32/int64,
    ``weights [T, k]`` fp32."""
    tokens, hidden = out.shape
    if tokens:
        block = min(1024, next_pow2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block))](
            rows.contiguous(),
            pair_rows.contiguous(),
            weights.contiguous(),
            out,
            hidden,
            K=pair_rows.shape[1],
            BLOCK=block,
            enable_fp_fusion=False,
            launch_pdl=PDL,
        )


def ep_combine(y, handle):
    if isinstance(handle, ep.NormalHandle):
        return ep.combine_normal(y, handle, weighted_sum=_weighted_sum)
    if isinstance(handle, ep.LowLatencyHandle):
        return ep.combine_low_latency(y, handle, weighted_sum=_weighted_sum)
    hidden = y.shape[-1]
    out = torch.empty(handle.num_tokens, hidden, dtype=y.dtype, device=y.device)
    _weighted_sum(y.reshape(-1, hidden), handle.pair_rows, handle.weights, out)
    return out


def combine_supports(y, handle) -> bool | Decline:
    """The one-process handle of this backend's dispatch, or a handle of the core's multi-rank dispatch."""
    if not isinstance(handle, (GpuHandle, ep.NormalHandle, ep.LowLatencyHandle)):
        return Decline(f"handle is a {type(handle).__name__}, not one of this backend's or the core's dispatch")
    return placed(y=y)


# --- moe_route_hash -----------------------------------------------------------------------------------------------


@triton.jit
def _route_hash_kernel(
    logits_ptr,
    ids_ptr,
    w_ptr,
    out_ids_ptr,
    E,
    stride_t,
    stride_ids,
    stride_k,
    scaling,
    SCORING: tl.constexpr,
    RENORM: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token: the scores of its given experts (SCORING 0 sigmoid, 1 softmax over all E, 2 sqrt-softplus)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + t * stride_ids + k * stride_k, mask=k < TOP_K, other=0)
    x = tl.load(logits_ptr + t * stride_t + ids, mask=k < TOP_K, other=0.0)
    if SCORING == 0:
        scores = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        row_max = float("-inf")
        for start in range(0, E, 1024):
            cols = start + tl.arange(0, 1024)
            row_max = tl.maximum(
                row_max, tl.max(tl.load(logits_ptr + t * stride_t + cols, mask=cols < E, other=float("-inf")), axis=0)
            )
        total = 0.0
        for start in range(0, E, 1024):
            cols = start + tl.arange(0, 1024)
            v = tl.load(logits_ptr + t * stride_t + cols, mask=cols < E, other=float("-inf"))
            total += tl.sum(tl.exp(v - row_max), axis=0)
        scores = tl.exp(x - row_max) / total
    else:
        scores = sqrt_softplus(x)
    scores = tl.where(k < TOP_K, scores, 0.0)
    if RENORM:
        scores = scores / (tl.sum(scores, axis=0) + 1e-20)
    tl.store(w_ptr + t * TOP_K + k, scores * scaling, mask=k < TOP_K)
    tl.store(out_ids_ptr + t * TOP_K + k, ids, mask=k < TOP_K)


def moe_route_hash(logits, expert_ids, *, renormalize, routed_scaling_factor, scoring):
    tokens, top_k = expert_ids.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_hash_kernel[(tokens,)](
            logits,
            expert_ids,
            weights,
            ids,
            logits.shape[1],
            logits.stride(0),
            expert_ids.stride(0),
            expert_ids.stride(1),
            routed_scaling_factor,
            SCORING=("sigmoid", "softmax", "sqrtsoftplus").index(scoring),
            RENORM=renormalize,
            TOP_K=top_k,
            BLOCK_K=next_pow2(top_k),
            launch_pdl=PDL,
        )
    return weights, ids


def route_hash_supports(logits, expert_ids, *, renormalize, routed_scaling_factor, scoring) -> bool | Decline:
    answer = placed(logits=logits, expert_ids=expert_ids)
    if not answer:
        return answer
    if logits.stride(1) != 1:
        return Decline("logits' rows are not contiguous")
    if expert_ids.shape[1] > 256:
        return Decline(f"expert_ids has {expert_ids.shape[1]} experts per token > 256")
    return True
