"""Attention ops: ``mla_decode``, ``attention_varlen``, ``write_kv_cache``.

The paged latent cache and its formats (``bf16``, ``fp8_ds_mla``) are defined in ``deepinfer.kv_cache``.
"""

from __future__ import annotations

import torch

from ..dispatch import call
from ..kv_cache import FP8_GROUP, KV_FORMATS, kv_cache_dtype, kv_cache_width, kv_format_of
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled


def check_cache(c: Check, kv_cache, kv_format: str | None, kv_lora_rank: int, rope_dim: int) -> str:
    c.tensor("kv_cache", kv_cache, ndim=3)
    fmt = kv_format or kv_format_of(kv_cache)
    c.choice("kv_format", fmt, KV_FORMATS)
    if kv_cache.dtype != kv_cache_dtype(fmt):
        raise c.fail("kv_cache", f"dtype {kv_cache_dtype(fmt)} for kv_format {fmt!r}", f"dtype {kv_cache.dtype}")
    if fmt == "fp8_ds_mla" and kv_lora_rank % FP8_GROUP:
        raise c.fail("kv_lora_rank", f"a multiple of {FP8_GROUP} for fp8_ds_mla", str(kv_lora_rank))
    width = kv_cache_width(fmt, kv_lora_rank, rope_dim)
    if kv_cache.shape[2] != width:
        raise c.fail(
            "kv_cache",
            f"last dim {width} ({fmt}, kv_lora_rank={kv_lora_rank}, rope_dim={rope_dim})",
            f"shape {list(kv_cache.shape)}",
        )
    if not kv_cache.is_contiguous():
        raise c.fail("kv_cache", "a contiguous tensor", "a non-contiguous view")
    return fmt


