"""TEST DOUBLE of torch_npu's attention operators, in plain torch on the CPU.

Implements, from their documented contracts (op-plugin docs, ``docs/en/custom_APIs/torch_npu``):
- ``npu_fused_infer_attention_score_v2``: the layouts the double emulates are ``BSND`` with page attention and
  separate rope inputs (MLA, query D 512) and ``TND`` without page attention (prefill, D 128/128, 192/128, 64/64).
- ``npu_kv_quant_sparse_flash_attention``: MLA-absorb sparse attention over a paged cache whose 656-byte records
  are ``nope | rope | scales`` with per-tile (128) scales.
Math is fp32; kernel precision is not modelled (the double checks wiring, layouts and values, not speed or rounding).
"""

from __future__ import annotations

import itertools

import torch

from ._common import ceil_div, contiguous, dtype_in, is_950, not_emulated, poison, record, require

FIA = "npu_fused_infer_attention_score_v2"
HALF = (torch.float16, torch.bfloat16)
MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MASK_SIZE = 2048
KVQ_SFA_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)  # the quantised sparse operator's documented Q_N (48 too)


def _check_optimized_mask(op: str, mask: torch.Tensor | None) -> None:
    """sparse_mode 2/3/4 take the optimised (2048, 2048) mask: 1 above the diagonal (masked), 0 elsewhere."""
    require(mask is not None, op, "sparse_mode 2/3/4 need the optimised atten_mask of shape (2048, 2048)")
    require(
        tuple(mask.shape) in ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE)),
        op,
        f"the optimised atten_mask must be (2048, 2048), (1, 2048, 2048) or (1, 1, 2048, 2048), got {list(mask.shape)}",
    )
    dtype_in(mask, (torch.bool, torch.int8, torch.uint8), op, "atten_mask")
    contiguous(mask, op, "atten_mask")
    expected = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=mask.device), diagonal=1)
    require(
        torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), expected),
        op,
        "the optimised causal atten_mask must mask exactly the strict upper triangle",
    )


