"""Automatic prefix caching: the page allocator's keys, references and eviction, and the engine with caching on
against the engine with caching off (the oracle): the same tokens and log-probabilities bit for bit in
batch-invariant mode, with far fewer prompt tokens prefilled, through chunked prefill, preemption (swap and
recomputation), prompt log-probabilities and DeepSeek-V3.2's sparse attention."""

from __future__ import annotations

import os

import pytest
import torch
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse)

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.block_manager import BlockAllocator, snapshot_key
from deepinfer.model.host_cache import HostPageCache
from deepinfer.model.sequence import Sequence

VOCAB = 258  # the small checkpoints' byte-level vocabulary


def seq(tokens: list[int], n: int = 0) -> Sequence:
    return Sequence(str(n), n, tokens, SamplingParams(), seed=0)


# --- the allocator ---


def test_registered_pages_are_shared_by_reference_and_kept_after_their_owner_ends():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    owner = seq(list(range(10, 24)))  # 14 tokens: 3 full pages and 2 tokens
    alloc.grow(owner, 14)
    alloc.register(owner, 14)
    assert alloc.num_cached == 3 and alloc.num_free == 4
    reader = seq([*range(10, 22), 99, 98])  # the same first 3 pages, then other tokens
    assert alloc.match(reader, max_tokens=13, align=4) == 12
    assert reader.block_table == owner.block_table[:3] and alloc.num_free == 4, "shared, not copied"
    alloc.release(owner)
    assert alloc.num_free == 5, "only the owner's unshared page comes back"
    alloc.release(reader)
    assert alloc.num_free == 8 and alloc.num_cached == 3, "free, but still registered"
    again = seq(list(range(10, 30)))
    assert alloc.match(again, max_tokens=19, align=4) == 12 and alloc.num_free == 5
    pages = list(again.block_table)
    alloc.release(again)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(pages[:1])


def test_keys_chain_over_the_whole_prefix_and_matching_stops_at_the_first_miss():
    alloc = BlockAllocator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    alloc.grow(a, 9)
    alloc.register(a, 9)
    other_start = seq([0, 2, 3, 4, 5, 6, 7, 8, 9])  # its second page has a's tokens, after another first page
    assert alloc.match(other_start, max_tokens=8, align=4) == 0 and other_start.block_table == []
    assert alloc.match(seq([1, 2, 3, 4, 5, 6, 7, 0, 9]), max_tokens=8, align=4) == 4
    assert alloc.match(seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), max_tokens=8, align=8) == 8
    assert alloc.match(seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), max_tokens=7, align=4) == 4, "at most max_tokens"
    assert alloc.match(seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), max_tokens=8, align=12) == 0, "whole multiples of align"
    off = BlockAllocator(num_blocks=8, block_size=4)
    b = seq([1, 2, 3, 4, 5])
    off.grow(b, 5)
    off.register(b, 5)
    assert off.num_cached == 0 and off.match(seq([1, 2, 3, 4, 5]), 4, 4) == 0


def test_free_pages_are_reused_least_recently_freed_first_and_reuse_evicts():
    alloc = BlockAllocator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old, new = seq([1, 2, 3, 4]), seq([5, 6, 7, 8])
    for s in (old, new):
        alloc.grow(s, 4)
        alloc.register(s, 4)
    alloc.release(old)
    alloc.release(new)
    taker = seq([9, 9])
    alloc.grow(taker, 2)  # one page: the least recently freed, the older request's last page
    assert alloc.num_cached == 3
    assert alloc.match(seq([5, 6, 7, 8]), 4, 2) == 4, "the newer request's pages are whole"
    assert alloc.match(seq([1, 2, 3, 4]), 4, 2) == 2, "the older one lost its last page, not its first"
    alloc.reset()
    assert alloc.num_cached == 0 and alloc.num_free == 4


# --- the engine: caching on against caching off ---


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("small"), seed=int.from_bytes(os.urandom(2), "little"))


@pytest.fixture(scope="module")
def v32_ckpt(tmp_path_factory):
    return small_checkpoint(
        tmp_path_factory.mktemp("v32"),
        seed=int.from_bytes(os.urandom(2), "little"),
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        index_n_heads=8,
        index_head_dim=32,
        index_topk=6,
    )