def check_slots(c: Check, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Every entry of ``slot_mapping`` a slot of the paged ``cache`` or -1, no slot twice (a value check)."""
    slots = cache.shape[0] * cache.shape[1]
    c.values_in_range("slot_mapping", slot_mapping, -1, slots - 1, what="slots (or -1)")
    used = slot_mapping[slot_mapping >= 0]
    if used.unique().numel() != used.numel():
        raise c.fail("slot_mapping", "distinct slots (apart from -1)", "a slot written twice")


def check_pages(c: Check, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """seq_lens within the block table, and the page ids of the pages in use inside the cache (a value check: one
    host synchronisation for both)."""
    num_blocks, block_size = cache.shape[:2]
    bounds = [seq_lens.min(), seq_lens.max()]
    if block_table.shape[1]:  # the used pages' smallest and largest id (int32 limits where a row uses none)
        used = torch.arange(block_table.shape[1], device=seq_lens.device) * block_size < seq_lens[:, None]
        limit = torch.iinfo(torch.int32)
        bounds += [block_table.where(used, limit.max).min(), block_table.where(used, limit.min).max()]
    values = torch.stack(bounds).tolist()
    c.bounds_in_range("seq_lens", *values[:2], 0, block_table.shape[1] * block_size, what="lengths")
    if len(values) == 4 and values[2] <= values[3]:
        c.bounds_in_range("block_table", *values[2:], 0, num_blocks - 1, what="page ids of used pages")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed multi-head latent attention over a paged latent cache.

    q: ``[B, S_q, H, D_qk]`` (bf16), ``D_qk = kv_lora_rank + rope_dim`` (576 for DeepSeek-V3): the query already
        multiplied into the latent space, rope part last.
    kv_cache: ``[num_blocks, block_size, width]`` in ``kv_format`` (default: ``bf16`` for a bfloat16 cache,
        ``fp8_ds_mla`` for a uint8 one). Keys are the full ``D_qk`` values of a token, values its first
        ``kv_lora_rank``.
    block_table: ``[B, max_blocks]`` int32 page ids; seq_lens: ``[B]`` int32, tokens in the cache for each
        sequence including its ``S_q`` new ones, at most ``max_blocks * block_size``.
    Query ``i`` of sequence ``b`` attends to cache positions ``< seq_lens[b] - S_q + i + 1`` (causal over the
    new tokens; ``S_q > 1`` is MTP / speculative verification). A query that sees no position returns zeros and
    ``lse = -inf``. softmax_scale: a finite number > 0.

    Returns ``out [B, S_q, H, kv_lora_rank]`` in q's dtype and ``lse [B, S_q, H]`` fp32 (natural log of the sum
    of ``exp(softmax_scale * q.k)``).
    """
    c = Check("mla_decode")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    c.positive_int("kv_lora_rank", kv_lora_rank)
    d_qk = q.shape[3]
    if kv_lora_rank >= d_qk:
        raise c.fail("kv_lora_rank", f"less than D_qk = {d_qk} (the last dim of 'q')", str(kv_lora_rank))
    check_cache(c, kv_cache, kv_format, kv_lora_rank, d_qk - kv_lora_rank)
    batch = q.shape[0]
    c.index("block_table", block_table, ndim=2)
    if block_table.shape[0] != batch:
        raise c.fail("block_table", f"{batch} rows (the batch of 'q')", f"shape {list(block_table.shape)}")
    c.index("seq_lens", seq_lens, length=batch)
    c.positive_number("softmax_scale", softmax_scale)
    c.same_device(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if value_checks_enabled(q) and batch:
        check_pages(c, kv_cache, block_table, seq_lens)
    return call(
        "mla_decode",
        q=q,
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        kv_format=kv_format or kv_format_of(kv_cache),
    )


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = True,
) -> torch.Tensor:
    """Attention over packed variable-length sequences (prefill; MLA prefill uses D_qk 192, D_v 128).

    q: ``[T_q, H, D_qk]``; k: ``[T_k, H_k, D_qk]``; v: ``[T_k, H_k, D_v]``, one float dtype, ``H % H_k == 0``
    (query head ``h`` uses kv head ``h // (H / H_k)``). cu_seqlens_q / cu_seqlens_k: ``[B+1]`` int32 offsets,
    nondecreasing from 0 to ``T_q`` / ``T_k``. With ``causal``, query ``i`` of a sequence attends to keys
    ``j <= i + (L_k - L_q)`` (aligned bottom-right: a longer k than q is a cached prefix). A query that sees no key
    returns zeros. softmax_scale: a finite number > 0. Returns ``[T_q, H, D_v]`` in q's dtype.
    """
    c = Check("attention_varlen")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    c.tensor("k", k, dtypes=(q.dtype,), shape=(None, None, q.shape[2]))
    c.tensor("v", v, dtypes=(q.dtype,), shape=(k.shape[0], k.shape[1], None))
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise c.fail("k", f"a head count dividing H = {q.shape[1]}", f"shape {list(k.shape)}")
    c.index("cu_seqlens_q", cu_seqlens_q)
    c.index("cu_seqlens_k", cu_seqlens_k, length=cu_seqlens_q.shape[0])
    if cu_seqlens_q.shape[0] < 1:
        raise c.fail("cu_seqlens_q", "at least one entry (B+1 offsets)", "none")
    c.positive_number("softmax_scale", softmax_scale)
    if not isinstance(causal, bool):
        raise c.fail("causal", "a bool", repr(causal))
    c.same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if value_checks_enabled(q):
        c.nondecreasing_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        c.nondecreasing_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    return call(
        "attention_varlen",
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        softmax_scale=softmax_scale,
        causal=causal,
    )


def write_kv_cache(
    latent: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    kv_lora_rank: int = 512,
    kv_format: str | None = None,
) -> None:
    """Writes ``latent [T, kv_lora_rank + rope_dim]`` (bf16: ``c`` then ``k_rope``) into the paged cache in place.

    slot_mapping: ``[T]`` int64, ``slot = block * block_size + offset``; ``-1`` skips the token; other slots must
    be distinct and inside the cache. ``fp8_ds_mla`` quantises ``c`` per 128 values with power-of-two scales.
    """
    c = Check("write_kv_cache")
    c.tensor("latent", latent, dtypes=FLOAT_DTYPES, ndim=2)
    c.positive_int("kv_lora_rank", kv_lora_rank)
    if kv_lora_rank >= latent.shape[1]:
        raise c.fail("kv_lora_rank", f"less than the latent width {latent.shape[1]}", str(kv_lora_rank))
    check_cache(c, kv_cache, kv_format, kv_lora_rank, latent.shape[1] - kv_lora_rank)
    c.index("slot_mapping", slot_mapping, dtype=torch.int64, length=latent.shape[0])
    c.same_device(latent=latent, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if value_checks_enabled(latent) and latent.shape[0]:
        check_slots(c, kv_cache, slot_mapping)
    call(
        "write_kv_cache",
        latent=latent,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        kv_lora_rank=kv_lora_rank,
        kv_format=kv_format or kv_format_of(kv_cache),
    )
