"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): ``write_index_cache``, ``indexer_topk``, ``sparse_mla``.

A lightning indexer scores every cached token for each query and keeps the ``topk`` best; absorbed MLA then
attends over those tokens only. The indexer-key cache and its formats are defined in ``deepinfer.index_cache``; it
is paged like the latent cache, so one block table and one slot mapping serve both.
"""

from __future__ import annotations

import torch

from ..dispatch import call
from ..index_cache import FP8_GROUP, index_cache_dtype, index_cache_width, index_format_of
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled
from .attention import check_cache, check_pages, check_slots


def _check_index_cache(c: Check, index_cache, head_dim: int) -> str:
    c.tensor("index_cache", index_cache, ndim=3)
    fmt = index_format_of(index_cache)
    if index_cache.dtype != index_cache_dtype(fmt):  # neither uint8 nor bfloat16
        raise c.fail("index_cache", f"dtype {torch.bfloat16} or {torch.uint8}", f"dtype {index_cache.dtype}")
    if fmt == "fp8_ds_index" and head_dim % FP8_GROUP:
        raise c.fail("index_cache", f"a head_dim that is a multiple of {FP8_GROUP} for fp8_ds_index", str(head_dim))
    width = index_cache_width(fmt, head_dim)
    if index_cache.shape[2] != width:
        raise c.fail(
            "index_cache", f"last dim {width} ({fmt}, head_dim={head_dim})", f"shape {list(index_cache.shape)}"
        )
    if not index_cache.is_contiguous():
        raise c.fail("index_cache", "a contiguous tensor", "a non-contiguous view")
    return fmt


def write_index_cache(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes the indexer keys ``k [T, head_dim]`` (float) into the paged indexer-key cache in place.

    index_cache: ``[num_blocks, block_size, width]``, ``bf16`` (a bfloat16 tensor) or ``fp8_ds_index`` (uint8, 128
    e4m3 values and one power-of-two fp32 scale per 128 values of a key; ``deepinfer.index_cache``).
    slot_mapping: ``[T]`` int64, ``slot = block * block_size + offset``; ``-1`` skips the token; other slots must be
    distinct and inside the cache.
    """
    c = Check("write_index_cache")
    c.tensor("k", k, dtypes=FLOAT_DTYPES, ndim=2)
    _check_index_cache(c, index_cache, k.shape[1])
    c.index("slot_mapping", slot_mapping, dtype=torch.int64, length=k.shape[0])
    c.same_device(k=k, index_cache=index_cache, slot_mapping=slot_mapping)
    if value_checks_enabled(k) and k.shape[0]:
        check_slots(c, index_cache, slot_mapping)
    call("write_index_cache", k=k, index_cache=index_cache, slot_mapping=slot_mapping)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    topk: int,
) -> torch.Tensor:
    """The lightning indexer: for each query, the cache slots of the ``topk`` cached tokens it scores highest.

    q: ``[T, H, D]`` float, the packed queries of ``B`` sequences (rope already applied); weights: ``[T, H]``
        float32, each head's weight with every scale folded in (DeepSeek-V3.2:
        ``weights_proj(x) * H^-0.5 * D^-0.5``).
    index_cache: ``[num_blocks, block_size, width]`` indexer keys (``write_index_cache``).
    block_table: ``[B, max_blocks]`` int32 page ids; cu_seqlens_q: ``[B+1]`` int32 offsets of each sequence's
        queries in ``q`` (nondecreasing from 0 to ``T``); seq_lens: ``[B]`` int32 tokens in the cache for each
        sequence, including its ``L_b = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new ones (``L_b <= seq_lens[b]``),
        or 0: a padding sequence (a CUDA graph's padding rows), whose queries see nothing.

    Query ``i`` of sequence ``b`` sees positions ``p < seq_lens[b] - L_b + i + 1`` (causal) and scores each
    ``I[p] = sum_h weights[h] * relu(q[h] . k[p])`` in fp32 over the key as cached. It keeps the ``min(topk,
    visible)`` positions of highest score, a tie going to the lower position, so the choice is deterministic and
    the same whatever else is in the batch.

    Returns ``[T, topk]`` int32: the kept positions' cache slots (``block_table[b, p // block_size] * block_size +
    p % block_size``) in ascending position order, then ``-1`` for the rest of the row.
    """
    c = Check("indexer_topk")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    tokens, heads, head_dim = q.shape
    c.tensor("weights", weights, dtypes=(torch.float32,), shape=(tokens, heads))
    _check_index_cache(c, index_cache, head_dim)
    c.index("block_table", block_table, ndim=2)
    c.index("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] < 1:
        raise c.fail("cu_seqlens_q", "at least one entry (B+1 offsets)", "none")
    batch = cu_seqlens_q.shape[0] - 1
    if block_table.shape[0] != batch:
        raise c.fail(
            "block_table", f"{batch} rows (one per sequence of 'cu_seqlens_q')", f"shape {list(block_table.shape)}"
        )
    c.index("seq_lens", seq_lens, length=batch)
    c.positive_int("topk", topk)
    c.same_device(
        q=q,
        weights=weights,
        index_cache=index_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
    )
    if value_checks_enabled(q):  # with no sequence, the offsets still have to end at T (no query left over)
        c.nondecreasing_offsets("cu_seqlens_q", cu_seqlens_q, tokens)
    if value_checks_enabled(q) and batch:
        check_pages(c, index_cache, block_table, seq_lens)
        short = ((seq_lens < cu_seqlens_q[1:] - cu_seqlens_q[:-1]) & (seq_lens != 0)).nonzero()
        if short.numel():
            b = int(short[0, 0])
            raise c.fail(
                "seq_lens",
                "at least as many cached tokens as new queries per sequence, or 0 (a padding sequence)",
                f"sequence {b}: {int(seq_lens[b])} cached, {int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])} queries",
            )
    return call(
        "indexer_topk",
        q=q,
        weights=weights,
        index_cache=index_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        topk=topk,
    )


def sparse_mla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    softmax_scale: float,
    kv_lora_rank: int = 512,
    kv_format: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed multi-head latent attention of each query over the cache slots listed for it.

    q: ``[T, H, D_qk]`` float, ``D_qk = kv_lora_rank + rope_dim`` (576 for DeepSeek-V3.2): the packed queries
        already multiplied into the latent space, rope part last (decode and prefill alike).
    kv_cache: the paged latent cache (``mla_decode``'s: ``bf16`` or ``fp8_ds_mla``, ``deepinfer.kv_cache``).
    indices: ``[T, topk]`` int32 cache slots (``indexer_topk``'s output); ``-1`` entries are skipped. Query ``t``
        attends to the tokens at its listed slots, each entry once (no causal mask: the list is the mask).
    softmax_scale: a finite number > 0.

    Returns ``out [T, H, kv_lora_rank]`` in q's dtype and ``lse [T, H]`` fp32 (natural log of the sum of
    ``exp(softmax_scale * q.k)``); a query with no slot listed returns zeros and ``lse = -inf``.
    """
    c = Check("sparse_mla")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    c.positive_int("kv_lora_rank", kv_lora_rank)
    d_qk = q.shape[2]
    if kv_lora_rank >= d_qk:
        raise c.fail("kv_lora_rank", f"less than D_qk = {d_qk} (the last dim of 'q')", str(kv_lora_rank))
    fmt = check_cache(c, kv_cache, kv_format, kv_lora_rank, d_qk - kv_lora_rank)
    c.index("indices", indices, ndim=2, length=q.shape[0])
    if indices.shape[1] < 1:
        raise c.fail("indices", "at least one column", f"shape {list(indices.shape)}")
    c.positive_number("softmax_scale", softmax_scale)
    c.same_device(q=q, kv_cache=kv_cache, indices=indices)
    if value_checks_enabled(q) and indices.numel():
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        c.values_in_range("indices", indices, -1, slots - 1, what="cache slots (or -1)")
    return call(
        "sparse_mla",
        q=q,
        kv_cache=kv_cache,
        indices=indices,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        kv_format=fmt,
    )
