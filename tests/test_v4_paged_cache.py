"""DeepSeek-V4's caches in the engine's pages (``V4CacheLayout``): against transformers' fp32 oracle, bitwise under
batching, preemption and prefix caching (from state snapshots), and counted in the engine's budget.

The pages a sequence holds are scattered (a shuffled pool shared by all sequences) and every byte of the pool starts
as NaN, so a value read from anywhere but where it was written (a wrong page, slot, ring row or state offset) spoils
the log-probabilities. Page sizes that are not multiples of the compression rates (3 tokens against rates 4 / 8, 5
against 3 / 6) put entries at every slot of a page, in pages whose slots are not all used.
"""

from __future__ import annotations

import dataclasses
import random
import traceback
from contextlib import contextmanager

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread, replay_graphs_on_cpu  # noqa: F401 (autouse fixture)
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import dispatch
from deepinfer.model import cuda_graphs
from deepinfer.model.deepseek_v4 import V4State
from deepinfer.selection import use
from deepinfer.validation import value_checks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return v4.checkpoint_maker(tmp_path_factory, "v4p", 21)


@pytest.fixture
def load(deepinfer_backend, deepinfer_device):
    def make(path):
        with use(deepinfer_backend):
            import deepinfer

            device = deepinfer_device or deepinfer.current_backend().device_type
            return v4.DeepseekV4.load(v4.V4Checkpoint.open(path), dtype=torch.float32, device=device)

    with use(deepinfer_backend):
        yield make