def pair(path, backend, device, host_cache_gb: float = 0, **kw):
    kw = {"block_size": 8, "prefill_chunk_size": 32, "progress": False, "dtype": "float32"} | kw
    return (
        LLM(path, backend, device=device, enable_prefix_caching=True, host_cache_gb=host_cache_gb, **kw),
        LLM(path, backend, device=device, enable_prefix_caching=False, **kw),
    )


def shared_prefix_prompts(n: int, prefix: int, suffix: int, seed: int) -> list[list[int]]:
    (shared,) = random_prompts(VOCAB, [prefix], seed)
    return [shared + tail for tail in random_prompts(VOCAB, [suffix] * n, seed + 1)]


def same_outputs(a, b) -> bool:
    return all(
        x.outputs[0].token_ids == y.outputs[0].token_ids
        and x.outputs[0].logprobs == y.outputs[0].logprobs
        and x.outputs[0].finish_reason == y.outputs[0].finish_reason
        for x, y in zip(a, b, strict=True)
    )


def test_a_shared_prefix_across_64_requests_is_prefilled_once(ckpt, deepinfer_backend, deepinfer_device):
    on, off = pair(ckpt, deepinfer_backend, deepinfer_device, max_num_batched_tokens=512)
    prompts = shared_prefix_prompts(64, prefix=256, suffix=5, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    with deepinfer.batch_invariant():
        cached = on.generate(prompts, params)
        stats = dict(on.last_stats)
        plain = off.generate(prompts, params)
        again = on.generate(prompts[:3], params)  # the pages outlive their requests
    assert same_outputs(cached, plain)
    assert off.last_stats["prefilled_tokens"] == 64 * 261
    assert stats["prefilled_tokens"] == 261 + 63 * 5, "the 256-token prefix is computed once"
    assert [o.num_cached_tokens for o in cached] == [0] + [256] * 63
    assert stats["cached_prompt_tokens"] == 63 * 256
    assert on.engine.allocator.num_free == on.engine.allocator.num_blocks
    assert [o.num_cached_tokens for o in again] == [256] * 3 and same_outputs(again, plain[:3])


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_with_shared_pages_gives_the_uncached_outputs(ckpt, deepinfer_backend, deepinfer_device, mode):
    """A cache of 24 pages of 8 tokens for 6 requests of 70-token prompts growing by 60: dozens of preemptions while
    the first pages are shared."""
    on, off = pair(ckpt, deepinfer_backend, deepinfer_device, num_blocks=24, preemption_mode=mode)
    prompts = shared_prefix_prompts(6, prefix=64, suffix=6, seed=5)
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=0)] * 3 + [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, ignore_eos=True, logprobs=0) for s in range(3)
    ]
    with deepinfer.batch_invariant():
        cached = on.generate(prompts, params)
        plain = off.generate(prompts, params)
    assert on.engine.num_preemptions > 0
    assert same_outputs(cached, plain)
    assert sum(o.num_cached_tokens for o in cached) > 0
    assert on.engine.allocator.num_free == 24


def test_prompt_logprobs_requests_compute_their_whole_prompt(ckpt, deepinfer_backend, deepinfer_device):
    on, off = pair(ckpt, deepinfer_backend, deepinfer_device)
    prompts = shared_prefix_prompts(2, prefix=96, suffix=4, seed=7)
    with deepinfer.batch_invariant():
        on.generate(prompts[0], SamplingParams(max_tokens=2, temperature=0))
        params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, logprobs=0)
        cached = on.generate(prompts[1], params)[0]
        plain = off.generate(prompts[1], params)[0]
    assert cached.num_cached_tokens == 0
    assert cached.prompt_logprobs == plain.prompt_logprobs and cached.prompt_top_logprobs == plain.prompt_top_logprobs
    assert same_outputs([cached], [plain])


