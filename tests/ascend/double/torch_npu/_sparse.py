"""TEST DOUBLE of torch_npu's DeepSeek Sparse Attention operators, in plain torch on the CPU.

Implements, from their documented contracts (op-plugin docs ``torch_npu-npu_lightning_indexer.md`` and
``torch_npu-npu_sparse_flash_attention.md``; the Ascend 950 rules from the operators' READMEs in CANN's
ops-transformer, ``attention/lightning_indexer`` and ``attention/sparse_flash_attention``):
- ``npu_lightning_indexer``: ``Top-k{ sum_h W[h] * ReLU(Q[h] . K^T) }`` per query, TND query with cumulative
  ``actual_seq_lengths_query``, PA_BSND key with ``block_table`` and per-sequence ``actual_seq_lengths_key``;
  ``sparse_mode`` 0 (all positions) or 3 (rightDownCausal). Returns logical positions within each sequence.
- ``npu_sparse_flash_attention``: ``softmax(Q K~^T * scale) V~`` with ``K~, V~`` gathered by ``sparse_indices``
  (positions in the batch's KV sequence, ``sparse_block_size`` 1), MLA-absorb (nope 512 + rope 64, key and value
  the same tensor), TND query and TND key, ``return_softmax_lse`` (``softmax_max`` and ``softmax_sum``).

Where the docs are silent the double does something a caller must not rely on:
- the indexer's output order is by descending score (ties: the lower position first, as the operator's test golden
  sorts), not by position;
- the indexer's entries past the first ``min(sparse_count, visible)`` of a row are undefined: 0x7B bytes (123, a
  plausible position);
- a sparse-attention row with no valid index is undefined: NaN output, NaN softmax_max / softmax_sum;
- ``softmax_max`` is the max of the scaled scores (the doc says "the max of the query-key product").
Math is fp32 from the inputs as given (a bf16 weight is rounded already); kernel precision is not modelled.
"""

from __future__ import annotations

import itertools

import torch

from ._common import ceil_div, contiguous, dtype_in, is_950, not_emulated, poison, record, require

LI = "npu_lightning_indexer"
SFA = "npu_sparse_flash_attention"
HALF = (torch.float16, torch.bfloat16)
DEFAULT_TOKENS = 2**63 - 1
LI_HEAD_DIM = 128
LI_950_HEADS = (8, 16, 24, 32, 64)
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
SFA_NOPE, SFA_ROPE = 512, 64
SFA_POW2_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def _int32_vector(op: str, name: str, t: torch.Tensor | None, length: int | None = None) -> list[int]:
    require(t is not None, op, f"{name} must be given in this layout")
    require(isinstance(t, torch.Tensor), op, f"{name} is a tensor")
    require(t.dtype == torch.int32 and t.dim() == 1, op, f"{name} must be a 1-D int32 tensor")
    require(t.numel() > 0, op, f"{name} must not be empty")
    if length is not None:
        require(t.numel() == length, op, f"{name} must have B = {length} entries")
    return t.tolist()


def _cumulative(op: str, name: str, values: list[int], total: int) -> list[int]:
    """TND prefix sums -> per-batch lengths."""
    ends = [0, *values]
    require(all(a <= b for a, b in itertools.pairwise(ends)), op, f"{name} must be nondecreasing prefix sums")
    require(ends[-1] == total, op, f"the last entry of {name} must equal T ({total})")
    return [b - a for a, b in itertools.pairwise(ends)]


def _default_tokens(op: str, pre_tokens: int, next_tokens: int) -> None:
    require(pre_tokens == DEFAULT_TOKENS and next_tokens == DEFAULT_TOKENS, op, "pre/next_tokens take only 2^63-1")


# ---------------------------------------------------------------------------------------------------------------
# npu_lightning_indexer