def _visible(sparse_mode: int, s_q: int, s_kv: int) -> torch.Tensor:
    """[s_q, s_kv] bool: 0 = no mask, 3 = rightDownCausal (query i sees keys j <= i + s_kv - s_q)."""
    if sparse_mode == 0:
        return torch.ones(s_q, s_kv, dtype=torch.bool)
    i = torch.arange(s_q)[:, None]
    j = torch.arange(s_kv)[None, :]
    return j <= i + (s_kv - s_q)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [S, N, D], k [L, N, D], v [L, N, Dv], visible [S, L] -> out [S, N, Dv], lse [S, N]; rows that see no key
    are undefined in the docs and come back NaN."""
    scores = torch.einsum("snd,lnd->nsl", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nsl,lnd->snd", torch.softmax(scores, dim=-1), v)
    dead = ~visible.any(dim=-1)  # [S]
    out[dead] = float("nan")
    lse[:, dead] = float("nan")
    return out, lse.transpose(0, 1)


def npu_fused_infer_attention_score_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    pse_shift=None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    dequant_scale_query=None,
    dequant_scale_key=None,
    dequant_offset_key=None,
    dequant_scale_value=None,
    dequant_offset_value=None,
    dequant_scale_key_rope=None,
    quant_scale_out=None,
    quant_offset_out=None,
    quant_scale_p=None,
    learnable_sink=None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    value_quant_mode: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    **reserved,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused prefill/decode attention (TEST DOUBLE). Returns ``(attention_out, softmax_lse)``; lse is
    ``(B, Q_N, Q_S, 1)`` for standard layouts, ``(T, Q_N, 1)`` for TND, and a ``[1]`` zero tensor when not asked."""
    op = FIA
    unused = {
        "pse_shift": pse_shift,
        "dequant_scale_query": dequant_scale_query,
        "dequant_scale_key": dequant_scale_key,
        "dequant_offset_key": dequant_offset_key,
        "dequant_scale_value": dequant_scale_value,
        "dequant_offset_value": dequant_offset_value,
        "dequant_scale_key_rope": dequant_scale_key_rope,
        "quant_scale_out": quant_scale_out,
        "quant_offset_out": quant_offset_out,
        "quant_scale_p": quant_scale_p,
        "learnable_sink": learnable_sink,
        **{k: v for k, v in reserved.items() if v is not None},
    }
    for name, val in unused.items():
        not_emulated(val is not None, op, f"argument {name}")
    not_emulated(input_layout not in ("BSND", "TND"), op, f"input_layout {input_layout!r}")
    not_emulated(sparse_mode not in (0, 3), op, f"sparse_mode {sparse_mode}")
    for name, t in (("query", query), ("key", key), ("value", value), ("query_rope", query_rope)):
        contiguous(t, op, name)
    contiguous(key_rope, op, "key_rope")
    dtype_in(query, HALF, op, "query")
    dtype_in(key, (*HALF, torch.int8), op, "key")
    dtype_in(value, (*HALF, torch.int8), op, "value")
    require((query_rope is None) == (key_rope is None), op, "query_rope and key_rope must be given together")
    require(sparse_mode in (0, 1, 2, 3, 4, 9), op, f"sparse_mode {sparse_mode} is not one of 0, 1, 2, 3, 4, 9")
    if sparse_mode == 0:
        require(atten_mask is None or input_layout != "TND", op, "sparse_mode 0 in TND takes no atten_mask")
    else:
        _check_optimized_mask(op, atten_mask)
    require(
        num_key_value_heads == 0 or num_query_heads % num_key_value_heads == 0,
        op,
        "num_query_heads must be divisible by num_key_value_heads",
    )
    kv_heads = num_key_value_heads or num_query_heads
    require(num_query_heads // kv_heads <= 64, op, "num_query_heads / num_key_value_heads must not exceed 64")
    if query_rope is not None:
        out, lse = _mla_paged(
            query,
            key,
            value,
            query_rope,
            key_rope,
            actual_seq_qlen,
            actual_seq_kvlen,
            block_table,
            num_query_heads,
            kv_heads,
            softmax_scale,
            input_layout,
            sparse_mode,
            block_size,
        )
    else:
        out, lse = _tnd(
            query,
            key,
            value,
            actual_seq_qlen,
            actual_seq_kvlen,
            block_table,
            num_query_heads,
            kv_heads,
            softmax_scale,
            input_layout,
            sparse_mode,
            inner_precise,
        )
    if not return_softmax_lse:
        lse = torch.zeros(1, dtype=torch.float32)
    return out, lse


def _mla_paged(q, key, value, q_rope, k_rope, seq_q, seq_kv, block_table, n_q, n_kv, scale, layout, sparse, bsize):
    op = FIA
    require(q.numel() > 0, op, "empty tensors are not supported in the MLA scenario")
    require(q.dtype == q_rope.dtype, op, "query_rope must have the dtype of query")
    require(key.dtype == k_rope.dtype, op, "key_rope must have the dtype of key")
    require(q.shape[-1] in (512, 128), op, f"with query_rope the D of query must be 512 or 128, got {q.shape[-1]}")
    not_emulated(q.shape[-1] != 512, op, "MLA with query D 128")
    not_emulated(layout != "BSND", op, f"MLA with input_layout {layout!r}")
    require(sparse in (0, 3, 4, 9), op, "MLA with query D 512 takes sparse_mode 0, 3, 4 or 9")
    batch, s_q, heads, _ = q.shape
    require(heads == n_q, op, f"num_query_heads {n_q} must equal the N axis of query ({heads})")
    require(heads in MLA_HEADS, op, f"the N of query must be one of {MLA_HEADS} in MLA, got {heads}")
    require(tuple(q_rope.shape) == (batch, s_q, heads, 64), op, "query_rope must be query's shape with D 64")
    not_emulated(block_table is None, op, "MLA without page attention")
    require(block_table.dtype == torch.int32 and block_table.dim() == 2, op, "block_table must be 2-D int32")
    require(block_table.shape[0] == batch, op, "block_table's first dim must equal B")
    require(bsize > 0 and bsize % 16 == 0 and bsize <= 1024, op, "MLA block_size must be a multiple of 16, <= 1024")
    # BSND query with page attention: the KV cache is (blocknum, blocksize, H) with H = KV_N * D.
    require(key.dim() == 3, op, "with a BSND query the paged KV cache must be (blocknum, blocksize, H)")
    require(key.shape[1] == bsize, op, f"block_size {bsize} must equal the cache's blocksize {key.shape[1]}")
    require(n_kv == 1 and key.shape[2] == 512, op, "MLA key must have N 1 and D 512")
    require(tuple(value.shape) == tuple(key.shape), op, "key and value must have identical shapes")
    require(tuple(k_rope.shape) == (*key.shape[:2], 64), op, "key_rope must be key's shape with D 64")
    require(seq_kv is not None, op, "page attention needs actual_seq_kvlen")
    kv_lens = list(seq_kv)
    require(len(kv_lens) in (1,) or len(kv_lens) >= batch, op, "actual_seq_kvlen needs 1 or at least B entries")
    kv_lens = kv_lens * batch if len(kv_lens) == 1 else kv_lens[:batch]
    q_lens = [s_q] * batch if seq_q is None else list(seq_q)[:batch]
    require(all(0 <= n <= s_q for n in q_lens), op, "actual_seq_qlen must not exceed Q_S")
    need = ceil_div(max(kv_lens, default=0), bsize)
    require(block_table.shape[1] >= need, op, "block_table's second dim is below maxBlockNumPerSeq")
    require(all(n >= 0 for n in kv_lens), op, "actual_seq_kvlen must be non-negative")
    record(
        FIA,
        layout=layout,
        mla=True,
        sparse_mode=sparse,
        block_size=bsize,
        q_shape=tuple(q.shape),
        key_shape=tuple(key.shape),
        kv_lens=kv_lens,
        dtype=q.dtype,
    )
    out = torch.empty(batch, s_q, heads, 512, dtype=torch.float32)
    lse = torch.empty(batch, s_q, heads, dtype=torch.float32)
    for b in range(batch):
        n = kv_lens[b]
        pos = torch.arange(n)
        pages = block_table[b, pos // bsize].long()
        require(bool(((pages >= 0) & (pages < key.shape[0])).all()), op, "block_table holds a page outside the cache")
        k_b = torch.cat([key[pages, pos % bsize].float(), k_rope[pages, pos % bsize].float()], dim=-1)
        v_b = value[pages, pos % bsize].float()
        q_b = torch.cat([q[b].float(), q_rope[b].float()], dim=-1)
        visible = _visible(sparse, q_lens[b], n)
        visible = torch.cat([visible, torch.zeros(s_q - q_lens[b], n, dtype=torch.bool)])
        out[b], lse[b] = _attend(q_b, k_b[:, None], v_b[:, None], visible, scale)
    return out.to(q.dtype), lse.permute(0, 2, 1).unsqueeze(-1).contiguous()


def _tnd(q, k, v, seq_q, seq_kv, block_table, n_q, n_kv, scale, layout, sparse, inner_precise):
    op = FIA
    not_emulated(block_table is not None, op, "TND with page attention")
    not_emulated(layout != "TND", op, f"input_layout {layout!r} without rope")
    require(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, op, "TND tensors are (T, N, D)")
    require(q.shape[1] == n_q and k.shape[1] == n_kv and v.shape[1] == n_kv, op, "head counts must match the N axes")
    require(q.dtype == k.dtype == v.dtype, op, "query, key and value must share a dtype")
    require(seq_q is not None and seq_kv is not None, op, "TND needs actual_seq_qlen and actual_seq_kvlen")
    cq, ck = [0, *seq_q], [0, *seq_kv]
    require(len(seq_q) == len(seq_kv) and 0 < len(seq_q) <= 4096, op, "TND batch (entries) must be 1..4096")
    require(all(a <= b for a, b in itertools.pairwise(cq)), op, "actual_seq_qlen must be cumulative")
    require(all(a <= b for a, b in itertools.pairwise(ck)), op, "actual_seq_kvlen must be cumulative")
    require(cq[-1] == q.shape[0] and ck[-1] == k.shape[0], op, "the last cumulative length must equal T")
    dq, dv = q.shape[2], v.shape[2]
    require(k.shape[2] == dq, op, "query and key must have the same D")
    mha = n_q == n_kv
    allowed = {(128, 128), (192, 128)} | ({(64, 64)} if mha else set())
    require((dq, dv) in allowed, op, f"TND without rope supports (Q_D, V_D) in {sorted(allowed)}, got {(dq, dv)}")
    if q.dtype == torch.bfloat16:
        require(inner_precise == 0, op, "bf16 in TND takes inner_precise 0 only")
    record(FIA, layout="TND", mla=False, sparse_mode=sparse, q_shape=tuple(q.shape), dims=(dq, dv), dtype=q.dtype)
    out = torch.empty(q.shape[0], n_q, dv, dtype=torch.float32)
    lse = torch.empty(q.shape[0], n_q, dtype=torch.float32)
    group = n_q // n_kv
    for b in range(len(seq_q)):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        s_q, s_kv = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if s_q == 0:
            continue
        kk = k[ks].float().repeat_interleave(group, dim=1)
        vv = v[ks].float().repeat_interleave(group, dim=1)
        out[qs], lse[qs] = _attend(q[qs].float(), kk, vv, _visible(sparse, s_q, s_kv), scale)
    return out.to(q.dtype), lse.unsqueeze(-1)


KVQ_SFA = "npu_kv_quant_sparse_flash_attention"
NOPE, ROPE, TILE = 512, 64, 128
RECORD_BYTES = NOPE + 2 * ROPE + 4 * (NOPE // TILE)  # 656: nope | rope (bf16) | 4 fp32 scales


def npu_kv_quant_sparse_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sparse_indices: torch.Tensor,
    scale_value: float,
    key_quant_mode: int,
    value_quant_mode: int,
    *,
    key_dequant_scale=None,
    value_dequant_scale=None,
    block_table: torch.Tensor | None = None,
    actual_seq_lengths_query: torch.Tensor | None = None,
    actual_seq_lengths_kv: torch.Tensor | None = None,
    sparse_block_size: int = 1,
    layout_query: str = "BSND",
    layout_kv: str = "BSND",
    sparse_mode: int = 3,
    pre_tokens: int = 2**63 - 1,
    next_tokens: int = 2**63 - 1,
    attention_mode: int = 0,
    quant_scale_repo_mode: int = 1,
    tile_size: int = 128,
    rope_head_dim: int = 64,
    key_dtype=None,
    value_dtype=None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA-absorb attention over per-tile quantised 656-byte KV records (TEST DOUBLE).

    Record byte order (docs: "concatenating k_nope, k_rope and float32 quantization parameters"): 512 quantised
    nope values | 64 rope values in query's dtype | 4 fp32 scales. ``sparse_indices`` are token positions of each
    sequence (``sparse_block_size`` 1), valid entries first, then -1. Returns ``[B, S1, N, 512]``.
    """
    op = KVQ_SFA
    not_emulated(key_dtype is not None or value_dtype is not None, op, "hifloat8 keys and values (key/value_dtype)")
    not_emulated(sinks is not None, op, "sinks")
    require(key_quant_mode == 2 and value_quant_mode == 2, op, "key/value_quant_mode must be 2 (per_tile)")
    require(attention_mode == 2, op, "attention_mode must be 2 (MLA-absorb)")
    require(quant_scale_repo_mode == 1, op, "quant_scale_repo_mode must be 1 (combine)")
    require(tile_size == TILE and rope_head_dim == ROPE, op, "tile_size must be 128 and rope_head_dim 64")
    require(key_dequant_scale is None and value_dequant_scale is None, op, "key/value_dequant_scale are reserved")
    require(pre_tokens == 2**63 - 1 and next_tokens == 2**63 - 1, op, "pre/next_tokens take only their default")
    require(sparse_mode in (0, 3), op, "sparse_mode must be 0 or 3")
    not_emulated(layout_query != "BSND" or layout_kv != "PA_BSND", op, "layouts other than BSND + PA_BSND")
    not_emulated(sparse_block_size != 1, op, "sparse_block_size > 1")
    for name, t in (("query", query), ("key", key), ("value", value), ("sparse_indices", sparse_indices)):
        contiguous(t, op, name)
    dtype_in(query, HALF, op, "query")
    key_types = (torch.int8, torch.float8_e4m3fn) if is_950() else (torch.int8,)
    dtype_in(key, key_types, op, "key")
    require(
        value.data_ptr() == key.data_ptr() or torch.equal(value.view(torch.int8), key.view(torch.int8)),
        op,
        "in MLA-absorb mode key and value share the same data",
    )
    batch, s1, heads, d = query.shape
    require(d == NOPE + ROPE, op, f"the D of query must be 576 (512 + 64), got {d}")
    require(heads in KVQ_SFA_HEADS, op, f"Q_N must be one of {KVQ_SFA_HEADS}")
    require(
        key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == RECORD_BYTES,
        op,
        "PA_BSND key must be [block_num, block_size, 1, 656]",
    )
    block_size = key.shape[1]
    require(block_size % 16 == 0 and block_size <= 1024, op, "block_size must be a multiple of 16 and <= 1024")
    require(block_size % sparse_block_size == 0, op, "sparse_block_size must divide block_size")
    require(sparse_indices.dtype == torch.int32, op, "sparse_indices must be int32")
    require(
        sparse_indices.dim() == 4 and tuple(sparse_indices.shape[:3]) == (batch, s1, 1),
        op,
        "BSND sparse_indices must be [B, S1, KV_N, sparse_size]",
    )
    require(block_table is not None and block_table.dtype == torch.int32, op, "PA_BSND needs an int32 block_table")
    require(actual_seq_lengths_kv is not None, op, "PA_BSND needs actual_seq_lengths_kv")
    require(
        actual_seq_lengths_kv.dtype == torch.int32 and actual_seq_lengths_kv.shape == (batch,),
        op,
        "actual_seq_lengths_kv must be an int32 tensor of length B",
    )
    kv_lens = actual_seq_lengths_kv.tolist()
    require(block_table.shape[1] >= ceil_div(max(kv_lens, default=0), block_size), op, "block_table too narrow")
    valid = sparse_indices >= 0
    # Valid entries first, then the invalid ones: the valid flags of a row must never go from False to True.
    require(bool((valid[..., 1:] <= valid[..., :-1]).all()), op, "valid sparse_indices must come before invalid ones")
    record(op, key_dtype=key.dtype, key_shape=tuple(key.shape), topk=sparse_indices.shape[-1])
    flat = key.reshape(-1, RECORD_BYTES).view(torch.uint8)
    nope_q = flat[:, :NOPE].contiguous().view(key.dtype if key.dtype != torch.int8 else torch.int8).float()
    rope = flat[:, NOPE : NOPE + 2 * ROPE].contiguous().view(query.dtype).float()
    scales = flat[:, NOPE + 2 * ROPE :].contiguous().view(torch.float32)
    nope = (nope_q.view(-1, NOPE // TILE, TILE) * scales[..., None]).view(-1, NOPE)
    out = torch.empty(batch, s1, heads, NOPE, dtype=torch.float32)
    for b in range(batch):
        n = kv_lens[b]
        for s in range(s1):
            idx = sparse_indices[b, s, 0]
            idx = idx[idx >= 0].long()
            require(bool((idx < n).all()), op, "sparse_indices must lie inside actual_seq_lengths_kv")
            limit = n - s1 + s if sparse_mode == 3 else n - 1
            idx = idx[idx <= limit]
            if idx.numel() == 0:
                poison(out[b, s])
                continue
            slots = block_table[b, idx // block_size].long() * block_size + idx % block_size
            k = torch.cat([nope[slots], rope[slots]], dim=-1)
            scores = query[b, s].float() @ k.T * scale_value  # [N, topk]
            out[b, s] = torch.softmax(scores, dim=-1) @ nope[slots]
    return out.to(query.dtype)
