"""TEST DOUBLE of torch_npu's MoE routing operators, in plain torch on the CPU.

- ``npu_moe_gating_top_k``: follows the doc's "equivalent computation logic" (norm_type 0 softmax, 1 sigmoid and
  renormalise; group score = max (mode 0) or top-2 sum (mode 1); stable ordering), not the English doc's parameter
  table, which swaps the meaning of norm_type (the Chinese doc's table agrees with the logic).
- ``npu_moe_init_routing_v2``: stable sort of the (token, k) pairs by expert; ids outside the active expert range
  are left out; dropless (``drop_pad_mode`` 0) or padded to ``expert_capacity`` per expert (1).
- ``npu_moe_finalize_routing``: ``out[i] = skip1 + skip2 + sum_k scales[i, k] * (rows[src_to_dst[.]] + bias)``;
  -1 in drop-pad modes contributes nothing.
"""

from __future__ import annotations

import torch

from ._common import dtype_in, not_emulated, poison, record, require

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INT32_MAX = 2**31 - 1


def npu_moe_gating_top_k(
    x: torch.Tensor,
    k: int,
    *,
    bias: torch.Tensor | None = None,
    k_group: int = 1,
    group_count: int = 1,
    group_select_mode: int = 0,
    renorm: int = 0,
    norm_type: int = 0,
    out_flag: bool = False,
    routed_scaling_factor: float = 1.0,
    eps: float = 1e-20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-limited top-k router (TEST DOUBLE). Returns ``(y, expert_idx int32, norm_out or None)``."""
    op = "npu_moe_gating_top_k"
    dtype_in(x, FLOATS, op, "x")
    require(x.dim() == 2, op, "x must be 2-D")
    require(x.shape[0] > 0, op, "empty x is not documented; the double rejects it")
    tokens, experts = x.shape
    require(experts <= 2048, op, "the expert count must be <= 2048")
    if bias is not None:
        require(
            bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype,
            op,
            "bias must be 1-D with the expert count and the dtype of x",
        )
    require(group_count > 0 and experts % group_count == 0, op, "group_count must divide the expert count")
    per_group = experts // group_count
    require(per_group > 2, op, "experts per group must be greater than 2")
    require(
        -(-per_group // 32) * 32 * group_count <= 2048, op, "align32(E / group_count) * group_count must be <= 2048"
    )
    require(1 <= k_group <= group_count, op, "1 <= k_group <= group_count")
    require(1 <= k <= per_group * k_group, op, "1 <= k <= E / group_count * k_group")
    require(renorm == 0, op, "renorm supports only 0")
    require(norm_type in (0, 1) and group_select_mode in (0, 1), op, "norm_type and group_select_mode are 0 or 1")
    record(op, norm_type=norm_type, group_select_mode=group_select_mode, group_count=group_count, k=k)
    xf = x.float()
    scores = torch.softmax(xf, dim=-1) if norm_type == 0 else torch.sigmoid(xf)
    choose = scores if bias is None else scores + bias.float()
    if group_count > 1:
        grouped = choose.view(tokens, group_count, per_group)
        if group_select_mode == 0:
            group_score = grouped.amax(dim=-1)
        else:
            group_score = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
        keep = torch.argsort(-group_score, dim=-1, stable=True)[:, :k_group]
        mask = torch.ones(tokens, group_count, dtype=torch.bool).scatter_(1, keep, False)
        choose = grouped.masked_fill(mask[..., None], float("-inf")).view(tokens, experts)
    idx = torch.argsort(-choose, dim=-1, stable=True)[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), (scores if out_flag else None)


def npu_moe_init_routing_v2(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    active_num: int = -1,
    expert_capacity: int = -1,
    expert_num: int = -1,
    drop_pad_mode: int = 0,
    expert_tokens_num_type: int = 0,
    expert_tokens_num_flag: bool = False,
    quant_mode: int = -1,
    active_expert_range: list[int] | None = None,
    row_idx_type: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Permutes tokens by expert (TEST DOUBLE). Returns ``(expanded_x, expanded_row_idx int32,
    expert_token_cumsum_or_count int64, expanded_scale)``. Rows of ``expanded_x`` past the valid count are
    uninitialised in the docs and come back poisoned."""
    op = "npu_moe_init_routing_v2"
    not_emulated(quant_mode != -1, op, "quant_mode 0/1 (quantising inside the routing)")
    not_emulated(scale is not None or offset is not None, op, "scale/offset in the non-quantised mode")
    dtype_in(x, (*FLOATS, torch.int8), op, "x")
    require(x.dim() == 2 and expert_idx.dim() == 2, op, "x and expert_idx must be 2-D")
    require(expert_idx.dtype == torch.int32, op, "expert_idx must be int32")
    rows, k = expert_idx.shape
    require(x.shape[0] == rows, op, "x and expert_idx must have the same number of rows")
    require(0 <= expert_num <= 10240, op, "expert_num must be in [0, 10240]")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    require(0 <= start < end <= expert_num, op, "active_expert_range must satisfy 0 <= start < end <= expert_num")
    require(drop_pad_mode in (0, 1) and row_idx_type in (0, 1), op, "drop_pad_mode and row_idx_type are 0 or 1")
    require(expert_tokens_num_type in (0, 1, 2), op, "expert_tokens_num_type is 0, 1 or 2")
    not_emulated(expert_tokens_num_type == 2, op, "key_value token counts")
    if drop_pad_mode == 1:
        require(0 < expert_capacity < rows, op, "expert_capacity must be > 0 and < NUM_ROWS")
        require(row_idx_type == 0, op, "drop-pad mode uses gather indices (row_idx_type 0)")
        require(expert_tokens_num_type == 1, op, "drop-pad mode reports counts (expert_tokens_num_type 1)")
        require((start, end) == (0, expert_num), op, "drop-pad mode needs the full expert range")
    else:
        require(active_num >= -1, op, "active_num must be -1 or >= 0")
    record(op, drop_pad_mode=drop_pad_mode, row_idx_type=row_idx_type, dtype=x.dtype, rows=rows, k=k)
    flat = expert_idx.reshape(-1).long()
    in_range = (flat >= start) & (flat < end)
    keys = torch.where(in_range, flat, torch.full_like(flat, INT32_MAX))
    order = torch.sort(keys, stable=True).indices  # scatter indices: sorted row -> (token, k) pair
    available = int(in_range.sum())
    counts = torch.bincount(flat[in_range] - start, minlength=end - start).to(torch.int64)
    if expert_tokens_num_flag:
        tokens_out = counts if expert_tokens_num_type == 1 or drop_pad_mode == 1 else counts.cumsum(0)
    else:
        tokens_out = None
    if drop_pad_mode == 0:
        n_out = rows * k if active_num in (-1, 0) else min(active_num, rows * k)
        expanded = poison(torch.empty(n_out, x.shape[1], dtype=x.dtype))
        used = order[: min(available, n_out)]
        expanded[: used.numel()] = x[used // k]
        if row_idx_type == 1:
            row_idx = poison(torch.empty(rows * k, dtype=torch.int32))
            row_idx[:available] = order[:available].to(torch.int32)
        else:
            row_idx = torch.full((rows * k,), -1, dtype=torch.int32)
            row_idx[order[:available]] = torch.arange(available, dtype=torch.int32)
        return expanded, row_idx, tokens_out, None
    # drop-pad: expert e owns rows [e * C, (e + 1) * C) in order of arrival; the rest are dropped.
    cap = expert_capacity
    expanded = torch.zeros(expert_num * cap, x.shape[1], dtype=x.dtype)
    row_idx = torch.full((rows * k,), -1, dtype=torch.int32)
    sorted_ids = flat[order[:available]]
    first = torch.searchsorted(sorted_ids, sorted_ids, right=False)
    slot = torch.arange(available) - first
    keep = slot < cap
    dest = sorted_ids[keep] * cap + slot[keep]
    row_idx[order[:available][keep]] = dest.to(torch.int32)
    expanded[dest] = x[order[:available][keep] // k]
    return expanded.view(expert_num, cap, x.shape[1]), row_idx, tokens_out, None


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    expert_for_source_row: torch.Tensor | None,
    drop_pad_mode: int = 0,
) -> torch.Tensor:
    """Weighted combine of expert outputs back to token rows (TEST DOUBLE). Modes: 0/1 column-major
    ``src_to_dst[k * NUM_ROWS + i]``, 2/3 row-major ``src_to_dst[i * K + k]``; 1/3 take ``(E, C, H)`` rows and -1."""
    op = "npu_moe_finalize_routing"
    rows = expanded_permuted_rows
    dtype_in(rows, FLOATS, op, "expanded_permuted_rows")
    require(drop_pad_mode in (0, 1, 2, 3), op, "drop_pad_mode must be 0, 1, 2 or 3")
    pad = drop_pad_mode in (1, 3)
    require(rows.dim() == (3 if pad else 2), op, "rows are (NUM_ROWS * K, H), or (E, C, H) in drop-pad modes")
    require(
        expanded_src_to_dst_row.dtype == torch.int32 and expanded_src_to_dst_row.dim() == 1,
        op,
        "expanded_src_to_dst_row must be 1-D int32",
    )
    nk = expanded_src_to_dst_row.shape[0]
    if scales is not None:
        require(scales.dtype == rows.dtype, op, "scales must have the dtype of expanded_permuted_rows")
        require(scales.dim() == 2, op, "scales must be (NUM_ROWS, K)")
        num_rows, k = scales.shape
    else:
        num_rows, k = nk, 1
    require(num_rows * k == nk, op, "expanded_src_to_dst_row must have NUM_ROWS * K entries")
    hidden = rows.shape[-1]
    flat = rows.reshape(-1, hidden)
    if not pad:
        require(flat.shape[0] == nk, op, "in dropless modes the rows must be (NUM_ROWS * K, H)")
    low = -1 if pad else 0
    idx = expanded_src_to_dst_row.long()
    require(
        bool(((idx >= low) & (idx < flat.shape[0])).all()),
        op,
        f"expanded_src_to_dst_row values must lie in [{low}, {flat.shape[0] - 1}]",
    )
    require(skip2 is None or skip1 is not None, op, "skip2 needs skip1")
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        if t is not None:
            require(t.dtype == rows.dtype and tuple(t.shape) == (num_rows, hidden), op, f"{name} must be (NUM_ROWS, H)")
    if bias is not None:
        require(expert_for_source_row is not None, op, "bias needs expert_for_source_row")
    record(op, drop_pad_mode=drop_pad_mode, rows_shape=tuple(rows.shape), dtype=rows.dtype)
    per_pair = idx.view(k, num_rows).T if drop_pad_mode in (0, 1) else idx.view(num_rows, k)
    out = torch.zeros(num_rows, hidden, dtype=torch.float32)
    if skip1 is not None:
        out += skip1.float()
    if skip2 is not None:
        out += skip2.float()
    for j in range(k):
        src = per_pair[:, j]
        row = torch.where((src >= 0)[:, None], flat[src.clamp_min(0)].float(), 0.0)  # -1: a zero row
        if bias is not None:
            row = row + bias[expert_for_source_row[:, j].long()].float()
        out += row * (scales[:, j : j + 1].float() if scales is not None else 1.0)
    return out.to(rows.dtype)
