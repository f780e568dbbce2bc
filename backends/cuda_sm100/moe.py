"""``moe_route`` (fused group-limited top-k), the one-process ``ep_dispatch`` / ``ep_combine``, the index work and
row copies of the core's multi-rank normal-mode ``ep_dispatch``, and the weighted sum of its ``ep_combine``.

``normal`` dispatch sorts (token, expert) pairs by expert on the device and moves rows with a gather kernel, a row
for every pair (the skipped ones last), so nothing is read on the host. ``low_latency`` dispatch has fixed shapes
too: one program per expert lays out that expert's rows, then one program per pair copies its row (three launches in
all, for the decode steps that CUDA graphs replay). Combine sums each token's k rows in slot order in
fp32 (batch-invariant), one kernel for the one-process handle, for the rows a multi-rank normal-mode combine brings
back and for its per-rank partial sums. Over a process group, normal mode keeps the core's protocol and exchanges
(``ep.dispatch_normal``) and replaces its torch index work with three kernels: the sender counts its pairs and
copies per program, then writes each copy with its record at its place in send order; the receiver copies each
pair's row into the layout. Low-latency mode keeps the core's all-gather of the routing
(``ep.dispatch_low_latency``); two kernels rank every pair of the gathered routing per destination and copy this
rank's rows (the core's torch code takes about 70 device ops for that).

This file holds the ops' entry points, their ``supports`` and the launches; the Triton kernels are in
``moe_triton.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from deepinfer import Decline, QTensor
from deepinfer.ops import DispatchHandle, ExpertLayout
from deepinfer.reference import ep

from ._triton import PDL, next_pow2, placed
from .moe_triton import (
    _combine_kernel,
    _count_kernel,
    _expert_rows_kernel,
    _gather_rows_kernel,
    _pack_kernel,
    _place_kernel,
    _place_rows_kernel,
    _route_hash_kernel,
    _route_kernel,
    _send_rows_kernel,
    _unpack_kernel,
)


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
    pairs = flat.numel()  # every pair gets a row (skipped ones last, in the last expert's range): no host sync
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts[: num_experts - 1], 0), counts.new_full((1,), pairs)])
    rank = torch.arange(pairs, device=device, dtype=torch.int32)
    recv_x = _move_rows(x, (order // k).to(torch.int32), rank, (pairs,))
    kept = sorted_ids < num_experts
    recv_ids = torch.where(kept, sorted_ids, -1).to(torch.int32)
    recv_w = torch.where(kept, weights.reshape(-1)[order], 0.0)
    pair_rows = torch.empty(pairs, dtype=torch.int32, device=device)
    pair_rows[order] = torch.where(kept, rank, -1)
    handle = GpuHandle(tokens, "normal", (pairs,), pair_rows=pair_rows.view(tokens, k), weights=weights.contiguous())
    return recv_x, recv_ids, recv_w, ExpertLayout(expert_offsets=offsets.int()), handle


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
