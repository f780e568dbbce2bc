"""Attention ops on Ascend: ``mla_decode``, ``attention_varlen``, ``write_kv_cache``.

Fused operators (torch_npu, op-plugin docs ``docs/en/custom_APIs/torch_npu``):
- ``mla_decode`` -> ``npu_fused_infer_attention_score_v2`` in its MLA mode: query D 512 with a separate 64-wide
  ``query_rope``, the latent as both key and value (KV_N 1), ``key_rope`` separate, page attention (BSND query,
  ``(blocknum, blocksize, 512)`` cache), ``actual_seq_kvlen``, ``return_softmax_lse``; ``S_q > 1`` uses
  ``sparse_mode`` 3 (rightDownCausal) with the optimised 2048 x 2048 mask. The docs require contiguous key, value
  and key_rope, while the core's cache interleaves ``c | k_rope`` per token, so each call first copies the pages
  the batch uses into contiguous nope and rope planes (a composite step; ``fp8_ds_mla`` pages are dequantised in
  that copy, exactly: e4m3 times a power of two is a bf16 value).
- ``attention_varlen`` -> the same operator in ``TND`` layout (cumulative ``actual_seq_qlen/kvlen``, sparse_mode 3
  for causal, which is the core's bottom-right alignment).
- ``write_kv_cache`` -> ``npu_scatter_nd_update_`` on the cache viewed as ``[slots, width]`` (int8 view for the
  656-byte records; the docs list int8, not uint8); ``fp8_ds_mla`` records are packed in plain torch first.

Rows the docs leave undefined (a query that sees no key, a sequence of length 0) are overwritten here with the
contract's zeros and ``-inf`` lse. Other shapes run the plain-torch composites at the bottom of the file.
"""

from __future__ import annotations

import math

import torch

from deepinfer import Decline
from deepinfer.kv_cache import FP8_GROUP, fp8_ds_mla_offsets, pack_fp8_ds_mla

from . import probe

MLA_NOPE, MLA_ROPE = 512, 64
MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
FP8 = torch.float8_e4m3fn
MASK_SIZE = 2048
INT32_LIMIT = 2**31 - 1
_masks: dict[tuple[str, int | None], torch.Tensor] = {}


def causal_mask(device: torch.device) -> torch.Tensor:
    """The optimised mask sparse_mode 3 takes: (2048, 2048), 1 = masked, i.e. the strict upper triangle (the docs
    call it "lower triangular", the kept part; assumption 4 in the README)."""
    key = (device.type, device.index)
    if key not in _masks:
        _masks[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device), diagonal=1)
    return _masks[key]


# ---------------------------------------------------------------------------------------------------------------
# fp8_ds_mla records: the core (FlashMLA) byte order is nope | scales | rope; torch_npu's quantised sparse
# attention takes nope | rope | scales (docs: npu_kv_quant_sparse_flash_attention, "k_nope, k_rope and float32
# quantization parameters concatenated along D"). Both are 656 bytes for DeepSeek-V3.


def to_ascend_records(records: torch.Tensor, kv_lora_rank: int = MLA_NOPE) -> torch.Tensor:
    """Core ``nope | scales | rope`` records ``[..., width]`` (uint8) -> torch_npu's ``nope | rope | scales``."""
    s, r = fp8_ds_mla_offsets(kv_lora_rank)
    return torch.cat([records[..., :s], records[..., r:], records[..., s:r]], dim=-1)


def from_ascend_records(records: torch.Tensor, kv_lora_rank: int = MLA_NOPE) -> torch.Tensor:
    """torch_npu's ``nope | rope | scales`` -> the core's ``nope | scales | rope`` (inverse of to_ascend_records)."""
    s, r = fp8_ds_mla_offsets(kv_lora_rank)
    rope_end = records.shape[-1] - (r - s)
    return torch.cat([records[..., :s], records[..., rope_end:], records[..., s:rope_end]], dim=-1)


