"""MoE ops on Ascend: ``moe_route``, ``ep_dispatch``, ``ep_combine`` (one process), and the multi-rank wiring.

Fused operators (torch_npu, op-plugin docs):
- ``moe_route`` -> ``npu_moe_gating_top_k(logits, k, bias, k_group, group_count, group_select_mode, renorm=0,
  norm_type, routed_scaling_factor, eps=1e-20)``. We follow the doc's "equivalent computation logic": norm_type 1 is
  sigmoid and then renormalises by ``sum + eps``, 0 is softmax without renormalisation (the English doc's
  parameter table says the opposite; the Chinese one, the example and the logic agree with us). Group scores:
  top-2 sum (mode 1, sigmoid) or max (mode 0, softmax). Sigmoid without renormalisation has no fused form;
  softmax with it is renormalised after. DeepSeek-V4's ``sqrtsoftplus`` scores have no documented ``norm_type``:
  plain torch.
- ``moe_route_hash`` (experts given per token): plain torch, a gather of the scores; no operator takes the experts.
- ``ep_dispatch`` -> ``npu_moe_init_routing_v2``: a stable sort of the (token, k) pairs by expert (ids outside
  ``[0, E)``, i.e. -1, are left out), gather indices (``row_idx_type`` 0) and per-expert counts
  (``expert_tokens_num_type`` 1). FP8 rows travel as their bytes (an int8 view; the op takes int8 x) and their
  ``[T, H/128]`` scales are gathered with the returned indices (the op only carries a 1-D scale).
  ``low_latency`` with ``0 < capacity < T`` uses the op's drop-pad mode (rows padded to ``capacity`` per expert);
  otherwise the dropless result is placed into the ``[E, capacity]`` layout on the device, without a host sync.
- ``ep_combine`` -> ``npu_moe_finalize_routing`` with the row-major index modes (2 dropless, 3 drop-pad). The op
  takes ``scales`` in the dtype of the rows, so routing weights are rounded to bf16 for bf16 expert outputs.

Multi-rank (a group of world size > 1): declined here; ``ep_mc2`` wires torch_npu's MC2 operators
(``npu_moe_distribute_dispatch_v2`` / ``combine_v2``), and the core's reference collectives run where it declines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer import Decline, QTensor
from deepinfer.ops import ExpertLayout
from deepinfer.reference.moe import LocalHandle

from . import probe


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------------------------
# moe_route


def moe_route_gating(
    logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_route`` through ``npu_moe_gating_top_k``."""
    tokens = logits.shape[0]
    if tokens == 0:
        return logits.new_zeros(0, top_k), torch.zeros(0, top_k, dtype=torch.int32, device=logits.device)
    npu = probe.torch_npu()
    sigmoid = scoring == "sigmoid"
    weights, ids, _ = npu.npu_moe_gating_top_k(
        logits,
        top_k,
        bias=bias,
        k_group=topk_group,
        group_count=n_group,
        group_select_mode=1 if sigmoid else 0,  # 1: top-2 sum per group, 0: max
        renorm=0,
        norm_type=1 if sigmoid else 0,  # per the doc's equivalent logic: 1 sigmoid (renormalised), 0 softmax
        out_flag=False,
        routed_scaling_factor=routed_scaling_factor if (sigmoid or not renormalize) else 1.0,
        eps=1e-20,
    )
    if not sigmoid and renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor
    return weights.float(), ids