def test_sparse_attention_models_reuse_their_index_cache_pages(v32_ckpt, deepinfer_backend, deepinfer_device):
    on, off = pair(v32_ckpt, deepinfer_backend, deepinfer_device)
    prompts = shared_prefix_prompts(4, prefix=70, suffix=9, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    with deepinfer.batch_invariant():
        cached = on.generate(prompts, params)
        plain = off.generate(prompts, params)
    assert same_outputs(cached, plain)
    assert [o.num_cached_tokens for o in cached] == [0, 64, 64, 64]


def test_a_planted_wrong_page_is_caught(ckpt, deepinfer_backend, deepinfer_device, monkeypatch):
    """The comparison with caching off can fail: keys that leave out a page's last token hand a prompt that differs
    from a cached one only there the other prompt's pages, and its tokens change."""
    (first,) = random_prompts(VOCAB, [80], seed=11)
    second = list(first)
    second[31] = (first[31] + 1) % VOCAB  # the last token of the first chunk (pages of 8, chunks of 32)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    exact = BlockAllocator.page_keys

    def blind_to_the_last_token(self, s, num_pages):
        return [(k[0], k[1][:-1]) for k in exact(self, s, num_pages)]

    results = {}
    for name, keys in (("exact", exact), ("planted", blind_to_the_last_token)):
        monkeypatch.setattr(BlockAllocator, "page_keys", keys)
        on, off = pair(ckpt, deepinfer_backend, deepinfer_device)
        with deepinfer.batch_invariant():
            on.generate(first, params)
            cached = on.generate(second, params)
            plain = off.generate(second, params)
        results[name] = (cached[0].num_cached_tokens, same_outputs(cached, plain))
    assert results["exact"] == (0, True)
    assert results["planted"][0] == 32 and not results["planted"][1]


# --- the host tier ---


def host_tier(num_blocks: int, capacity: int, block_size: int = 4):
    """An allocator over one fake paged cache ([2 layers, num_blocks, block_size, 3]) whose every value names its
    page, with a host tier of ``capacity`` pages."""
    cache = torch.arange(num_blocks, dtype=torch.float32)[None, :, None, None].expand(2, -1, block_size, 3).clone()
    host = HostPageCache([cache], capacity)
    return BlockAllocator(num_blocks, block_size, enable_prefix_caching=True, host=host), cache, host


def test_evicted_pages_go_to_the_host_tier_and_come_back_on_a_hit():
    alloc, cache, host = host_tier(num_blocks=4, capacity=8)
    owner = seq(list(range(1, 13)))  # 3 full pages
    alloc.grow(owner, 12)
    alloc.register(owner, 12)
    contents = {i: float(b) for i, b in enumerate(owner.block_table)}  # what each prefix page holds
    alloc.release(owner)
    filler = seq([7] * 16)
    alloc.grow(filler, 16)  # every page handed out again: the three registered ones copied out first
    cache[:, filler.block_table] = -1.0  # and overwritten
    assert len(host) == 3 and host.saved == 3 and alloc.num_cached == 0
    alloc.release(filler)
    again = seq([*range(1, 13), 99])
    assert alloc.match(again, max_tokens=12, align=4) == 12
    assert host.loaded == 3 and alloc.num_cached == 3
    for i, page in enumerate(again.block_table):  # each fresh page holds its key's contents
        assert (cache[:, page] == contents[i]).all()
    assert alloc.match(seq(list(range(1, 13))), 12, 4) == 12 and host.loaded == 3, "now on the device"


def test_the_host_tier_drops_least_recently_used_keys_and_loads_whole_aligned_runs():
    alloc, _, host = host_tier(num_blocks=4, capacity=2)
    owner = seq(list(range(1, 13)))
    alloc.grow(owner, 12)
    alloc.register(owner, 12)
    alloc.release(owner)
    alloc.grow(seq([7] * 16), 16)  # three pages copied out into two slots: the first one (freed last) dropped
    assert len(host) == 2 and host.saved == 3
    assert alloc.match(seq(list(range(1, 13))), 12, 4) == 0, "the chain's first page is gone"
    assert alloc.num_free == 0 and host.loaded == 0
    alloc.reset()
    other = seq([5] * 4 + [6] * 4)  # two pages, copied out, then matched in runs of 8 tokens with no free page
    alloc.grow(other, 8)
    alloc.register(other, 8)
    alloc.release(other)
    alloc.grow(seq([8] * 16), 16)
    assert alloc.match(seq([5] * 4 + [6] * 4 + [1]), 8, 8) == 0 and host.loaded == 0, "no page free to load into"


class RecordingStream:
    """Stands for an accelerator stream: records what is asked of it in ``log``."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def __enter__(self):
        self.log.append(f"copy on {self.name}")

    def __exit__(self, *exc) -> None:
        pass


def test_host_copies_run_beside_the_steps_and_wait_only_where_a_running_step_may_touch_their_page(monkeypatch):
    """The orders ``host_cache.py`` states, on streams that record what they are asked: a copy of a page freed long
    ago does not wait for the steps, one of a page freed since the step before the one in flight does, and the
    step's stream waits for every copy before anything queued after them."""
    log: list[str] = []
    step_stream, copy_stream = RecordingStream("steps", log), RecordingStream("copies", log)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: step_stream)
    alloc, cache, host = host_tier(num_blocks=4, capacity=8)
    host.stream = copy_stream
    owner = seq(list(range(1, 9)))  # 2 full pages
    alloc.grow(owner, 8)
    alloc.register(owner, 8)
    contents = [float(b) for b in owner.block_table]
    alloc.release(owner)
    host.launched(), host.launched()  # two steps later, nothing that can still run touches those pages
    filler = seq([7] * 16)
    alloc.grow(filler, 16)  # every page handed out: the two registered ones copied out
    assert log == ["copy on copies", "copy on copies", "steps waits for copies"]
    cache[:, filler.block_table] = -1.0
    log.clear()
    alloc.release(filler)  # freed while the last step launched may still run
    again = seq([*range(1, 9), 99])
    assert alloc.match(again, max_tokens=8, align=4) == 8 and host.loaded == 2
    assert log == ["copies waits for steps", "copy on copies"] * 2 + ["steps waits for copies"]
    assert [float(cache[0, p, 0, 0]) for p in again.block_table] == contents
    alloc.release(again)
    other = seq(list(range(30, 38)))
    alloc.grow(other, 8)
    alloc.register(other, 8)
    host.launched()
    alloc.release(other)
    host.launched()  # freed before the step in flight was launched, after the one before it: may still be touched
    log.clear()
    alloc.grow(seq([8] * 16), 16)
    assert log.count("copies waits for steps") == 2 and log[-1] == "steps waits for copies"
    assert log.count("copy on copies") == 2


