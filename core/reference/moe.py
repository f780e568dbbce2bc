"""Reference ``moe_route``, ``ep_dispatch``, ``ep_combine`` (one process)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops.moe import DispatchHandle, ExpertLayout
from ..qtensor import QTensor


def moe_route(logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring):
    tokens, num_experts = logits.shape
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
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


def _scatter_rows(x, rows: torch.Tensor, index: torch.Tensor, lead: tuple[int, ...]):
    """Rows ``x[index]`` placed at flat positions ``rows`` of a zero buffer ``[*lead, H]``."""

    def place(src: torch.Tensor) -> torch.Tensor:
        buf = torch.zeros(math.prod(lead), src.shape[-1], dtype=src.dtype, device=src.device)
        if src.dtype == torch.float8_e4m3fn:  # index_put on fp8 is not implemented everywhere: move bytes
            buf.view(torch.uint8)[rows] = src.view(torch.uint8)[index]
        else:
            buf[rows] = src[index]
        return buf.view(*lead, src.shape[-1])

    if isinstance(x, QTensor):
        return QTensor(place(x.data), place(x.scale), x.block, x.scale_format)
    return place(x)


def ep_dispatch(x, ids, weights, *, num_experts, group, mode, capacity):
    tokens, k = ids.shape
    flat_ids = ids.reshape(-1).long()
    valid = flat_ids >= 0
    # Pairs sorted by expert, then by source token (a stable sort of the flat (t, j) order).
    order = torch.sort(torch.where(valid, flat_ids, num_experts), stable=True).indices[: int(valid.sum())]
    counts = torch.bincount(flat_ids[valid], minlength=num_experts).to(torch.int32)
    src_tokens = order // k
    if mode == "normal":
        recv_x = _take_rows(x, src_tokens)
        rows = torch.arange(order.numel(), device=ids.device)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
        offsets[1:] = counts.cumsum(0)
        layout, lead = ExpertLayout(expert_offsets=offsets), (order.numel(),)
        recv_ids, recv_w = flat_ids[order].to(torch.int32), weights.reshape(-1)[order]
    else:
        starts = torch.cumsum(counts, 0) - counts
        sorted_ids = flat_ids[order]
        slot = torch.arange(order.numel(), device=ids.device) - starts[sorted_ids]
        rows = sorted_ids * capacity + slot
        lead = (num_experts, capacity)
        recv_x = _scatter_rows(x, rows, src_tokens, lead)
        recv_ids = torch.full((num_experts * capacity,), -1, dtype=torch.int32, device=ids.device)
        recv_w = torch.zeros(num_experts * capacity, dtype=torch.float32, device=ids.device)
        recv_ids[rows] = sorted_ids.to(torch.int32)
        recv_w[rows] = weights.reshape(-1)[order]
        recv_ids, recv_w = recv_ids.view(lead), recv_w.view(lead)
        layout = ExpertLayout(masked_m=counts)
    pair_rows = torch.full((tokens * k,), -1, dtype=torch.int64, device=ids.device)
    pair_rows[order] = rows
    handle = LocalHandle(tokens, mode, lead, pair_rows=pair_rows.view(tokens, k), weights=weights)
    return recv_x, recv_ids, recv_w, layout, handle


def ep_combine(y, handle):
    flat = y.reshape(-1, y.shape[-1]).float()
    rows = handle.pair_rows
    out = torch.zeros(handle.num_tokens, y.shape[-1], dtype=torch.float32, device=y.device)
    if flat.shape[0] == 0:
        return out.to(y.dtype)
    valid = (rows >= 0).unsqueeze(-1)
    # Unused rows may hold anything (even NaN): select, never multiply them by zero.
    picked = torch.where(valid, flat[rows.clamp_min(0)] * handle.weights.unsqueeze(-1), 0.0)  # [T, k, H]
    for j in range(rows.shape[1]):  # fixed order over the k slots: the sum cannot depend on other tokens
        out += picked[:, j]
    return out.to(y.dtype)
