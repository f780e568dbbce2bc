"""``example_buggy``: the ``example_cpu`` ops with planted bugs, each of a kind real kernels have had.

- ``mla_decode``: the causal limit is off by one, so every query also sees the next position.
- ``gemm`` (FP8): every output column uses the weight scale of the first 128-row block of ``w``.
- ``rms_norm``: batches of 8 rows or more take a "fast path" that sums squares in bf16 chunks, so a row's
  result depends on the batch it came in; yet the implementation claims to be batch-invariant.
- ``indexer_topk``: tied scores go to the higher position instead of the lower one.
- ``sparse_mla``: a row's first ``-1`` ends its list, as if valid slots always came first.
- ``apply_token_bitmask``: a word's bits read most significant first.
- ``hc_post``: comb applied as ``comb @ streams`` instead of transposed (Sinkhorn's comb is not symmetric).
- ``write_kv_cache``: ``slot_mapping`` is read as if it were contiguous (entry ``t`` at ``ptr + t``), so a strided
  view of the slots writes to the wrong ones.
"""

from __future__ import annotations

import torch

import deepinfer
from deepinfer import BackendSpec, OpImpl
from deepinfer.index_cache import read_keys
from deepinfer.reference import attention as reference_attention
from deepinfer.reference import sparse_attention as reference
from deepinfer.reference.sparse_attention import sequence_slots

from . import correct


def mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format):
    return correct.mla_decode(
        q,
        kv_cache,
        block_table,
        seq_lens + 1,
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        kv_format=kv_format,
    )


def gemm(a, w, *, out_dtype, bias):
    first_block_scale = w.scale[:1].expand_as(w.scale)
    return correct.gemm(a, type(w)(w.data, first_block_scale, w.block, w.scale_format), out_dtype=out_dtype, bias=bias)


def rms_norm(x, w, eps, residual):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    squares = h.float() * h.float()
    if x.shape[0] >= 8:  # the "fast path": partial sums of 32 values rounded to bf16
        sum_sq = squares.unflatten(-1, (-1, 32)).sum(-1).bfloat16().float().sum(-1, keepdim=True)
    else:
        sum_sq = squares.sum(-1, keepdim=True)
    return (h.float() * torch.rsqrt(sum_sq / h.shape[-1] + eps) * w.float()).to(x.dtype), h


def indexer_topk(q, weights, index_cache, block_table, cu_seqlens_q, seq_lens, *, topk):
    # Sorting the positions back to front turns the lower-position tie-break into a higher-position one.
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    block_size, cu, lens = index_cache.shape[1], cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        for t in range(cu[b], cu[b + 1]):
            visible = n - (cu[b + 1] - cu[b]) + (t - cu[b]) + 1
            if visible <= 0:  # a padding sequence's queries keep nothing
                continue
            slots = sequence_slots(block_table[b], visible, block_size)
            keys = read_keys(index_cache, slots, q.shape[2])
            scores = (q[t].float() @ keys.T).relu().T @ weights[t]
            order = torch.sort(scores.flip(0), descending=True, stable=True).indices[:topk]
            chosen = (visible - 1 - order).sort().values
            out[t, : chosen.numel()] = slots[chosen].to(torch.int32)
    return out


def sparse_mla(q, kv_cache, indices, *, softmax_scale, kv_lora_rank, kv_format):
    first_gap = torch.where(indices < 0, torch.arange(indices.shape[1]), indices.shape[1]).min(dim=1).values
    kept = torch.arange(indices.shape[1])[None, :] < first_gap[:, None]
    return reference.sparse_mla(
        q,
        kv_cache,
        torch.where(kept, indices, -1),
        softmax_scale=softmax_scale,
        kv_lora_rank=kv_lora_rank,
        kv_format=kv_format,
    )


def apply_token_bitmask(logits, bitmask):
    token = torch.arange(logits.shape[1])
    allowed = (bitmask.long()[:, token // 32] >> (31 - token % 32)) & 1 == 1
    return logits.masked_fill(~allowed, float("-inf"))


def hc_post(block_out, streams, post, comb):
    mixed = torch.matmul(comb, streams.float())
    return (post.unsqueeze(-1) * block_out.float().unsqueeze(1) + mixed).to(streams.dtype)


def write_kv_cache(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format):
    as_if_contiguous = torch.as_strided(slot_mapping, slot_mapping.shape, (1,), slot_mapping.storage_offset())
    reference_attention.write_kv_cache(
        latent, kv_cache, as_if_contiguous, kv_lora_rank=kv_lora_rank, kv_format=kv_format
    )


@deepinfer.hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name="example_buggy", device_type="cpu", probe=lambda: (True, "runs on any CPU"), version="0.1.0"
    )


@deepinfer.hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    return [
        OpImpl("mla_decode", "example_buggy", "torch", mla_decode),
        OpImpl("gemm", "example_buggy", "torch", gemm, supports=correct.gemm_supports),
        OpImpl("rms_norm", "example_buggy", "torch", rms_norm, batch_invariant=True),
        OpImpl("indexer_topk", "example_buggy", "torch", indexer_topk),
        OpImpl("sparse_mla", "example_buggy", "torch", sparse_mla),
        OpImpl("apply_token_bitmask", "example_buggy", "torch", apply_token_bitmask),
        OpImpl("hc_post", "example_buggy", "torch", hc_post),
        OpImpl("write_kv_cache", "example_buggy", "torch", write_kv_cache),
    ]