@pytest.mark.parametrize("model", ["v3", "v32"])
def test_a_prefix_evicted_to_host_memory_is_found_again(ckpt, v32_ckpt, deepinfer_backend, deepinfer_device, model):
    """16 device pages of 8 tokens: three 120-token requests after the first evict its 64-token prefix; the next
    request with that prefix finds it in the host tier (in two whole chunks), not with the device cache alone, and its
    outputs are bitwise those of caching off."""
    path = ckpt if model == "v3" else v32_ckpt
    kw = {"num_blocks": 16, "max_num_seqs": 1}
    on, off = pair(path, deepinfer_backend, deepinfer_device, host_cache_gb=0.01, **kw)
    device_only = LLM(path, deepinfer_backend, device=deepinfer_device, block_size=8, prefill_chunk_size=32,
                      progress=False, dtype="float32", **kw)  # fmt: skip
    first, second = shared_prefix_prompts(2, prefix=64, suffix=5, seed=13)
    fillers = random_prompts(VOCAB, [120] * 3, seed=14)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    with deepinfer.batch_invariant():
        for llm in (on, device_only):
            llm.generate(first, params)
            llm.generate(fillers, params)
        cached = on.generate(second, params)
        uncached = device_only.generate(second, params)
        plain = off.generate(second, params)
    assert uncached[0].num_cached_tokens == 0, "the device cache alone has lost the prefix"
    assert cached[0].num_cached_tokens == 64 and on.last_stats["host_cache"]["loaded_pages"] == 8
    assert same_outputs(cached, plain) and same_outputs(uncached, plain)


def test_a_planted_wrong_host_page_is_caught(ckpt, deepinfer_backend, deepinfer_device, monkeypatch):
    """The comparison can fail: a host tier that copies back another key's page changes the tokens."""
    exact = HostPageCache.load

    def neighbour(self, key, page):
        slots = list(self._slot_of)
        exact(self, slots[(slots.index(key) + 1) % len(slots)], page)

    monkeypatch.setattr(HostPageCache, "load", neighbour)
    on, off = pair(ckpt, deepinfer_backend, deepinfer_device, host_cache_gb=0.01, num_blocks=16, max_num_seqs=1)
    first, second = shared_prefix_prompts(2, prefix=64, suffix=5, seed=13)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    with deepinfer.batch_invariant():
        on.generate(first, params)
        on.generate(random_prompts(VOCAB, [120] * 3, seed=14), params)
        cached = on.generate(second, params)
        plain = off.generate(second, params)
    assert cached[0].num_cached_tokens == 64 and not same_outputs(cached, plain)