def moe_route_gating_supports(
    logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring
) -> bool:
    experts = logits.shape[1]
    per_group = experts // n_group
    if not (answer := probe.placed(logits=logits, bias=bias)):
        return answer
    if experts > 2048:
        return Decline(f"logits has {experts} experts > 2048")
    # The docs' group rule holds for one group too: more than 2 experts per group, aligned to 32 within 2048.
    if not (per_group > 2 and -(-per_group // 32) * 32 * n_group <= 2048):
        return Decline(f"n_group {n_group}: groups of {per_group} experts, expected > 2 and <= 2048 padded to 32")
    if scoring == "sqrtsoftplus":  # norm_type is documented for softmax (0) and sigmoid (1) only
        return Decline("scoring 'sqrtsoftplus' has no norm_type")
    if not renormalize and scoring != "softmax":
        return Decline(f"renormalize=False with scoring {scoring!r}: only softmax scores go unrenormalized")
    return True


def _scores(logits, scoring) -> torch.Tensor:
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    return torch.nn.functional.softplus(logits).sqrt()  # DeepSeek-V4's sqrtsoftplus


def moe_route_torch(
    logits, bias, *, top_k, n_group, topk_group, renormalize, routed_scaling_factor, scoring
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited routing in plain torch (fp32)."""
    tokens, experts = logits.shape
    scores = _scores(logits, scoring)
    choose = scores if bias is None else scores + bias
    if n_group > 1:
        grouped = choose.view(tokens, n_group, experts // n_group)
        if scoring == "sigmoid":
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.amax(dim=-1)
        dropped = torch.ones(tokens, n_group, dtype=torch.bool, device=logits.device)
        dropped.scatter_(1, group_score.topk(topk_group, dim=-1).indices, False)
        choose = grouped.masked_fill(dropped[..., None], float("-inf")).view(tokens, experts)
    ids = choose.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def moe_route_hash_torch(
    logits, expert_ids, *, renormalize, routed_scaling_factor, scoring
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of the given experts in plain torch (fp32): no torch_npu operator takes the experts as input."""
    weights = _scores(logits, scoring).gather(1, expert_ids.long())
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids.clone()


# ---------------------------------------------------------------------------------------------------------------
# ep_dispatch / ep_combine (one process)


@dataclass
class AscendHandle(LocalHandle):
    """The local handle, with torch_npu's view of it: ``src_to_dst`` [T * k] int32, for pair ``t * k + j`` the
    received row (flat over ``[M]`` or ``[E * capacity]``) or -1; ``lost`` [T] bool, tokens that lost a row to
    capacity overflow (low_latency). ``pair_rows`` (int64 [T, k]) carries the same rows so that the core's reference
    ``ep_combine`` can take over for arguments this backend declines."""

    src_to_dst: torch.Tensor | None = None
    lost: torch.Tensor | None = None
    received: torch.Tensor | None = None  # normal mode: the rows holding pairs (device scalar), the rest skipped


def _row_bytes(x) -> torch.Tensor:
    """What init_routing moves: the token rows, FP8 ones as their bytes (int8 view; the op takes int8 x)."""
    return x.data.view(torch.int8) if isinstance(x, QTensor) else x


def _scatter_rows(values: torch.Tensor, rows_of_pair: torch.Tensor, total: int, fill) -> torch.Tensor:
    """Puts ``values[p]`` (one per (token, k) pair) at received row ``rows_of_pair[p]``; rows nobody fills get
    ``fill``. Left-out pairs (-1) land in a scratch row that is cut off, so nothing synchronises."""
    out = torch.full((total + 1, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    dest = torch.where(rows_of_pair >= 0, rows_of_pair.long(), total)
    out.index_copy_(0, dest, values)
    return out[:total]


def _received(x, moved: torch.Tensor, rows_of_pair: torch.Tensor, k: int, lead: tuple[int, ...]):
    """The received rows: moved bytes viewed back as FP8 with each row's scales gathered from its source token."""
    if not isinstance(x, QTensor):
        return moved
    source = torch.arange(rows_of_pair.numel(), device=rows_of_pair.device) // k
    scale = _scatter_rows(x.scale[source], rows_of_pair, math.prod(lead), 0.0)
    return QTensor(moved.view(torch.float8_e4m3fn), scale.view(*lead, -1), x.block, x.scale_format)


def _local_ids(ids: torch.Tensor, placement, num_experts: int) -> torch.Tensor:
    """Ids in the placement's local order (one process may reorder its experts); -1 stays -1. The received rows
    report the global ids, which travel with the pairs."""
    order = placement.local_experts[0]
    if order == tuple(range(num_experts)):
        return ids
    to_global = torch.tensor(order, dtype=torch.int32, device=ids.device)
    to_local = torch.full((num_experts + 1,), -1, dtype=torch.int32, device=ids.device)  # entry E: -1 stays -1
    to_local[to_global.long()] = torch.arange(num_experts, dtype=torch.int32, device=ids.device)
    return to_local[torch.where(ids >= 0, ids.long(), num_experts)]


def _route(npu, x, ids, *, num_experts: int, mode: str, capacity: int):
    """Runs init_routing and returns ``(moved rows [n, H], rows_of_pair [T * k] int32, counts [E] int64, lead)``."""
    tokens, k = ids.shape
    common = {
        "expert_num": num_experts,
        "expert_tokens_num_type": 1,  # per-expert counts
        "expert_tokens_num_flag": True,
        "quant_mode": -1,
        "active_expert_range": [0, num_experts],
        "row_idx_type": 0,  # gather indices: pair -> received row, -1 if left out
    }
    # The op's drop-pad mode (docs: 0 < capacity < rows); -1 ids are assumed left out there as in dropless mode
    # (README assumption 10).
    if mode == "low_latency" and 0 < capacity < tokens:
        moved, rows, counts, _ = npu.npu_moe_init_routing_v2(
            _row_bytes(x), ids, expert_capacity=capacity, drop_pad_mode=1, **common
        )
        return moved.reshape(num_experts * capacity, -1), rows, counts, (num_experts, capacity)
    moved, rows, counts, _ = npu.npu_moe_init_routing_v2(
        _row_bytes(x), ids, active_num=tokens * k, drop_pad_mode=0, **common
    )
    if mode == "normal":  # every pair's row, the skipped ones' unspecified: no host sync
        return moved, rows, counts, (tokens * k,)
    # low_latency, capacity >= T (or 0): place the expert-sorted rows into [E, capacity] on the device
    pairs = tokens * k
    row = torch.arange(pairs, device=ids.device)
    ends = torch.cumsum(counts, 0)
    sorted_expert = torch.searchsorted(ends, row, right=True).clamp(max=num_experts - 1)  # expert of sorted row
    slot = row - (ends - counts)[sorted_expert]
    kept = (row < ends[-1]) & (slot < capacity)
    scratch = num_experts * capacity
    dest = torch.where(kept, sorted_expert * capacity + slot, scratch)
    placed = torch.zeros(scratch + 1, moved.shape[1], dtype=moved.dtype, device=moved.device)
    placed.index_copy_(0, dest, moved)
    pair_dest = dest[rows.clamp_min(0).long()]
    rows = torch.where((rows >= 0) & (pair_dest < scratch), pair_dest, -1).to(torch.int32)
    return placed[:-1], rows, counts, (num_experts, capacity)


def ep_dispatch_init_routing(x, ids, weights, *, num_experts, group, mode, capacity, placement) -> tuple:
    """Local ``ep_dispatch`` through ``npu_moe_init_routing_v2``."""
    tokens, k = ids.shape
    if tokens == 0:
        return _empty_dispatch(x, ids, weights, num_experts, mode, capacity)
    local = _local_ids(ids, placement, num_experts)
    moved, rows, counts, lead = _route(
        probe.torch_npu(), x, local, num_experts=num_experts, mode=mode, capacity=capacity
    )
    n_rows = math.prod(lead)
    recv_x = _received(x, moved.reshape(*lead, moved.shape[-1]), rows, k, lead)
    recv_ids = _scatter_rows(ids.reshape(-1), rows, n_rows, -1).view(lead)  # global ids travel with the rows
    recv_w = _scatter_rows(weights.reshape(-1), rows, n_rows, 0.0).view(lead)
    lost = ((ids >= 0) & (rows.view(tokens, k) < 0)).any(dim=1)
    if mode == "normal":
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
        offsets[1:] = torch.cumsum(counts, 0).to(torch.int32)
        offsets[-1] = n_rows  # the skipped pairs' rows close the last expert's range
        layout, overflow = ExpertLayout(expert_offsets=offsets), None
    else:
        layout, overflow = ExpertLayout(masked_m=counts.clamp(max=capacity).to(torch.int32)), lost.any()
    handle = AscendHandle(
        tokens,
        mode,
        lead,
        overflow=overflow,
        pair_rows=rows.long().view(tokens, k),
        weights=weights,
        src_to_dst=rows.to(torch.int32),
        lost=lost,
        received=counts.sum() if mode == "normal" else None,
    )
    return recv_x, recv_ids, recv_w, layout, handle


def _empty_dispatch(x, ids, weights, num_experts, mode, capacity):
    """T = 0: nothing to route (the operator is not launched on empty input)."""
    k, device = ids.shape[1], ids.device
    lead = (0,) if mode == "normal" else (num_experts, capacity)
    zeros = torch.zeros(*lead, x.shape[1], device=device)
    if isinstance(x, QTensor):
        scale = torch.zeros(*lead, x.scale.shape[-1], device=device)
        recv_x = QTensor(zeros.to(torch.float8_e4m3fn), scale, x.block, x.scale_format)
    else:
        recv_x = zeros.to(x.dtype)
    if mode == "normal":
        offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
        layout, overflow = ExpertLayout(expert_offsets=offsets), None
    else:
        layout = ExpertLayout(masked_m=torch.zeros(num_experts, dtype=torch.int32, device=device))
        overflow = torch.zeros((), dtype=torch.bool, device=device)
    recv_ids = torch.full(lead, -1, dtype=torch.int32, device=device)
    recv_w = torch.zeros(lead, dtype=torch.float32, device=device)
    handle = AscendHandle(
        0,
        mode,
        lead,
        overflow=overflow,
        pair_rows=torch.zeros(0, k, dtype=torch.int64, device=device),
        weights=weights,
        src_to_dst=torch.zeros(0, dtype=torch.int32, device=device),
        lost=torch.zeros(0, dtype=torch.bool, device=device),
    )
    return recv_x, recv_ids, recv_w, layout, handle


def ep_dispatch_init_routing_supports(
    x, ids, weights, *, num_experts, group, mode, capacity, placement
) -> bool | Decline:
    dtype = x.data.dtype if isinstance(x, QTensor) else x.dtype
    if _group_size(group) != 1:
        return Decline(f"group of {_group_size(group)} ranks: one process only")
    if not (answer := probe.placed(x=x, ids=ids, weights=weights)):
        return answer
    if num_experts > 10240:
        return Decline(f"num_experts {num_experts} > 10240")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        return Decline(f"x is {dtype}, expected a float or float8_e4m3fn")
    return True


def ep_combine_finalize(y, handle) -> torch.Tensor:
    """Local ``ep_combine`` through ``npu_moe_finalize_routing`` (row-major index modes)."""
    npu = probe.torch_npu()
    tokens, hidden = handle.num_tokens, y.shape[-1]
    if tokens == 0:
        return y.new_zeros(0, hidden)
    k = handle.weights.shape[1]
    scales = handle.weights.to(y.dtype)  # the op takes scales in the dtype of the rows
    if handle.mode == "normal":
        # Dropless modes take (T * k, H) rows and no -1 (doc's value range; its example code would accept -1):
        # skipped pairs point at the last row, zeroed with the other rows past the received ones, which hold the
        # skipped pairs' unspecified rows (README assumption 11). The zeroing is a pass over y on every call, where
        # the host does not know whether any pair was skipped: untimed (no Ascend device here).
        pairs = tokens * k
        held = torch.arange(pairs, device=y.device) < handle.received
        rows = torch.where(held[:, None], y.reshape(pairs, hidden), torch.zeros((), dtype=y.dtype, device=y.device))
        src = torch.where(handle.src_to_dst >= 0, handle.src_to_dst, pairs - 1).to(torch.int32)
        return npu.npu_moe_finalize_routing(rows, None, None, None, scales, src, None, drop_pad_mode=2)
    out = npu.npu_moe_finalize_routing(y, None, None, None, scales, handle.src_to_dst, None, drop_pad_mode=3)
    return torch.where(handle.lost[:, None], torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)


def ep_combine_finalize_supports(y, handle) -> bool | Decline:
    if not isinstance(handle, AscendHandle):
        return Decline(f"handle is a {type(handle).__name__}, not this backend's one-process dispatch's")
    return probe.placed(y=y)
