"""Prefix caching with a host tier when the reuse unit (``lcm(chunk_size, block_size)``, ``align``) spans several
pages and a cached prefix is split between the tiers at a page that does not end a whole ``align``: ``match``
still gives a prompt a prefix of whole ``align``s (the scheduler then prefills exactly the chunks a miss computes),
loading the host tier's part while free pages last. On DeepSeek-V3.2 the outputs of such a hit are bitwise those of
caching off, in batch-invariant mode."""

from __future__ import annotations

import pytest
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from test_prefix_caching import host_tier, same_outputs, seq

import deepinfer
from deepinfer.model import LLM, SamplingParams


def split_prefix(free: int, capacity: int, register_taker: bool = False):
    """An allocator (pages of 4 tokens) with ``free`` free pages besides a registered 6-page prefix of ``prompt``
    whose first 2 pages are on the device (free, registered) and the other 4 in the host tier of ``capacity``
    pages (an owner's last pages are evicted first), and ``taker``, the sequence that evicted them (6 pages)."""
    alloc, _, host = host_tier(num_blocks=8 + free, capacity=capacity)
    spare = seq([8] * 4 * free)
    alloc.grow(spare, 4 * free)
    prompt = list(range(1, 26))
    owner = seq(prompt)
    alloc.grow(owner, 24)
    alloc.register(owner, 24)
    alloc.release(owner)
    taker = seq([7] * 24)
    alloc.grow(taker, 24)
    if register_taker:
        alloc.register(taker, 24)
    alloc.release(spare)
    assert alloc.num_cached == 2 + 6 * register_taker and len(host) == 4
    return alloc, host, prompt, taker


@pytest.mark.parametrize(("free", "tokens", "loaded"), [(4, 24, 4), (1, 12, 1), (0, 0, 0)])
def test_a_prefix_split_between_the_tiers_inside_an_align_is_reused_in_whole_aligns(free, tokens, loaded):
    """2 device pages and 4 host pages, in aligns of 3 pages: with a free page for every host page the whole prefix
    (6 pages), with one only the first align (the 2 device pages and 1 loaded), with none nothing (the 2 device
    pages are not a whole align)."""
    alloc, host, prompt, _ = split_prefix(free, capacity=16)
    again = seq(prompt)
    assert alloc.match(again, max_tokens=24, align=12) == tokens and host.loaded == loaded
    assert len(again.block_table) == tokens // 4 and alloc.num_free == 2 + free - tokens // 4


def test_a_host_tier_that_loses_its_part_of_the_prefix_leaves_no_partial_align():
    """The allocation for the host tier's 4 pages evicts 4 registered device pages into a host tier of 4 slots,
    which drops the keys about to be loaded: nothing is loaded, and the 2 device pages, not a whole align, are not
    reused either."""
    alloc, host, prompt, taker = split_prefix(0, capacity=4, register_taker=True)
    alloc.release(taker)
    again = seq(prompt)
    assert alloc.match(again, max_tokens=24, align=12) == 0 and host.loaded == 0
    assert again.block_table == [] and alloc.num_free == 8


def test_sparse_attention_model_reuses_a_split_prefix_in_whole_chunks(tmp_path):
    """DeepSeek-V3.2 (6 tokens kept per query, prompts of 60 and 69 tokens), pages of 8, chunks of 12 (aligns of 24
    tokens), 12 device pages: a 79-token request after the first evicts all but the first 2 of its 7 prefix pages
    to the host tier. A request continuing the prefix reuses 48 tokens (2 device pages and 4 loaded), a multiple of
    the chunk, and its outputs are bitwise those of caching off."""
    path = small_checkpoint(
        tmp_path,
        seed=1,
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        index_n_heads=8,
        index_head_dim=32,
        index_topk=6,
    )
    (prefix,) = random_prompts(258, [60], seed=5)
    prompt = prefix + random_prompts(258, [9], seed=6)[0]
    kw = dict(dtype="float32", block_size=8, prefill_chunk_size=12, max_num_seqs=1, num_blocks=12, progress=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    with deepinfer.batch_invariant():
        on = LLM(path, "reference", host_cache_gb=0.01, **kw)
        off = LLM(path, "reference", enable_prefix_caching=False, **kw)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        on.generate([prefix], one)
        on.generate(random_prompts(258, [79], seed=7), one)
        cached = on.generate([prompt], params)
        plain = off.generate([prompt], params)
    assert cached[0].num_cached_tokens == 48 and on.last_stats["host_cache"]["loaded_pages"] == 4
    assert same_outputs(cached, plain)
