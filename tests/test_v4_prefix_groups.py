"""Prefix caching on DeepSeek-V4 where a token page's compressed entries depend on tokens of the pages after it.

A compressed entry lives in the token page of its window's first token (``V4CacheLayout``), so where the page size is
not a multiple of a compression rate (V4-Flash's pages of 64 tokens against its rate of 128, or pages of 4 against
rates 3 and 6) a page holds entries whose windows end in the next page: its contents are a function of the tokens up
to the end of its group of ``reuse_tokens`` tokens, not of its own prefix only. Two prompts that share a first page
and differ within the rest of its group have different first pages; a later request repeating the second prompt must
get the second prompt's pages, and the tokens and log-probabilities of a run with caching off (batch-invariant mode,
bit for bit).
"""

from __future__ import annotations

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.block_manager import BlockAllocator
from deepinfer.model.sequence import Sequence

FLASH_RATES = dict(  # V4-Flash's rates and its default pages of 64 tokens: a window of 128 spans two pages
    num_hidden_layers=3,
    layer_types=[v4.CSA, v4.HCA, v4.SLIDING],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={v4.CSA: 4, v4.HCA: 128},
    sliding_window=8,
    index_topk=3,
    hc_mult=2,
)


def seq(tokens: list[int], n: int = 0) -> Sequence:
    return Sequence(str(n), n, tokens, SamplingParams(), seed=0)


def test_a_page_is_shared_only_with_the_rest_of_its_group():
    """Pages of 4 tokens, reuse in groups of 8 (two pages), 2 state pages: a prompt that shares only the first page
    with a registered one registers its own first page too, and a match of it gets that page, not the other's."""
    alloc = BlockAllocator(20, 4, enable_prefix_caching=True, seq_pages=2, reuse_tokens=8, copy_pages=lambda s, d: None)
    first, second = seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), seq([1, 2, 3, 4, 0, 6, 7, 8, 9], 1)
    for s in (first, second):
        alloc.grow(s, 9)
        alloc.register(s, 8)
    assert alloc.num_cached == 4, "both groups of two pages are kept"
    again = seq([1, 2, 3, 4, 0, 6, 7, 8, 9], 2)
    assert alloc.match(again, max_tokens=8, align=8) == 8
    assert again.block_table[2:] == second.block_table[2:4]
    assert alloc.match(seq([1, 2, 3, 4, 9, 9, 9, 9, 9], 3), max_tokens=8, align=8) == 0


@pytest.mark.parametrize(
    "config, block_size, chunk, shared, length",
    [(v4.CONFIGS["plain"], 4, 12, 4, 20), (FLASH_RATES, 64, 128, 64, 150)],
    ids=["rates-3-6-pages-of-4", "rates-4-128-pages-of-64"],
)
def test_a_repeated_prompt_gets_its_own_pages_not_a_neighbours(
    config, block_size, chunk, shared, length, tmp_path, deepinfer_backend, deepinfer_device
):
    """Prompts ``x`` and ``y`` share their first page, then differ within its group; ``x`` runs, then ``y`` twice:
    the second ``y`` finds its prefix cached and gives bitwise what it gives with caching off."""
    v4.v4_checkpoint(tmp_path, seed=5, **config)
    g = torch.Generator().manual_seed(0)
    common = torch.randint(2, 160, (shared,), generator=g).tolist()
    x, y = (common + torch.randint(2, 160, (length - shared,), generator=g).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    pages = v4.state_pages(tmp_path, block_size=block_size) + -(-(length + 6) // block_size)
    kw = dict(dtype="float32", block_size=block_size, prefill_chunk_size=chunk, num_blocks=4 * pages, progress=False)

    def result(out):
        return out.outputs[0].token_ids, out.outputs[0].logprobs

    with deepinfer.batch_invariant():
        off = LLM(tmp_path, deepinfer_backend, device=deepinfer_device, enable_prefix_caching=False, **kw)
        want = result(off.generate([y], params)[0])
        on = LLM(tmp_path, deepinfer_backend, device=deepinfer_device, **kw)
        on.generate([x], params)
        on.generate([y], params)
        (again,) = on.generate([y], params)
    assert again.num_cached_tokens == (length - 1) // chunk * chunk > 0
    assert result(again) == want