def npu_lightning_indexer(
    query: torch.Tensor,
    key: torch.Tensor,
    weights: torch.Tensor,
    *,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_key: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    layout_query: str = "BSND",
    layout_key: str = "BSND",
    sparse_count: int = 2048,
    sparse_mode: int = 3,
    pre_tokens: int = DEFAULT_TOKENS,
    next_tokens: int = DEFAULT_TOKENS,
    return_value: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer (TEST DOUBLE). Returns ``(sparse_indices int32 [T1, N2, sparse_count], sparse_values)``;
    the values are undefined unless ``return_value`` (not emulated)."""
    op = LI
    require(layout_query in ("BSND", "TND"), op, f"layout_query is BSND or TND, got {layout_query!r}")
    require(layout_key in ("PA_BSND", "BSND", "TND"), op, f"layout_key is PA_BSND, BSND or TND, got {layout_key!r}")
    require(layout_key == "PA_BSND" or layout_key == layout_query, op, "without PageAttention the layouts must match")
    not_emulated(layout_query != "TND" or layout_key != "PA_BSND", op, "layouts other than TND query + PA_BSND key")
    require(not return_value, op, "return_value is supported only in training and not with layout_key PA_BSND")
    require(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    require(sparse_count in LI_SPARSE_COUNTS, op, "sparse_count must be in [1, 2048] or one of 3072..8192 by 1024")
    _default_tokens(op, pre_tokens, next_tokens)

    contiguous(query, op, "query")
    dtype_in(query, HALF, op, "query")
    require(query.numel() > 0, op, "empty tensors are not supported")
    require(query.dim() == 3, op, "a TND query is [T1, N1, D]")
    tokens, heads, head_dim = query.shape
    require(head_dim == LI_HEAD_DIM, op, f"the D of query and key must be 128, got {head_dim}")
    if is_950():
        require(heads in LI_950_HEADS, op, f"on Ascend 950 the N of query must be one of {LI_950_HEADS}, got {heads}")
    else:
        require(1 <= heads <= 64, op, f"the N of query must be at most 64, got {heads}")

    require(key.dtype == query.dtype, op, "query and key must have the same dtype")
    require(key.dim() == 4, op, "a PA_BSND key is [block_count, block_size, N2, D]")
    blocks, block_size, kv_heads, key_dim = key.shape
    require(key_dim == head_dim, op, "the D of query and key must be equal (128)")
    require(kv_heads == 1, op, "the N of key must be 1")
    require(block_size % 16 == 0 and 0 < block_size <= 1024, op, "block_size must be a multiple of 16, <= 1024")
    if is_950():  # the 950 allows axis 0 of a PA_BSND key to be non-contiguous
        contiguous(key[0], op, "key (beyond axis 0)")
    else:
        contiguous(key, op, "key")

    contiguous(weights, op, "weights")
    require(tuple(weights.shape) == (tokens, heads), op, "TND weights are [T1, N1]")
    dtype_in(weights, (*HALF, torch.float32), op, "weights")
    require(not (is_950() and weights.dtype == torch.float32), op, "on Ascend 950 weights do not take float32")
    if weights.dtype != torch.float32:
        require(weights.dtype == query.dtype, op, "weights that are not float32 must have the dtype of query")

    cum_q = _int32_vector(op, "actual_seq_lengths_query", actual_seq_lengths_query)
    lens_q = _cumulative(op, "actual_seq_lengths_query", cum_q, tokens)
    batch = len(lens_q)
    lens_k = _int32_vector(op, "actual_seq_lengths_key", actual_seq_lengths_key, batch)
    require(all(n >= 0 for n in lens_k), op, "actual_seq_lengths_key must be non-negative")
    require(block_table is not None, op, "PageAttention needs block_table")
    require(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table must be 2-D int32")
    contiguous(block_table, op, "block_table")
    require(block_table.shape[0] == batch, op, "block_table's first dim must equal B")
    need = ceil_div(max(lens_k), block_size)
    require(block_table.shape[1] >= need, op, "block_table's second dim is below maxBlockNumPerSeq")
    record(
        op,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
        heads=heads,
        block_size=block_size,
        key_blocks=blocks,
        key_dtype=key.dtype,
        weights_dtype=weights.dtype,
        seq_lens_q=lens_q,
        seq_lens_k=lens_k,
    )

    flat = key.reshape(-1, head_dim)
    out = poison(torch.empty(tokens, 1, sparse_count, dtype=torch.int32))
    start = 0
    for b, (length, n) in enumerate(zip(lens_q, lens_k)):
        rows = slice(start, start + length)
        start += length
        if length == 0 or n == 0:
            continue
        pos = torch.arange(n)
        pages = block_table[b, pos // block_size].long()
        require(bool(((pages >= 0) & (pages < blocks)).all()), op, "block_table holds a page outside the cache")
        k = flat[pages * block_size + pos % block_size].float()  # [n, D]
        step = max(1, (1 << 24) // (heads * n))  # queries scored at once
        for s in range(0, length, step):
            e = min(length, s + step)
            q_rows = slice(rows.start + s, rows.start + e)
            relu = torch.einsum("lhd,nd->lhn", query[q_rows].float(), k).clamp_min(0.0)
            scores = torch.einsum("lhn,lh->ln", relu, weights[q_rows].float())
            if sparse_mode == 3:  # rightDownCausal: query i sees j <= n - L + i
                limit = n - length + torch.arange(s, e)[:, None]
                scores = scores.masked_fill(pos[None, :] > limit, float("-inf"))
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # by score; ties: lower first
            visible = (scores > float("-inf")).sum(dim=-1)
            for i in range(e - s):
                keep = min(sparse_count, int(visible[i]))
                out[q_rows.start + i, 0, :keep] = order[i, :keep].to(torch.int32)
    values = poison(torch.empty(tokens, 1, sparse_count, dtype=query.dtype))
    return out, values


# ---------------------------------------------------------------------------------------------------------------
# npu_sparse_flash_attention


def npu_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    *,
    block_table: torch.Tensor | None = None,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_kv: torch.Tensor | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = DEFAULT_TOKENS,
    next_tokens: int = DEFAULT_TOKENS,
    attention_mode: int = 0,
    return_softmax_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA-absorb attention (TEST DOUBLE). Returns ``(attention_out [T1, N1, 512], softmax_max,
    softmax_sum)``, the last two ``[KV_N, T1, N1]`` fp32 when ``return_softmax_lse``, undefined otherwise."""
    op = SFA
    require(attention_mode == 2, op, "attention_mode supports only 2 (MLA-absorb)")
    require(query_rope is not None and key_rope is not None, op, "query_rope and key_rope are required")
    require(layout_query in ("BSND", "TND"), op, f"layout_query is BSND or TND, got {layout_query!r}")
    require(layout_kv in ("PA_BSND", "BSND", "TND"), op, f"layout_kv is PA_BSND, BSND or TND, got {layout_kv!r}")
    require(layout_kv == "PA_BSND" or layout_kv == layout_query, op, "without PageAttention the layouts must match")
    not_emulated(layout_query != "TND" or layout_kv != "TND", op, "layouts other than TND query + TND key")
    require(sparse_mode in (0, 3), op, f"sparse_mode must be 0 or 3, got {sparse_mode}")
    _default_tokens(op, pre_tokens, next_tokens)
    if is_950():
        require(sparse_block_size == 1, op, "on Ascend 950 sparse_block_size supports only 1")
    else:
        require(sparse_block_size in (1, 2, 4, 8, 16, 32, 64, 128), op, "sparse_block_size is a power of 2 <= 128")
        require(sinks is None, op, "sinks are supported only on Ascend 950")
    not_emulated(sparse_block_size != 1, op, "sparse_block_size > 1")
    not_emulated(sinks is not None, op, "sinks")
    require(block_table is None, op, "block_table is for PageAttention (layout_kv PA_BSND)")

    for name, t in (("query", query), ("query_rope", query_rope), ("sparse_indices", sparse_indices)):
        contiguous(t, op, name)
    for name, t in (("key", key), ("value", value), ("key_rope", key_rope)):
        contiguous(t, op, name)  # non-contiguous only on a 950 and only axis 0 of PA_BSND
    dtype_in(query, HALF, op, "query")
    require(query.numel() > 0 and key.numel() > 0, op, "empty tensors are not supported")
    require(key.dtype == query.dtype and value.dtype == query.dtype, op, "query, key and value share a dtype")
    require(query_rope.dtype == query.dtype and key_rope.dtype == query.dtype, op, "rope inputs take query's dtype")
    require(query.dim() == 3, op, "a TND query is [T1, N1, D]")
    tokens, heads, d = query.shape
    require(d == SFA_NOPE, op, f"the D of query, key and value must be 512, got {d}")
    require(tuple(query_rope.shape) == (tokens, heads, SFA_ROPE), op, "query_rope must be [T1, N1, 64]")
    if is_950():
        require(1 <= heads <= 128, op, f"on Ascend 950 Q_N supports 1..128, got {heads}")
    else:
        require(heads in SFA_POW2_HEADS, op, f"Q_N must be one of {SFA_POW2_HEADS}, got {heads}")
    require(key.dim() == 3 and key.shape[1:] == (1, SFA_NOPE), op, "a TND key is [T2, KV_N = 1, 512]")
    require(tuple(value.shape) == tuple(key.shape), op, "value must have the shape of key")
    require(
        value.data_ptr() == key.data_ptr() or torch.equal(value, key),
        op,
        "in MLA-absorb mode key and value share the same data",
    )
    kv_tokens = key.shape[0]
    require(tuple(key_rope.shape) == (kv_tokens, 1, SFA_ROPE), op, "key_rope must be [T2, 1, 64]")
    require(sparse_indices.dtype == torch.int32, op, "sparse_indices must be int32")
    require(
        sparse_indices.dim() == 3 and tuple(sparse_indices.shape[:2]) == (tokens, 1) and sparse_indices.shape[2] > 0,
        op,
        "TND sparse_indices must be [T1, KV_N, sparse_size] with sparse_size > 0",
    )
    valid = sparse_indices >= 0
    require(bool((valid[..., 1:] <= valid[..., :-1]).all()), op, "valid sparse_indices must come before invalid ones")

    lens_q = _cumulative(
        op, "actual_seq_lengths_query", _int32_vector(op, "actual_seq_lengths_query", actual_seq_lengths_query), tokens
    )
    cum_kv = _int32_vector(op, "actual_seq_lengths_kv", actual_seq_lengths_kv, len(lens_q))
    lens_kv = _cumulative(op, "actual_seq_lengths_kv", cum_kv, kv_tokens)
    record(
        op,
        layout_query=layout_query,
        layout_kv=layout_kv,
        sparse_mode=sparse_mode,
        heads=heads,
        batch=len(lens_q),
        kv_tokens=kv_tokens,
        topk=sparse_indices.shape[2],
        lse=return_softmax_lse,
        dtype=query.dtype,
    )

    q = torch.cat([query.float(), query_rope.float()], dim=-1)  # [T1, N1, 576]
    k = torch.cat([key[:, 0].float(), key_rope[:, 0].float()], dim=-1)  # [T2, 576]
    v = value[:, 0].float()
    out = torch.empty(tokens, heads, SFA_NOPE, dtype=torch.float32)
    smax = torch.empty(1, tokens, heads, dtype=torch.float32)
    ssum = torch.empty(1, tokens, heads, dtype=torch.float32)
    q_start = kv_start = 0
    for lq, lkv in zip(lens_q, lens_kv):
        for i in range(lq):
            t = q_start + i
            idx = sparse_indices[t, 0]
            idx = idx[idx >= 0].long()
            require(bool((idx < lkv).all()), op, "sparse_indices must lie inside the batch's KV sequence")
            if sparse_mode == 3:
                idx = idx[idx <= lkv - lq + i]
            if idx.numel() == 0:  # nothing to attend: undefined
                out[t], smax[0, t], ssum[0, t] = float("nan"), float("nan"), float("nan")
                continue
            kk, vv = k[kv_start + idx], v[kv_start + idx]  # a repeated index is gathered twice
            scores = q[t] @ kk.T * scale_value  # [N1, n]
            m = scores.amax(dim=-1)
            e = torch.exp(scores - m[:, None])
            s = e.sum(dim=-1)
            out[t], smax[0, t], ssum[0, t] = (e / s[:, None]) @ vv, m, s
        q_start += lq
        kv_start += lkv
    if not return_softmax_lse:
        smax, ssum = poison(smax), poison(ssum)
    return out.to(query.dtype), smax, ssum