def unpack_records(records: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Core fp8_ds_mla records ``[..., width]`` -> ``(c, k_rope)`` in bf16 (exact: e4m3 x 2^k fits bf16)."""
    s, r = fp8_ds_mla_offsets(kv_lora_rank)
    lead = records.shape[:-1]
    data = records[..., :s].contiguous().view(FP8).float()
    scale = records[..., s:r].contiguous().view(torch.float32)
    c = (data.reshape(*lead, -1, FP8_GROUP) * scale[..., None]).reshape(*lead, kv_lora_rank)
    return c.to(torch.bfloat16), records[..., r:].contiguous().view(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# mla_decode


def _compact_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, n_pages: int):
    """The pages the batch reads, copied in table order: ``(pages [B * n_pages, bs, width], table [B, n_pages])``.
    Table entries past a sequence's length are not validated by the core (they may be -1): page 0 stands in."""
    batch, block_size = block_table.shape[0], kv_cache.shape[1]
    steps = torch.arange(n_pages, device=block_table.device) * block_size
    used = steps[None, :] < seq_lens.to(block_table.device)[:, None]
    index = torch.where(used, block_table[:, :n_pages], 0).reshape(-1).long()
    table = torch.arange(batch * n_pages, dtype=torch.int32, device=block_table.device).view(batch, n_pages)
    return kv_cache.index_select(0, index), table


def _latent_planes(pages: torch.Tensor, kv_lora_rank: int, kv_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous nope ``[P, bs, R]`` and rope ``[P, bs, rope]`` bf16 planes of the copied pages."""
    if kv_format == "bf16":
        return pages[..., :kv_lora_rank].contiguous(), pages[..., kv_lora_rank:].contiguous()
    return unpack_records(pages, kv_lora_rank)


def _sees_any(seq_lens: torch.Tensor, s_q: int) -> torch.Tensor:
    """[B, S_q] bool: query i of sequence b sees at least one cache position (seq_len - S_q + i + 1 > 0)."""
    steps = torch.arange(s_q, device=seq_lens.device)
    return (seq_lens.long()[:, None] - s_q + steps[None, :] + 1) > 0


def mla_decode_fia(
    q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_decode`` through ``npu_fused_infer_attention_score_v2`` (MLA, page attention, lse)."""
    npu = probe.torch_npu()
    batch, s_q, heads, _ = q.shape
    if batch == 0:
        return q.new_zeros(0, s_q, heads, kv_lora_rank), torch.zeros(0, s_q, heads, device=q.device)
    if block_table.shape[1] == 0:  # no pages: no query sees a position
        lse = torch.full((batch, s_q, heads), float("-inf"), device=q.device)
        return q.new_zeros(batch, s_q, heads, kv_lora_rank), lse
    block_size = kv_cache.shape[1]
    lens = seq_lens.tolist()  # actual_seq_kvlen is a host list in torch_npu's eager API: one sync per call
    n_pages = max(1, math.ceil(max(lens) / block_size))
    pages, table = _compact_pages(kv_cache, block_table, seq_lens, n_pages)
    nope, rope = _latent_planes(pages, kv_lora_rank, kv_format)
    out, lse = npu.npu_fused_infer_attention_score_v2(
        q[..., :kv_lora_rank].contiguous(),
        nope,
        nope,  # MLA: the latent is both key and value
        query_rope=q[..., kv_lora_rank:].contiguous(),
        key_rope=rope,
        atten_mask=causal_mask(q.device) if s_q > 1 else None,
        actual_seq_kvlen=[max(n, 1) for n in lens],  # length 0 is undocumented; its rows are overwritten below
        block_table=table,
        num_query_heads=heads,
        num_key_value_heads=1,
        softmax_scale=softmax_scale,
        input_layout="BSND",
        sparse_mode=3 if s_q > 1 else 0,  # 3 = rightDownCausal: query i sees positions < len - S_q + i + 1
        block_size=block_size,
        return_softmax_lse=True,  # the v1 doc excludes lse in MLA mode, the v2 doc does not (README assumption 1)
    )
    # docs: (B, Q_N, Q_S, 1); read as the lse of the scaled scores (README assumption 1)
    lse = lse.reshape(batch, heads, s_q).transpose(1, 2).float()
    sees = _sees_any(seq_lens, s_q)
    out = torch.where(sees[:, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    lse = torch.where(sees[:, :, None], lse, torch.full((), float("-inf"), device=lse.device))
    return out, lse


def mla_decode_fia_supports(
    q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format
) -> bool | Decline:
    """The MLA mode's documented envelope: query D 512 + rope 64, N in 1..128 (powers of two), bf16, page size a
    multiple of 16 up to 1024; fp8_ds_mla needs the kv_fp8_ds_mla capability (e4m3 on the device)."""
    block_size = kv_cache.shape[1]
    pages = block_table.numel()
    answer = probe.placed(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if not answer:
        return answer
    if q.dtype != torch.bfloat16:
        return Decline(f"q is {q.dtype}, expected torch.bfloat16")
    if kv_lora_rank != MLA_NOPE or q.shape[3] != MLA_NOPE + MLA_ROPE:
        return Decline(f"kv_lora_rank {kv_lora_rank} and q's width {q.shape[3]}, expected {MLA_NOPE} and 576")
    if q.shape[2] not in MLA_HEADS:
        return Decline(f"q has {q.shape[2]} heads, expected one of {MLA_HEADS}")
    if q.shape[1] > MASK_SIZE:
        return Decline(f"q has {q.shape[1]} queries per row > {MASK_SIZE}")
    # the MLA section's rule, not the general 128..512 one (README assumption 2)
    if block_size % 16 or not 0 < block_size <= 1024:
        return Decline(f"kv_cache's pages of {block_size} tokens, expected a multiple of 16 up to 1024")
    if pages * block_size * MLA_NOPE > INT32_LIMIT:  # docs: key's element count must fit int32
        return Decline("block_table reaches more latent elements than int32 counts")
    if kv_format != "bf16":
        return probe.capable("kv_fp8_ds_mla")
    return True


# ---------------------------------------------------------------------------------------------------------------
# attention_varlen


def _varlen_dims_ok(d_qk: int, d_v: int, mha: bool) -> bool:
    """TND without rope (docs): Q_D = K_D = V_D = 128, or Q_D = K_D = 192 with V_D 128; MHA also 64/64."""
    return (d_qk, d_v) in ((128, 128), (192, 128)) or (mha and (d_qk, d_v) == (64, 64))


def attention_varlen_fia(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> torch.Tensor:
    """``attention_varlen`` through ``npu_fused_infer_attention_score_v2`` in TND layout."""
    npu = probe.torch_npu()
    tokens, heads, _ = q.shape
    if tokens == 0:
        return q.new_zeros(0, heads, v.shape[2])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # TND takes cumulative host lists
    out, _ = npu.npu_fused_infer_attention_score_v2(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        atten_mask=causal_mask(q.device) if causal else None,
        actual_seq_qlen=cq[1:],
        actual_seq_kvlen=ck[1:],
        num_query_heads=heads,
        num_key_value_heads=k.shape[1],
        softmax_scale=softmax_scale,
        input_layout="TND",
        sparse_mode=3 if causal else 0,  # 3 = rightDownCausal, the core's bottom-right alignment
    )
    len_q = torch.diff(cu_seqlens_q.long())
    len_k = torch.diff(cu_seqlens_k.long())
    seq = torch.repeat_interleave(torch.arange(len_q.numel(), device=q.device), len_q, output_size=tokens)
    pos = torch.arange(tokens, device=q.device) - cu_seqlens_q.long()[seq]
    sees = len_k[seq] > 0
    if causal:
        sees &= pos + len_k[seq] - len_q[seq] >= 0
    return torch.where(sees[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def attention_varlen_fia_supports(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> bool | Decline:
    heads, kv_heads = q.shape[1], k.shape[1]
    answer = probe.placed(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if not answer:
        return answer
    if q.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"q is {q.dtype}, expected bfloat16 or float16")
    if not _varlen_dims_ok(q.shape[2], v.shape[2], heads == kv_heads):
        return Decline(f"head dims {q.shape[2]} (q, k) and {v.shape[2]} (v) are not a documented pair")
    if heads // kv_heads > 64:
        return Decline(f"{heads // kv_heads} query heads per kv head > 64")
    if not 0 < cu_seqlens_q.shape[0] - 1 <= 4096:
        return Decline(f"cu_seqlens_q holds {cu_seqlens_q.shape[0] - 1} sequences, expected 1 to 4096")
    if k.shape[0] == 0:
        return Decline("k has no tokens")
    return True


# ---------------------------------------------------------------------------------------------------------------
# write_kv_cache


def scatter_rows(cache, slot_mapping, rows, pack=None) -> None:
    """``rows`` into the paged ``cache`` at ``slot_mapping`` (``-1`` skipped) through ``npu_scatter_nd_update_`` (in
    place) on its ``[slots, width]`` view: as bf16, or as the byte records ``pack(rows)`` (an int8 view)."""
    npu = probe.torch_npu()
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]  # dropping the -1 entries synchronises once
    if slots.numel() == 0:
        return
    flat = cache.view(-1, cache.shape[-1])
    if pack is None:
        updates = rows[keep].to(torch.bfloat16).contiguous()
    else:
        updates, flat = pack(rows[keep]).view(torch.int8), flat.view(torch.int8)
    npu.npu_scatter_nd_update_(flat, slots.view(-1, 1), updates)


def write_kv_cache_scatter(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format) -> None:
    """``write_kv_cache`` through ``npu_scatter_nd_update_``."""
    pack = None if kv_format == "bf16" else (lambda rows: pack_fp8_ds_mla(rows, kv_lora_rank))
    scatter_rows(kv_cache, slot_mapping, latent, pack)


def write_kv_cache_scatter_supports(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format) -> bool | Decline:
    answer = probe.placed(latent=latent, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if answer and kv_format != "bf16":
        return probe.capable("kv_fp8_ds_mla")
    return answer


# ---------------------------------------------------------------------------------------------------------------
# Quantised-KV sparse attention (DeepSeek-V3.2): wiring for the coming ``sparse_mla_decode`` op. Not registered for
# ``mla_decode``: npu_kv_quant_sparse_flash_attention returns no lse, which mla_decode's contract requires.


def sparse_mla_decode_quantized(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = MLA_NOPE,
) -> torch.Tensor:
    """Attention of ``q [B, S_q, H, 576]`` over the tokens ``indices [B, S_q, topk]`` (logical positions, -1 padded)
    of an ``fp8_ds_mla`` cache, through ``npu_kv_quant_sparse_flash_attention``. Returns ``[B, S_q, H, 512]``.

    The pages the batch uses are copied and re-ordered to torch_npu's ``nope | rope | scales`` records. Valid
    indices are moved in front of the -1 entries (the docs require valid-first). Query i sees positions
    ``< seq_len - S_q + i + 1`` (sparse_mode 3). Needs the kv_fp8_ds_mla capability: the A2/A3 operator takes int8
    records, which these are not. Assumed (README 13): on a 950 the records go in as float8_e4m3fn and the output
    is ``[B, S_q, H, 512]`` (the doc says "the shape of query").
    """
    if not probe.has("kv_fp8_ds_mla"):
        raise NotImplementedError("quantised-KV sparse attention over e4m3 records needs an Ascend 950")
    npu = probe.torch_npu()
    batch = q.shape[0]
    block_size = kv_cache.shape[1]
    n_pages = max(1, math.ceil(int(seq_lens.max()) / block_size)) if batch else 1
    pages, table = _compact_pages(kv_cache, block_table, seq_lens, n_pages)
    key = to_ascend_records(pages, kv_lora_rank).view(FP8).unsqueeze(2)  # PA_BSND: [blocks, block_size, 1, 656]
    big = torch.iinfo(torch.int32).max
    ordered = torch.sort(torch.where(indices < 0, big, indices.int()), dim=-1).values
    ordered = torch.where(ordered == big, -1, ordered).to(torch.int32).unsqueeze(2)  # [B, S_q, KV_N=1, topk]
    return npu.npu_kv_quant_sparse_flash_attention(
        q.contiguous(),
        key,
        key,
        ordered,
        softmax_scale,
        2,  # key_quant_mode: per_tile
        2,  # value_quant_mode: per_tile
        block_table=table,
        actual_seq_lengths_kv=seq_lens.to(torch.int32),
        sparse_block_size=1,
        layout_query="BSND",
        layout_kv="PA_BSND",
        sparse_mode=3,
        attention_mode=2,  # MLA-absorb: key and value share the record
        quant_scale_repo_mode=1,
        tile_size=FP8_GROUP,
        rope_head_dim=q.shape[3] - kv_lora_rank,
    )


# ---------------------------------------------------------------------------------------------------------------
# Plain-torch composites (run on the NPU for shapes the fused operators do not take).


def _read_latent(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int, kv_format: str) -> torch.Tensor:
    rows = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, slots)
    if kv_format == "bf16":
        return rows.float()
    c, rope = unpack_records(rows, kv_lora_rank)
    return torch.cat([c.float(), rope.float()], dim=-1)


def _softmax_attend(q, k, v, visible, scale):
    """q [S, H, D], k [N, H or 1, D], v [N, H or 1, Dv] fp32, visible [S, N] -> (out [S, H, Dv], lse [S, H]); rows
    that see nothing give zeros and -inf."""
    heads = q.shape[1]
    k, v = k.expand(-1, heads, -1), v.expand(-1, heads, -1)
    scores = torch.einsum("shd,nhd->shn", q, k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("shn,nhd->shd", weights, v), lse


def mla_decode_composite(
    q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers each sequence's tokens and attends in fp32 (any rank, rope width, page size, head count)."""
    batch, s_q, heads, _ = q.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(batch, s_q, heads, kv_lora_rank, device=q.device)
    lse = torch.full((batch, s_q, heads), float("-inf"), device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[b].long()[pos // block_size] * block_size + pos % block_size
        kv = _read_latent(kv_cache, slots, kv_lora_rank, kv_format)[:, None, :]  # [n, 1, D]
        visible = pos[None, :] <= torch.arange(s_q, device=q.device)[:, None] + (n - s_q)
        out[b], lse[b] = _softmax_attend(q[b].float(), kv, kv[..., :kv_lora_rank], visible, softmax_scale)
    return out.to(q.dtype), lse


def attention_varlen_composite(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal) -> torch.Tensor:
    """One sequence at a time in fp32, kv heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0 or lk == 0:
            continue
        kk = k[ck[b] : ck[b + 1]].float().repeat_interleave(group, dim=1)
        vv = v[ck[b] : ck[b + 1]].float().repeat_interleave(group, dim=1)
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + lk - lq
        out[cq[b] : cq[b + 1]] = _softmax_attend(q[cq[b] : cq[b + 1]].float(), kk, vv, visible, softmax_scale)[0]
    return out.to(q.dtype)
