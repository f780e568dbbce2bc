"""Reference ``moe_route``, ``ep_dispatch``, ``ep_combine``.

One process in normal mode is a permutation by expert, here; several ranks, and the low-latency mode at any world
size, are in ``ep.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dispatch import batch_invariant_enabled
from ..ops.moe import DispatchHandle, ExpertLayout
from ..qtensor import QTensor
from . import ep

_SCORE = {
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
    "sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt(),  # DeepSeek-V4
}


def _scores(logits, scoring):
    """``[T, E]`` fp32 router scores."""
    score = _SCORE[scoring]
    if batch_invariant_enabled() and logits.shape[0] > 1:
        # torch's vectorised body and scalar tail round sigmoid/exp differently, and where a row's values fall in
        # the [T, E] tensor depends on T: score each row on its own.
        return torch.stack([score(row) for row in logits])
    return score(logits)


def moe_route(logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring):
    tokens, num_experts = logits.shape
    scores = _scores(logits, scoring)
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choice.view(tokens, n_group, num_experts // n_group)
        if scoring == "sigmoid":  # a group scores the sum of its two best experts
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:  # DeepSeek-V2's group-limited greedy: a group scores its best expert
            group_scores = grouped.amax(dim=-1)
        kept = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.repeat_interleave(num_experts // n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def moe_route_hash(logits, expert_ids, *, renormalize, routed_scaling_factor, scoring):
    weights = _scores(logits, scoring).gather(1, expert_ids.long())
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids.clone()


@dataclass
class LocalHandle(DispatchHandle):
    """pair_rows[t, j]: the received row holding pair (t, j), -1 if skipped (flat index into the recv rows);
    weights: the [T, k] routing weights."""

    pair_rows: torch.Tensor = None
    weights: torch.Tensor = None


def _take_rows(x, index: torch.Tensor):
    if isinstance(x, QTensor):
        return QTensor(x.data[index], x.scale[index], x.block, x.scale_format)
    return x[index]


def _dispatch_local(x, ids, weights, *, num_experts):
    """One process, normal mode, experts in id order: a permutation of all ``T * k`` pairs by expert, the skipped
    ones last (in the last expert's range, id -1, weight 0; their rows here copies of their tokens)."""
    tokens, k = ids.shape
    flat_ids = ids.reshape(-1).long()
    valid = flat_ids >= 0
    # Pairs sorted by expert, then by source token (a stable sort of the flat (t, j) order).
    order = torch.sort(torch.where(valid, flat_ids, num_experts), stable=True).indices
    counts = torch.bincount(flat_ids[valid], minlength=num_experts).to(torch.int32)
    recv_x = _take_rows(x, order // k)
    kept = valid[order]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    offsets[1:] = counts.cumsum(0)
    offsets[-1] = order.numel()
    recv_ids = torch.where(kept, flat_ids[order], -1).to(torch.int32)
    recv_w = torch.where(kept, weights.reshape(-1)[order], 0.0)
    pair_rows = torch.empty(tokens * k, dtype=torch.int64, device=ids.device)
    pair_rows[order] = torch.where(kept, torch.arange(order.numel(), device=ids.device), -1)
    handle = LocalHandle(tokens, "normal", (order.numel(),), pair_rows=pair_rows.view(tokens, k), weights=weights)
    return recv_x, recv_ids, recv_w, ExpertLayout(expert_offsets=offsets), handle


def ep_dispatch(x, ids, weights, *, num_experts, group, mode, capacity, placement):
    _, world = ep.group_rank_size(group)
    if mode == "low_latency":
        return ep.dispatch_low_latency(x, ids, weights, group=group, placement=placement, capacity=capacity)
    if world > 1:
        return ep.dispatch_normal(x, ids, weights, group=group, placement=placement)
    local_order = placement.local_experts[0]
    if local_order == tuple(range(num_experts)):
        return _dispatch_local(x, ids, weights, num_experts=num_experts)
    # Experts in another local order: dispatch by local index, report global ids.
    to_global = torch.tensor(local_order, dtype=torch.int32, device=ids.device)
    to_local = torch.full((num_experts + 1,), -1, dtype=torch.int32, device=ids.device)  # entry E: id -1 stays -1
    to_local[to_global.long()] = torch.arange(num_experts, dtype=torch.int32, device=ids.device)
    local_ids = to_local[torch.where(ids >= 0, ids.long(), num_experts)]
    recv_x, recv_local, recv_w, layout, handle = _dispatch_local(x, local_ids, weights, num_experts=num_experts)
    recv_ids = torch.where(recv_local >= 0, to_global[recv_local.long().clamp_min(0)], -1)
    return recv_x, recv_ids, recv_w, layout, handle


def ep_combine(y, handle):
    if isinstance(handle, ep.NormalHandle):
        return ep.combine_normal(y, handle)
    if isinstance(handle, ep.LowLatencyHandle):
        return ep.combine_low_latency(y, handle)
    out = torch.empty(handle.num_tokens, y.shape[-1], dtype=y.dtype, device=y.device)
    ep.weighted_gather_sum(y.reshape(-1, y.shape[-1]), handle.pair_rows, handle.weights, out)
    return out