def test_host_cache_arguments_are_checked(ckpt):
    from deepinfer import InputError

    with pytest.raises(InputError, match="host_cache_gb"):
        LLM(ckpt, "reference", host_cache_gb=-1, progress=False)
    with pytest.raises(InputError, match=r"host_cache_bytes.*prefix caching off"):
        LLM(ckpt, "reference", host_cache_gb=0.01, enable_prefix_caching=False, progress=False)
    with pytest.raises(InputError, match="at least one page"):
        LLM(ckpt, "reference", host_cache_gb=1e-9, progress=False)


def test_a_key_on_both_tiers_ends_the_host_run():
    """A prefix whose second page is only in the host tier while its third is on the device and in the host tier:
    the second is loaded, the run stops at the third (a key is never registered to two pages), and every page is
    evicted cleanly afterwards."""
    alloc, _, host = host_tier(num_blocks=6, capacity=8)
    prompt = list(range(1, 13))  # 3 pages
    owner = seq(prompt)
    alloc.grow(owner, 12)
    alloc.register(owner, 12)
    alloc.release(owner)
    filler = seq([7] * 24)
    alloc.grow(filler, 24)  # all three copied out
    alloc.release(filler)
    back = seq(prompt)
    assert alloc.match(back, 12, 4) == 12 and host.loaded == 3  # all three back on the device
    second = back.block_table[1]
    alloc.release(back)
    alloc._free.move_to_end(second, last=False)  # the next page handed out: only the second is evicted
    taker = seq([8] * 4)
    alloc.grow(taker, 4)
    assert alloc.num_cached == 2 and len(host) == 3
    again = seq(prompt)
    assert alloc.match(again, 12, 4) == 8, "the first page from the device, the second from the host tier"
    assert host.loaded == 4 and len(set(alloc._page_of.values())) == len(alloc._page_of) == 3
    alloc.release(again)
    alloc.release(taker)
    alloc.grow(seq([9] * 24), 24)  # every page handed out: each registered one evicted exactly once
    assert alloc.num_cached == 0


def test_state_pages_are_reused_from_snapshots_and_a_snapshot_goes_whole():
    """With 2 state pages a sequence and reuse in steps of 8 tokens: token pages are registered and its state pages
    copied to a snapshot only at multiples of 8 that the state pages are at; a match gets the prefix's token pages
    and fresh state pages filled from the snapshot; handing out one snapshot page forgets the whole snapshot."""
    copies = []
    alloc = BlockAllocator(
        12, 4, enable_prefix_caching=True, seq_pages=2, reuse_tokens=8, copy_pages=lambda s, d: copies.append((s, d))
    )
    owner = seq(list(range(1, 14)))  # 13 tokens: 2 state pages and 4 token pages
    alloc.grow(owner, 13)
    alloc.register(owner, 12)  # not a multiple of 8: nothing kept
    alloc.register(owner, 8, state_tokens=12)  # the state pages hold 12 tokens (a chunk past the prompt): nor here
    assert alloc.num_cached == 0 and copies == []
    alloc.register(owner, 8, state_tokens=8)
    assert alloc.num_cached == 2 and copies[0][0] == owner.block_table[:2]
    snapshot, token_pages = copies[0][1], owner.block_table[2:4]
    alloc.release(owner)
    again = seq(list(range(1, 14)))
    assert alloc.match(again, 12, 8) == 8
    assert copies[1] == (snapshot, again.block_table[:2]) and again.block_table[2:] == token_pages
    alloc.release(again)
    alloc._free.move_to_end(snapshot[1], last=False)  # the next page handed out is one of the snapshot's
    alloc.allocate(1)
    assert alloc.match(seq(list(range(1, 14))), 12, 8) == 0, "the token pages remain, their state does not"
    assert alloc.num_cached == 2


def state_pages_with_host_tier(num_blocks: int, host_pages: int):
    """A random paged cache ``[2 layers, num_blocks, 4, 3]``, a host tier of ``host_pages`` pages over it and an
    allocator of 2 state pages a sequence (snapshots every 8 tokens) that copies pages in it."""
    cache = torch.randn(2, num_blocks, 4, 3)

    def copy_pages(src, dst):
        cache[:, dst] = cache[:, src]

    host = HostPageCache([cache], host_pages)
    alloc = BlockAllocator(
        num_blocks, 4, enable_prefix_caching=True, seq_pages=2, host=host, reuse_tokens=8, copy_pages=copy_pages
    )
    return cache, host, alloc