class HostSyncs(TorchDispatchMode):
    """Records the model's own calls, outside ``deepinfer.ops`` implementations (backend kernels capture as they
    may), that read a device value on the host (``.item()``, ``nonzero``, boolean-mask indexing, ...) or build a
    tensor from host data: in a CUDA graph the first waits for the device (capture fails) and the second is baked
    into the graph as it was at capture. Copies to the host (``.tolist()``, ``.cpu()``) of CPU tensors dispatch
    nothing here: the GPU test of the captured step covers them."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave", "lift_fresh", "equal")

    def __init__(self, monkeypatch):
        super().__init__()
        self.calls: list[str] = []
        self.in_op = 0
        resolve = dispatch.resolve

        def marked(op, kwargs, backend=None):
            impl, fallback = resolve(op, kwargs, backend)

            def fn(**kw):
                self.in_op += 1
                try:
                    return impl.fn(**kw)
                finally:
                    self.in_op -= 1

            return dataclasses.replace(impl, fn=fn), fallback

        monkeypatch.setattr(dispatch, "resolve", marked)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_op:  # backend kernels capture as they may
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        masks = name.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for a in args
            if isinstance(a, (list, tuple))
            for i in a
        )
        if masks or any(name.startswith(s) for s in self.SYNCING):
            where = [f for f in traceback.extract_stack() if "/model/" in f.filename]
            self.calls.append(f"{name} at {where[-1].name}:{where[-1].lineno}" if where else name)
        return func(*args, **(kwargs or {}))


def paged_states(model, block_size: int, lengths: list[int], seed: int) -> list[V4State]:
    """States for sequences of ``lengths`` tokens on one pool of NaN-filled pages, each holding a shuffled share."""
    model.use_pages(block_size)
    layout = model.cache_layout()
    need = [layout.pages_for(n) for n in lengths]
    total = sum(need) + 3
    pages = torch.full((total, layout.page_bytes), 0xFF, dtype=torch.uint8, device=model.device)  # all NaN
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    states, used = [], 0
    for n in need:
        states.append(V4State(layout, pages, order[used : used + n], 0, model.dtype))
        used += n
    return states


@pytest.mark.parametrize(
    "name, block_size, chunk", [("yarn", 3, None), ("yarn", 5, 4), ("plain", 5, 1), ("plain", 64, 11)]
)
def test_paged_prompt_logprobs_match_transformers(name, block_size, chunk, checkpoints, load):
    path, oracle = checkpoints(name)
    model = load(path)
    ps = v4.prompts(31)
    states = iter(paged_states(model, block_size, [len(p) for p in ps], seed=block_size))
    model.new_state = lambda: next(states)  # the cross-check's sequences on the shared pages
    assert v4.prompt_errors(model, oracle, ps, chunk) < v4.TOL


@pytest.mark.parametrize("name, block_size", [("yarn", 3), ("plain", 5), ("yarn", 8)])
def test_paged_greedy_decode_matches_transformers(name, block_size, checkpoints, load, monkeypatch):
    """Several sequences decode together on scattered pages, one token each a step: every layer reads and writes
    all their caches at once (``DecodeRows``); every step against the oracle."""
    path, oracle = checkpoints(name)
    model, steps = load(path), 12
    ps = [[5], [6, 7], *v4.prompts(32)[1:]]  # (the first compressed windows of the short ones close in decode)
    states = paged_states(model, block_size, [len(p) + steps for p in ps], seed=5)
    batched = []
    decode_pools = v4.deepseek_v4.V4Attention._decode_pools
    monkeypatch.setattr(v4.deepseek_v4.V4Attention, "_decode_pools", lambda *a: batched.append(1) or decode_pools(*a))
    lp = v4.run(model, states, ps)
    ends = torch.tensor([len(p) for p in ps]).cumsum(0) - 1
    ours = [[int(lp[e].argmax())] for e in ends]
    rows = [[lp[e]] for e in ends]
    for _ in range(steps - 1):
        lp = v4.run(model, states, [[o[-1]] for o in ours])
        for b in range(len(ps)):
            ours[b].append(int(lp[b].argmax()))
            rows[b].append(lp[b])
    assert len(batched) == (steps - 1) * len(model.layers)
    for p, gen, got in zip(ps, ours, rows):
        ref = v4.oracle_logprobs(oracle, p + gen)[len(p) - 1 :][:steps]
        assert (torch.stack(got) - ref).abs().max().item() < v4.TOL
        for j, t in enumerate(gen):
            assert int(ref[j].argmax()) == t or float(ref[j].max() - ref[j][t]) < v4.TOL


def _requests(n: int, seed: int):
    from deepinfer.model import SamplingParams

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(2, 160, (rng.randint(1, 40),), generator=g).tolist() for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(4, 14),
            temperature=0.0 if i % 2 else 1.0,
            top_k=rng.choice([0, 5]),
            seed=rng.randint(0, 1 << 40),
            ignore_eos=True,
            logprobs=1,
        )
        for i in range(n)
    ]
    return ps, params


def _result(out):
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.outputs[0].top_logprobs


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_decode_steps_of_all_sequences_at_once_give_the_bits_of_one_at_a_time(
    kv_format, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device
):
    """Batch-invariant mode: 12 requests served with decode steps that read and write every sequence's caches at
    once (``DecodeRows``) give bitwise the tokens and log-probabilities of steps that go sequence by sequence."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    path, _ = checkpoints("yarn")
    ps, params = _requests(12, seed=43)
    ps[:3] = [[7], [9, 11], [13, 15, 17]]  # their first compressed windows close in decode steps
    kw = dict(block_size=4, max_num_seqs=12, kv_format=kv_format)
    batched = [_result(o) for o in v4.serve(path, deepinfer_backend, deepinfer_device, **kw).generate(ps, params)]
    post_init = v4.deepseek_v4.V4Batch.__post_init__

    def one_at_a_time(batch):
        post_init(batch)
        batch.decode = None

    monkeypatch.setattr(v4.deepseek_v4.V4Batch, "__post_init__", one_at_a_time)
    looped = [_result(o) for o in v4.serve(path, deepinfer_backend, deepinfer_device, **kw).generate(ps, params)]
    assert batched == looped


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_stress_each_request_bitwise_its_run_alone(
    mode, kv_format, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device
):
    """Batch-invariant mode, pages of 3 tokens, room for about two sequences: 14 requests preempt each other again
    and again (their pages handed to others in between), and each one's tokens and log-probabilities are bitwise
    those it gets alone on a roomy cache (with either record format)."""
    import deepinfer
    from deepinfer import registry

    if "batch_invariant" not in registry.get().lookup(deepinfer_backend).capabilities:
        pytest.skip(f"{deepinfer_backend} does not declare batch_invariant")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert deepinfer.batch_invariant_enabled()
    path, _ = checkpoints("yarn")
    ps, params = _requests(14, seed=41)
    kw = dict(block_size=3, max_num_seqs=8, kv_format=kv_format)
    roomy = v4.serve(path, deepinfer_backend, deepinfer_device, **kw)
    alone = [_result(roomy.generate([p], [q])[0]) for p, q in zip(ps, params)]
    assert len({tuple(a[0]) for a in alone}) > 8, "the requests are meant to differ"
    batched = [_result(o) for o in roomy.generate(ps, params)]
    assert batched == alone
    pages = 2 * v4.state_pages(path, block_size=3, kv_format=kv_format) + 12
    tight = v4.serve(path, deepinfer_backend, deepinfer_device, num_blocks=pages, preemption_mode=mode, **kw)
    assert [_result(o) for o in tight.generate(ps, params)] == alone
    assert tight.engine.num_preemptions >= 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_budget_counts_v4_pages(dtype, checkpoints, deepinfer_backend, deepinfer_device):
    """``kv_cache_gb`` of exactly N sequences' pages (state and token pages, in the model's dtype) runs N of them at
    once and never N + 1, and every request still completes."""
    from deepinfer.model import SamplingParams

    path, _ = checkpoints("yarn")
    n, bs = 3, 4
    layout = v4.V4Checkpoint.open(path).config.cache_layout(bs, getattr(torch, dtype).itemsize)
    per_seq = layout.pages_for(9)  # a prompt of 7 tokens (one chunk), 3 generated: 9 tokens computed
    llm = v4.serve(
        path,
        deepinfer_backend,
        deepinfer_device,
        dtype=dtype,
        block_size=bs,
        max_num_seqs=16,
        kv_cache_gb=n * per_seq * layout.page_bytes / (1 << 30),
    )
    engine = llm.engine
    assert engine.allocator.num_blocks == n * per_seq
    assert engine.allocator.seq_pages == layout.state_pages
    g = torch.Generator().manual_seed(3)
    seqs = [
        engine.add_request(
            torch.randint(2, 160, (7,), generator=g).tolist(),
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        for _ in range(2 * n)
    ]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    assert most == n
    assert engine.num_preemptions == 0
    assert all(len(s.generated_ids) == 3 for s in seqs)


# --- FP8 records (kv_format fp8_ds_mla) ------------------------------------------------------------------------------


def fake_fp8(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` through e4m3 with one power-of-two scale per ``group`` channels (``max(amax, 1e-4) / 448`` rounded up),
    back in its dtype."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group).float()
    scale = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape).to(x.dtype)


@contextmanager
def fp8_oracle(oracle, path):
    """The oracle with DeepSeek's FP8 records: every compressed entry's non-rope channels and every indexer key
    through ``fake_fp8`` (64 and 128 channels a scale, or the whole part where it is not a multiple)."""
    cfg = v4.V4Checkpoint.open(path).config
    nope, di = cfg.head_dim - cfg.qk_rope_head_dim, cfg.index_head_dim
    eg, ig = (64 if nope % 64 == 0 else nope), (128 if di % 128 == 0 else di)

    def entries(module, args, out):  # the compressor's RMSNorm: rope comes after, on the last channels only
        return torch.cat([fake_fp8(out[..., :nope], eg), out[..., nope:]], dim=-1)

    def keys(module, args):
        q, k, hidden = args
        return q, fake_fp8(k, ig), hidden

    handles = []
    for module in oracle.modules():
        kind = type(module).__name__
        if kind in ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor"):
            handles.append(module.kv_norm.register_forward_hook(entries))
        elif kind == "DeepseekV4IndexerScorer":
            handles.append(module.register_forward_pre_hook(keys))
    assert len(handles) == 2 * cfg.layer_types.count(v4.CSA) + cfg.layer_types.count(v4.HCA)
    try:
        yield oracle
    finally:
        for h in handles:
            h.remove()


def test_fp8_records_serve_as_the_oracle_with_fp8_entries(checkpoints, deepinfer_backend, deepinfer_device):
    """``kv_format="fp8_ds_mla"``: prompt and generated log-probabilities within 1e-3 nats of the oracle whose
    compressed entries and indexer keys go through FP8 as the records store them, and far from the plain oracle
    (the records are in effect)."""
    from deepinfer.model import SamplingParams

    path, oracle = checkpoints("yarn")
    ps = v4.prompts(34)
    llm = v4.serve(path, deepinfer_backend, deepinfer_device, kv_format="fp8_ds_mla", block_size=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(ps, params)
    plain, quantised = [], []
    for p, out in zip(ps, outs):
        full = p + out.outputs[0].token_ids
        got = [out.prompt_logprobs[j] for j in range(1, len(p))] + list(out.outputs[0].logprobs)
        for errs in (plain, quantised):
            if errs is quantised:
                with fp8_oracle(oracle, path):
                    ref = v4.oracle_logprobs(oracle, full)
            else:
                ref = v4.oracle_logprobs(oracle, full)
            errs += [abs(ref[j - 1, full[j]].item() - lp) for j, lp in zip(range(1, len(full)), got)]
    assert max(quantised) < v4.TOL
    assert max(plain) > 10 * v4.TOL


def test_a_cache_without_room_for_one_sequence_is_refused(checkpoints, deepinfer_backend):
    from deepinfer.errors import InputError

    path, _ = checkpoints("yarn")
    pages = v4.state_pages(path)
    with pytest.raises(InputError, match="num_blocks") as e:
        v4.serve(path, deepinfer_backend, None, num_blocks=pages)
    assert f"{pages} state pages" in e.value.expected
    page_bytes = v4.V4Checkpoint.open(path).config.cache_page_bytes("bf16", 4, 4)
    with pytest.raises(InputError, match="kv_cache_gb"):
        v4.serve(path, deepinfer_backend, None, kv_cache_gb=pages * page_bytes / (1 << 30))
    llm = v4.serve(path, deepinfer_backend, None, num_blocks=pages + 1)  # one page of tokens: short requests run
    from deepinfer.model import SamplingParams

    (out,) = llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 2


def test_prefix_caching_reuses_a_shared_prefix_from_its_state_snapshot(checkpoints, deepinfer_backend):
    """Requests sharing a 48-token prefix: with prefix caching the later ones start from the first one's token
    pages and a copy of its state pages kept at a multiple of every compression rate, and give bitwise the tokens
    and log-probabilities of caching off; a state snapshot that is never copied (planted) fails the comparison."""
    from deepinfer.model import SamplingParams
    from deepinfer.model.block_manager import BlockAllocator

    path, oracle = checkpoints("plain")  # rates 3 and 6, pages of 4 tokens, chunks of 8: reuse in steps of 24
    g = torch.Generator().manual_seed(31)
    shared = torch.randint(2, oracle.config.vocab_size, (48,), generator=g).tolist()
    prompts = [shared + torch.randint(2, oracle.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 2)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)

    def run(**kw):
        llm = v4.serve(path, deepinfer_backend, None, max_num_seqs=1, **kw)
        with deepinfer_invariant():
            outs = llm.generate(prompts, params)
        return llm, [_result(o) for o in outs], [o.num_cached_tokens for o in outs]

    on, cached, hits = run()
    _, plain, off_hits = run(enable_prefix_caching=False)
    assert hits == [0, 48, 48] and off_hits == [0, 0, 0]
    assert cached == plain
    assert on.last_stats["prefilled_tokens"] == sum(map(len, prompts)) - 2 * 48
    real = BlockAllocator.__init__

    def no_snapshot_copies(self, *a, **kw):
        real(self, *a, **kw)
        self.copy_pages = lambda src, dst: None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(BlockAllocator, "__init__", no_snapshot_copies)
        _, planted, planted_hits = run()
    assert planted_hits == [0, 48, 48] and planted != plain


@contextmanager
def deepinfer_invariant():
    import deepinfer

    with deepinfer.batch_invariant():
        yield


def test_a_prefix_and_its_snapshot_evicted_to_host_memory_are_found_again(
    checkpoints, deepinfer_backend, deepinfer_device
):
    """A device cache of 3 sequences' state pages and 20 token pages: three 60-token requests after a first one evict
    its 48-token prefix and the snapshots of its state; with a host tier a later request sharing that prefix finds it
    there (token pages and snapshot copied back), not with the device cache alone, and gives bitwise the tokens and
    log-probabilities of caching off; a host tier that does not copy the snapshot back (planted) fails the
    comparison."""
    from deepinfer.model import LLM, SamplingParams
    from deepinfer.model.block_manager import SNAPSHOT
    from deepinfer.model.host_cache import HostPageCache

    path, oracle = checkpoints("plain")  # rates 3 and 6, pages of 4 tokens, chunks of 8: reuse in steps of 24
    g = torch.Generator().manual_seed(37)
    vocab = oracle.config.vocab_size
    shared = torch.randint(2, vocab, (48,), generator=g).tolist()
    first, second = (shared + torch.randint(2, vocab, (n,), generator=g).tolist() for n in (5, 7))
    fillers = [torch.randint(2, vocab, (60,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)

    def run(**kw) -> tuple[LLM, list, int]:
        kw = {"num_blocks": 3 * v4.state_pages(path) + 20, "max_num_seqs": 1} | kw
        llm = v4.serve(path, deepinfer_backend, deepinfer_device, **kw)
        with deepinfer_invariant():
            llm.generate(first, params)
            llm.generate(fillers, params)
            (out,) = llm.generate(second, params)
        return llm, _result(out), out.num_cached_tokens

    on, cached, hit = run(host_cache_gb=0.01)
    _, device_only, device_hit = run()
    _, plain, _ = run(enable_prefix_caching=False)
    assert device_hit == 0, "the device cache alone has lost the prefix"
    stats = on.last_stats["host_cache"]
    assert hit == 48 and on.last_stats["cached_prompt_tokens"] == 48
    assert stats["loaded_pages"] >= v4.state_pages(path) and stats == on.engine.host_cache_stats
    assert cached == plain and device_only == plain
    exact = HostPageCache.load

    def no_snapshot_loads(self, key, page):
        if key[0] != SNAPSHOT:
            exact(self, key, page)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostPageCache, "load", no_snapshot_loads)
        _, planted, planted_hit = run(host_cache_gb=0.01)
    assert planted_hit == 48 and planted != plain


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_a_cuda_graph_batch_gives_the_bits_of_the_engine_step(
    kv_format, checkpoints, monkeypatch, deepinfer_backend, deepinfer_device
):
    """A decode step as the CUDA graphs run it (``cuda_graphs.py``: rows known only by their block tables and
    positions on the device, padding rows on a scratch page, experts dispatched in low-latency mode) gives, in
    batch-invariant mode, the bits of the engine's eager step: logits, and every page after it; the padding rows
    write to the scratch page only."""
    from deepinfer.model import SamplingParams
    from deepinfer.model.forward_batch import ForwardBatch

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    path, _ = checkpoints("yarn")
    llm = v4.serve(path, deepinfer_backend, deepinfer_device, kv_format=kv_format, async_scheduling=False)
    engine, model = llm.engine, llm.engine.runner.model
    ps, _ = _requests(5, seed=7)
    ps[0] = [5, 6, 7]  # its first windows close in the steps below
    seqs = [engine.add_request(p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)) for p in ps]
    while not all(s.is_decode for s in seqs):
        engine.step()
    for _ in range(3):
        engine.step()
    pad = engine.kv_cache.shape[1]  # a scratch page past the engine's
    scratch = torch.full((1, engine.kv_cache.shape[2]), 0x7F, dtype=torch.uint8, device=engine.kv_cache.device)
    before = torch.cat([engine.kv_cache[0], scratch])
    dev, n, b = before.device, len(seqs), 8
    width = max(len(s.block_table) for s in seqs)

    def step(fb, ids):
        pages = before.clone()
        streams = model.forward(ids, fb, [pages])
        return model.compute_logits(streams), pages

    positions = [s.num_computed for s in seqs]
    ids = torch.tensor([s.token_ids[p] for s, p in zip(seqs, positions)], device=dev)
    eager = ForwardBatch(
        positions=torch.tensor(positions, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
        num_decode=n,
        block_table=torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], device=dev),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
        rows=[(s, p, 1) for s, p in zip(seqs, positions)],
    )
    want, want_pages = step(eager, ids)
    table = torch.full((b, engine.allocator.blocks_for(engine.max_model_len)), pad, dtype=torch.int32, device=dev)
    table[:n] = 0
    table[:n, :width] = eager.block_table
    graph = ForwardBatch(
        positions=torch.cat([eager.positions, eager.positions.new_zeros(b - n)]),
        slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=dev),
        num_decode=b,
        block_table=table,
        seq_lens=torch.cat([eager.seq_lens, eager.seq_lens.new_zeros(b - n)]),
        moe_mode="low_latency",
    )
    with HostSyncs(monkeypatch) as syncs, value_checks(False):  # as capture turns them off
        got, got_pages = step(graph, torch.cat([ids, ids.new_zeros(b - n)]))
    assert syncs.calls == [], f"{syncs.calls}: a graph can neither wait for the device nor see new host data"
    assert torch.equal(got[:n], want)
    assert torch.equal(got_pages[:pad], want_pages[:pad])
    assert not torch.equal(got_pages[pad], before[pad])  # the padding rows wrote there


def test_graph_decode_steps_give_the_eager_bits(checkpoints, monkeypatch, deepinfer_backend, deepinfer_device):
    """The engine's CUDA-graph decode path for DeepSeek-V4 (``cuda_graphs.DecodeGraphs``), each replay run eagerly
    over the graphs' static buffers: in batch-invariant mode, tokens and log-probabilities bit for bit those
    of eager decoding, for a batch padded into a bucket and for a request alone that finds its prompt cached."""
    from deepinfer.model import SamplingParams

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    replayed = replay_graphs_on_cpu(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "NARROWEST_TOKENS", 8)  # graphs of several block-table widths
    path, _ = checkpoints("yarn")
    ps = v4.prompts(seed=8)[:5]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)
    common = dict(max_num_seqs=8, async_scheduling=False, max_model_len=256)
    eager = v4.serve(path, deepinfer_backend, deepinfer_device, enforce_eager=True, **common)
    graphs = v4.serve(path, deepinfer_backend, deepinfer_device, **common)
    captured = graphs.engine.runner.graphs
    assert captured is not None and captured.widths == [37, 49, 97]  # 33 state pages + 4, 16 and 64 token pages
    assert sorted(captured.graphs) == [(b, w) for b in (1, 2, 4, 8) for w in captured.widths]
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager.generate(ps, params)]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in graphs.generate(ps, params)] == want
    assert 8 in {b for b, _ in replayed}  # five rows and three padding rows (smaller buckets while prompts chunk in)
    assert {w for _, w in replayed} == {49}, "the narrowest width that holds the tables (up to 16 token pages)"
    before = len(replayed)
    (alone,) = graphs.generate([ps[2]], params)
    assert (alone.outputs[0].token_ids, alone.outputs[0].logprobs) == want[2]
    assert {b for b, _ in replayed[before:]} == {1}
    short = [ps[2][:6]]  # decode steps at positions 6 to 20: tables of 2 to 6 token pages
    before = len(replayed)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager.generate(short, params)]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in graphs.generate(short, params)] == want
    narrowest = [37 if -(-(p + 1) // 4) <= 4 else 49 for p in range(6, 21)]  # the narrowest width that holds each
    assert [w for _, w in replayed[before:]] == narrowest


def test_recomputed_rows_keep_the_eager_bits_beside_graphs(
    checkpoints, monkeypatch, deepinfer_backend, deepinfer_device
):
    """Recompute preemption on an engine with decode graphs: a recomputed request's rows of generated tokens (several
    of one sequence in a step) run eagerly, since DeepSeek-V4's graphs hold one row per sequence; in batch-invariant
    mode every request keeps the tokens and log-probabilities of an eager engine with room for all."""
    from deepinfer.model import SamplingParams

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    replay_graphs_on_cpu(monkeypatch)
    path, _ = checkpoints("yarn")
    ps = v4.prompts(8)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=0)
    eager = v4.serve(path, deepinfer_backend, deepinfer_device, enforce_eager=True)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager.generate(ps, params)]
    pages = 2 * v4.state_pages(path) + 12
    tight = v4.serve(path, deepinfer_backend, deepinfer_device, num_blocks=pages, preemption_mode="recompute")
    assert tight.engine.runner.graphs is not None
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in tight.generate(ps, params)] == want
    assert tight.engine.num_preemptions > 0
