"""The DeepSeek Sparse Attention references against independent formulations, and the conformance comparison of
``indexer_topk`` against the bugs it must catch."""

from __future__ import annotations

import pytest
import torch

from deepinfer import InputError, ops, use
from deepinfer.conformance.cases import Gen
from deepinfer.conformance.sparse_attention import _compare_topk, _index_cache, _topk_case
from deepinfer.conformance.tolerances import tolerance
from deepinfer.index_cache import allocate_index_cache, pack_fp8_ds_index, read_keys, unpack_fp8_ds_index
from deepinfer.kv_cache import allocate_kv_cache


@pytest.fixture(autouse=True)
def reference_backend():
    with use("reference"):
        yield


def _brute_force_topk(kw: dict) -> list[list[int]]:
    """Per query, the slots of its top positions by fp64 scores computed element by element (no ties: random
    data), ascending by position."""
    q, w, cache, table = kw["q"].double(), kw["weights"].double(), kw["index_cache"], kw["block_table"]
    block_size, head_dim, topk = cache.shape[1], q.shape[2], kw["topk"]
    cu, lens = kw["cu_seqlens_q"].tolist(), kw["seq_lens"].tolist()
    out = []
    for b, n in enumerate(lens):
        length = cu[b + 1] - cu[b]
        slots = [int(table[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        keys = read_keys(cache, torch.tensor(slots, dtype=torch.long), head_dim).double()
        for i in range(length):
            t, visible = cu[b] + i, n - length + i + 1
            scores = [
                sum(float(w[t, h]) * max(0.0, float(q[t, h] @ keys[p])) for h in range(q.shape[1]))
                for p in range(visible)
            ]
            best = sorted(sorted(range(visible), key=lambda p: -scores[p])[:topk])
            out.append([slots[p] for p in best] + [-1] * (topk - len(best)))
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_index"])
def test_indexer_topk_matches_brute_force(fmt):
    case = _topk_case([1, 4, 1, 0], [23, 30, 3, 2], 3, 128, 7, 16, fmt)
    kw = case.make(Gen(5, "cpu"))
    assert ops.indexer_topk(**kw).tolist() == _brute_force_topk(kw)


def test_indexer_ties_go_to_the_lower_position():
    cache = allocate_index_cache(1, 16, head_dim=32)
    keys = torch.randn(3, 32)
    ops.write_index_cache(keys[[0, 1, 0, 2, 0, 1]], cache, torch.arange(6))  # positions 0, 2, 4 share a key
    q = keys[[0]].unsqueeze(0).to(torch.bfloat16)  # [1, 1, 32]: scores the shared key highest
    table, cu = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    out = ops.indexer_topk(q, torch.ones(1, 1), cache, table, cu, torch.tensor([6], dtype=torch.int32), topk=2)
    assert out.tolist() == [[0, 2]]


def test_sparse_mla_over_every_position_is_mla_decode():
    """Listing every cached position of a sequence, in order, is dense absorbed attention."""
    g = Gen(3, "cpu")
    seq_lens = [37, 5, 64]
    block_size, rank, rope = 16, 128, 32
    cache = allocate_kv_cache(12, block_size, kv_lora_rank=rank, rope_dim=rope)
    cache.copy_(g.randn(*cache.shape))
    table = torch.stack([g.perm(12)[:4] for _ in seq_lens]).to(torch.int32)
    q = g.randn(len(seq_lens), 1, 8, rank + rope)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    dense = ops.mla_decode(q, cache, table, lens, softmax_scale=0.1, kv_lora_rank=rank)
    indices = torch.full((len(seq_lens), 64), -1, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        p = torch.arange(n)
        indices[b, :n] = (table[b, p // block_size] * block_size + p % block_size).to(torch.int32)
    sparse = ops.sparse_mla(q[:, 0], cache, indices, softmax_scale=0.1, kv_lora_rank=rank)
    torch.testing.assert_close(sparse[0].float(), dense[0][:, 0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(sparse[1], dense[1][:, 0], rtol=1e-5, atol=1e-5)


def test_sparse_mla_with_nothing_listed_is_zero_with_minus_infinite_lse():
    cache = allocate_kv_cache(2, 16, kv_lora_rank=64, rope_dim=32)
    cache.fill_(float("nan"))  # nothing may be read
    none = torch.full((2, 8), -1, dtype=torch.int32)
    out, lse = ops.sparse_mla(torch.randn(2, 4, 96).bfloat16(), cache, none, softmax_scale=0.1, kv_lora_rank=64)
    assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == float("-inf"))


def test_fp8_ds_index_records():
    k = torch.randn(5, 256) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    packed = pack_fp8_ds_index(k)
    assert packed.shape == (5, 256 + 8) and packed.dtype == torch.uint8
    scales = packed[:, 256:].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    back = unpack_fp8_ds_index(packed, 256)
    assert torch.all((back - k).abs() <= k.abs() * 2**-4 + scales.repeat_interleave(128, 1) * 2**-9)


def test_topk_comparison_tolerates_near_ties_only():
    case = _topk_case([1, 9], [300, 60], 8, 64, 16, 16, "bf16")
    kw = case.make(Gen(7, "cpu"))
    ref = ops.indexer_topk(**kw)
    tol = tolerance("indexer_topk", "bf16")[0]
    assert _compare_topk(ref.clone(), ref, kw) == 0.0

    # Another choice at the boundary: swap the last kept position of a row for the best position left out.
    from deepinfer.reference.sparse_attention import indexer_scores, sequence_slots

    slots = sequence_slots(kw["block_table"][0], 300, 16)
    scores = indexer_scores(kw["q"][:1], kw["weights"][:1], read_keys(kw["index_cache"], slots, 64), 300)[0]
    order = scores.argsort(descending=True)
    swapped = ref.clone()
    kept = sorted([*order[:15].tolist(), int(order[16])])
    swapped[0] = slots[kept].to(torch.int32)
    gap = float(scores[order[15]] - scores[order[16]]) / float(scores.abs().max())
    assert _compare_topk(swapped, ref, kw) == pytest.approx(gap, rel=1e-5)

    # Weights ignored (a real bug) moves whole rows far past the tolerance.
    ignored = ops.indexer_topk(**{**kw, "weights": torch.ones_like(kw["weights"])})
    assert _compare_topk(ignored, ref, kw) > 10 * tol

    # One position too many visible (a causal off-by-one): some row keeps a position it cannot see.
    ahead = ops.indexer_topk(**{**kw, "seq_lens": kw["seq_lens"] + 1, "block_table": kw["block_table"]})
    assert _compare_topk(ahead, ref, kw) == float("inf")


def test_indexer_rejects_sequences_with_fewer_cached_tokens_than_queries():
    cache, table = _index_cache(Gen(0, "cpu"), [4], 16, 32, "bf16")
    with pytest.raises(InputError, match="seq_lens"):
        ops.indexer_topk(
            torch.randn(5, 2, 32),
            torch.randn(5, 2),
            cache,
            table,
            torch.tensor([0, 5], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32),
            topk=2,
        )