def test_a_snapshot_and_its_token_pages_go_to_the_host_tier_and_come_back_into_the_right_pages():
    """With 2 state pages a sequence and a host tier: handing out the pages of a prefix and of its snapshot copies
    each snapshot page out under its own key; a match then loads the snapshot's pages, in order, into the fresh state
    pages and the token pages into fresh pages; a later match shares those token pages and loads the snapshot
    again; with too few free pages there is no hit (and no error)."""
    cache, host, alloc = state_pages_with_host_tier(10, 16)
    loads = []
    real_load = host.load
    host.load = lambda key, page: (loads.append((key, page)), real_load(key, page))
    prompt = list(range(1, 14))
    owner = seq(prompt)  # 2 state pages and 4 token pages
    alloc.grow(owner, 13)
    alloc.register(owner, 8)
    state, tokens = cache[:, owner.block_table[:2]].clone(), cache[:, owner.block_table[2:4]].clone()
    keys = alloc.page_keys(owner, 2)
    cache[:, owner.block_table[:2]] = torch.randn(2, 2, 4, 3)  # the sequence goes on: its state changes
    alloc.release(owner)
    filler = seq([7] * 32)
    alloc.grow(filler, 32)  # every page handed out: 2 token pages and the 2 of the snapshot copied out first
    cache[:] = torch.randn(cache.shape)
    assert host.saved == 4 and alloc.num_cached == 0 and not alloc._snapshot_of
    assert all(k in host for k in [*keys, snapshot_key(keys[1], 0), snapshot_key(keys[1], 1)])
    alloc.release(filler)
    again = seq(prompt)
    assert alloc.match(again, max_tokens=12, align=8) == 8
    table = again.block_table
    assert sorted(loads, key=str) == sorted(
        [(snapshot_key(keys[1], 0), table[0]), (snapshot_key(keys[1], 1), table[1]),
         (keys[0], table[2]), (keys[1], table[3])], key=str)  # fmt: skip
    assert torch.equal(cache[:, table[:2]], state) and torch.equal(cache[:, table[2:]], tokens)
    assert alloc.num_cached == 2 and len(set(table)) == 4
    cache[:, table[:2]] = torch.randn(2, 2, 4, 3)  # the sequence goes on from there
    alloc.release(again)
    loads.clear()
    third = seq(prompt)
    assert alloc.match(third, max_tokens=12, align=8) == 8
    assert third.block_table[2:] == table[2:], "the token pages are on the device now"
    assert loads == [(snapshot_key(keys[1], 0), third.block_table[0]), (snapshot_key(keys[1], 1), third.block_table[1])]
    assert torch.equal(cache[:, third.block_table[:2]], state)
    alloc.release(third)
    taker = seq([8] * 25)  # 2 state pages and 7 token pages: one page left free, fewer than the state pages
    alloc.grow(taker, 25)
    loads.clear()
    assert alloc.match(seq(prompt), max_tokens=12, align=8) == 0 and loads == [] and alloc.num_free == 1


def test_with_too_few_free_pages_for_the_longest_prefix_from_the_host_tier_a_shorter_one_is_loaded():
    """A prefix of 4 pages with snapshots after 2 and 4, all in the host tier, and 5 free pages: the whole prefix
    needs 2 state pages and 4 token pages, so the prefix up to the first snapshot (2 and 2) is loaded instead."""
    _, host, alloc = state_pages_with_host_tier(12, 32)
    prompt = list(range(1, 18))
    owner = seq(prompt)  # 2 state pages and 5 token pages
    alloc.grow(owner, 17)
    alloc.register(owner, 8)
    alloc.register(owner, 16)  # two snapshots: 11 pages in all
    keys = alloc.page_keys(owner, 4)
    alloc.release(owner)
    filler = seq([7] * 40)
    alloc.grow(filler, 40)  # every page handed out: 4 token pages and 2 snapshots copied out
    assert host.saved == 8 and alloc.num_cached == 0
    alloc.release(filler)
    taker = seq([8] * 20)
    alloc.grow(taker, 20)
    loads = []
    real_load = host.load
    host.load = lambda key, page: (loads.append((key, page)), real_load(key, page))
    again = seq(prompt)
    assert alloc.match(again, max_tokens=16, align=8) == 8 and alloc.num_free == 1
    assert sorted(loads, key=str) == sorted(
        zip([snapshot_key(keys[1], 0), snapshot_key(keys[1], 1), *keys[:2]], again.block_table), key=str
    )
