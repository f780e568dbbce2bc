"""Speculative decoding with the MTP layer (``model/speculative.py``): every token is the one the request takes
without speculation (greedy and seeded sampling, log-probabilities included, bitwise in batch-invariant mode), the
cache holds the same entries, preemption in the middle of speculation loses nothing, and the verification rule
accepts a draft with the target's probability and otherwise samples the target's residual.

Two models: a random checkpoint with an MTP layer (its drafts are mostly rejected) and the embedded trained model
(its MTP layer's drafts are mostly accepted), so both branches of verification run on every path."""

from __future__ import annotations

import json
import random

import pytest
import torch
from model_helpers import (  # noqa: F401 (one_thread: autouse fixture)
    one_thread,
    random_prompts,
    replay_graphs_on_cpu,
    small_checkpoint,
)

import deepinfer
from deepinfer import ops
from deepinfer.cli import main
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.engine import SHORT_PROMPT_TOKENS
from deepinfer.model.forward_batch import ForwardBatch, moved_decode_rows, shift_decode_rows
from deepinfer.model.sampling_params import step_seed, step_seeds
from deepinfer.model.scheduler import Scheduler
from deepinfer.model.sequence import PENDING
from deepinfer.model.speculative import (
    SpeculativeConfig,
    acceptance_rows,
    accepted_counts,
    accepted_from,
    confident_drafts,
)

CODE_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):\n",
    "    for key, value in sorted(",
    "if __name__ == '__main__':",
    '"""Utilities for parsing',
]


def result(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason, out.prompt_logprobs


def requests(n: int, rng: random.Random, vocab: int) -> tuple[list, list[SamplingParams]]:
    prompts = random_prompts(vocab, [rng.randint(1, 30) for _ in range(n)], seed=rng.randint(0, 1 << 30))
    params = [
        SamplingParams(
            max_tokens=rng.randint(4, 24),
            temperature=0.0 if i % 2 == 0 else rng.choice([0.6, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 20]),
            seed=rng.randint(0, 1 << 40),
            ignore_eos=i % 3 != 0,
            logprobs=rng.choice([None, 0, 2]),
            prompt_logprobs=0 if i % 4 == 0 else None,
        )
        for i in range(n)
    ]
    return prompts, params


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert deepinfer.batch_invariant_enabled()


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("mtp"), seed=11, num_nextn_predict_layers=1)


def test_config_is_checked_before_anything_is_read(mtp_checkpoint, tmp_path):
    for bad, arg in [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"confidence_threshold": 1.0}, "confidence_threshold"),
        ({"confidence_threshold": float("nan")}, "confidence_threshold"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"launch_ahead": 1}, "launch_ahead"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config"),
        ("mtp", "speculative_config"),
    ]:
        with pytest.raises(deepinfer.InputError, match=arg):
            LLM(tmp_path / "absent", speculative_config=bad)
    plain = small_checkpoint(tmp_path / "plain", seed=1)
    with pytest.raises(deepinfer.InputError, match="num_nextn_predict_layers"):
        LLM(plain, progress=False, speculative_config={"num_speculative_tokens": 1})
    assert SpeculativeConfig.from_value({"method": "deepseek_mtp"}).num_speculative_tokens == 1


@pytest.mark.parametrize(
    "spec", [{"num_speculative_tokens": 1}, {"num_speculative_tokens": 3, "launch_ahead": True}], ids=["k1", "k3-ahead"]
)
def test_random_checkpoint_tokens_identical_with_and_without_speculation(mtp_checkpoint, invariant, spec):
    seed = random.randrange(1 << 30)
    prompts, params = requests(24, random.Random(seed), 258)
    kw = dict(block_size=8, prefill_chunk_size=16, max_num_batched_tokens=128, progress=False)
    plain = [result(o) for o in LLM(mtp_checkpoint, **kw).generate(prompts, params)]
    llm = LLM(mtp_checkpoint, speculative_config=spec, **kw)
    outs = [result(o) for o in llm.generate(prompts, params)]
    differ = [i for i in range(len(prompts)) if outs[i] != plain[i]]
    assert not differ, f"requests {differ} differ with speculation {spec} (seed {seed})"
    stats = llm.last_stats["speculative"]
    assert stats["drafted"] > 50 and stats["verifications"] > 20, stats
    alone = [result(llm.generate([prompts[i]], [params[i]])[0]) for i in (0, 1, 5)]
    assert alone == [plain[i] for i in (0, 1, 5)], "a request alone with speculation differs from the batch"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_sparse_attention_model_keeps_every_token(invariant, tmp_path, monkeypatch, graphs):
    """DeepSeek-V3.2: the MTP layer's indexer keeps its own layer of the indexer-key cache; through the decode graphs
    too (each replay run eagerly on the CPU: the drafts launched ahead, the graphs' padding rows padding sequences
    of the indexer)."""
    v32 = dict(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_n_heads=8, index_topk=6)
    ckpt = small_checkpoint(tmp_path, seed=5, num_nextn_predict_layers=1, index_head_dim=32, **v32)
    prompts, params = requests(8, random.Random(1), 258)
    plain = [result(o) for o in LLM(ckpt, block_size=8, progress=False).generate(prompts, params)]
    spec = {"num_speculative_tokens": 2, "launch_ahead": graphs}
    replayed = replay_graphs_on_cpu(monkeypatch) if graphs else []
    llm = LLM(ckpt, block_size=8, max_num_seqs=8, progress=False, speculative_config=spec, enforce_eager=not graphs)
    assert (llm.engine.runner.graphs is not None) == graphs
    assert [result(o) for o in llm.generate(prompts, params)] == plain
    assert llm.last_stats["speculative"]["drafted"] > 20
    assert bool(replayed) == graphs


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 1},
        {"num_speculative_tokens": 3, "launch_ahead": True},
        {"method": "deepseek_mtp", "num_speculative_tokens": 4, "confidence_threshold": 0.5, "launch_ahead": True},
    ],
)
def test_trained_model_accepts_drafts_and_keeps_every_token(invariant, spec):
    """On the embedded model, whose MTP layer was trained, most drafts are accepted; greedy and sampled requests
    (log-probabilities too) are bitwise those without speculation, alone and in one batch."""
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7, logprobs=0),
        SamplingParams(max_tokens=33, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=40, seed=123),
        SamplingParams(max_tokens=17, temperature=0.0, prompt_logprobs=1),
        SamplingParams(max_tokens=40, temperature=0.5, seed=99),
    ]
    base = LLM(progress=False)
    plain = [result(o) for o in base.generate(CODE_PROMPTS, params)]
    llm = LLM(progress=False, speculative_config=spec)
    outs = [result(o) for o in llm.generate(CODE_PROMPTS, params)]
    assert outs == plain
    stats = llm.last_stats["speculative"]
    k = spec["num_speculative_tokens"]
    # A request alone: its prefill step gives one token and each later step one plus the drafts it accepted.
    # With launch_ahead, steps are launched before the previous one's tokens are read, but where confidence
    # scheduling reads the drafts' probabilities, and near the end (a step that may end the request by length is
    # waited for); without it, every step waits for the one before.
    before, ahead = llm.engine.stats["steps"], llm.engine.stats["steps_ahead"]
    out = llm.generate(CODE_PROMPTS[0], params[0])[0]
    assert result(out) == plain[0]
    steps = llm.engine.stats["steps"] - before
    ahead = llm.engine.stats["steps_ahead"] - ahead
    if "confidence_threshold" in spec or not spec.get("launch_ahead"):
        assert ahead == 0
    else:
        assert ahead >= steps - 3, (ahead, steps)  # the prefill and one or two steps near the end
    assert steps == len(out.outputs[0].token_ids) - out.metrics["accepted"]
    if set(spec) <= {"num_speculative_tokens", "launch_ahead"}:  # every decode step verifies, but the last
        assert out.metrics["drafted"] >= steps - 2, (out.metrics, steps)
    assert 0.2 < stats["acceptance_rate"] < 1 and stats["mean_accepted_length"] > 1.4, stats
    if "confidence_threshold" in spec:  # confidence scheduling verifies fewer than k drafts on average
        assert stats["drafted"] < k * stats["verifications"], stats
    else:
        assert stats["drafted"] > 0.8 * k * stats["verifications"], stats
    outs = llm.generate(CODE_PROMPTS[:2], params[:2])
    assert [result(o) for o in outs] == plain[:2]
    for out in outs:  # per-request counts
        assert out.metrics["drafted"] >= out.metrics["accepted"] > 0
    last = llm.last_stats["speculative"]  # this call's counts only, after the calls before
    assert [last["drafted"], last["accepted"]] == [sum(o.metrics[k] for o in outs) for k in ("drafted", "accepted")]


@pytest.mark.parametrize(
    "spec",
    [
        {"num_speculative_tokens": 3, "launch_ahead": True},
        {"num_speculative_tokens": 2},
        {"num_speculative_tokens": 3, "confidence_threshold": 0.3},
    ],
    ids=["k3-ahead", "k2-waiting", "k3-confident"],
)
def test_graph_path_keeps_every_token(invariant, monkeypatch, spec):
    """The CUDA-graph decode path (``cuda_graphs.DecodeGraphs``: static buffers, the MTP graphs of the chain and of
    the verification rows, positions moved on by what the step in flight accepts; the drafts' probabilities only
    under a confidence threshold), each replay run eagerly on the CPU: every token and log-probability is plain
    decoding's, in a batch and alone."""
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=7, logprobs=0),
        SamplingParams(max_tokens=33, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=1.0, top_k=40, seed=123),
    ]
    prompts = CODE_PROMPTS[:4]
    plain = [result(o) for o in LLM(progress=False, enforce_eager=True).generate(prompts, params)]
    replayed = replay_graphs_on_cpu(monkeypatch)
    llm = LLM(progress=False, max_num_seqs=4, speculative_config=spec)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.mtp_graphs
    assert [result(o) for o in llm.generate(prompts, params)] == plain
    assert 4 in {b for b, _ in replayed}
    before = llm.engine.stats["steps_ahead"]
    assert result(llm.generate(prompts[0], params[0])[0]) == plain[0]
    ahead = llm.engine.stats["steps_ahead"] - before
    assert ahead > 10 if spec.get("launch_ahead") else ahead == 0
    stats = llm.last_stats["speculative"]
    assert stats["mean_accepted_length"] > 1.4, stats


@pytest.mark.parametrize("spec", [None, {"num_speculative_tokens": 2, "launch_ahead": True}], ids=["plain", "k2-ahead"])
def test_short_prompts_replay_the_decode_graphs(monkeypatch, spec, deepinfer_backend):
    """Outside batch-invariant mode, a prompt chunk ending within ``SHORT_PROMPT_TOKENS`` runs as decode rows inside
    the decode graphs (each replay run eagerly on the CPU, an fp32 model), its MTP pass too: tokens, their
    log-probabilities and the prompt's agree with an eager engine's prefill path, alone and beside a longer prompt
    (whose step stays eager, the short chunk as decode rows beside its prefill). Within 1e-4 on the reference; a
    GPU backend's decode and prefill kernels differ by more (3.8e-4 measured on an H100): within 2e-3 there."""
    tol = 1e-4 if deepinfer_backend == "reference" else 2e-3
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    short, long_ = random_prompts(4096, [37, SHORT_PROMPT_TOKENS + 9], seed=5)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.9, seed=3, logprobs=0),
    ]
    want = LLM(progress=False, dtype="float32", enforce_eager=True, speculative_config=spec)
    assert want.engine.scheduler.decode_row_tokens == 0
    replayed = replay_graphs_on_cpu(monkeypatch)
    llm = LLM(progress=False, dtype="float32", max_num_seqs=2, speculative_config=spec)
    assert llm.engine.scheduler.decode_row_tokens == SHORT_PROMPT_TOKENS
    assert llm.engine.runner.graphs.sizes[-1] >= SHORT_PROMPT_TOKENS

    def close(got, expected):
        for g, e in zip(got, expected):
            a, b = g.outputs[0], e.outputs[0]
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=tol)
            assert [sorted(t) for t in a.top_logprobs or []] == [sorted(t) for t in b.top_logprobs or []]
            if e.prompt_logprobs is not None:
                assert g.prompt_logprobs[1:] == pytest.approx(e.prompt_logprobs[1:], abs=tol)

    for p in params:
        replayed.clear()
        close(llm.generate([short], p), want.generate([short], p))
        assert replayed[0][0] >= len(short)  # the prompt's step replayed a bucket of its rows
    close(llm.generate([short, long_], params), want.generate([short, long_], params))
    # chunks of 16: a short prompt's first chunks sample nothing, beside the other request's decode rows
    chunked = LLM(progress=False, dtype="float32", max_num_seqs=2, speculative_config=spec, prefill_chunk_size=16)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    close(chunked.generate([long_, short], greedy), want.generate([long_, short], greedy))


def test_requests_first_scheduled_in_a_large_batch_never_speculate(invariant):
    """``disable_by_batch_size``: requests first scheduled in a step of at least that many sequences never draft,
    and decode steps of only such requests skip the MTP layer and run ahead of the host as plain decoding does (a
    prompt's MTP cache entries are still written: a later request may hit them); requests admitted into a smaller
    batch speculate, except in steps that decode that many. Every token stays the one plain decoding takes."""
    params = [SamplingParams(max_tokens=40 if i < 3 else 12, temperature=0.0) for i in range(6)]
    plain = [result(o) for o in LLM(progress=False).generate(CODE_PROMPTS, params)]
    llm = LLM(progress=False, speculative_config={"num_speculative_tokens": 2, "disable_by_batch_size": 4})
    engine = llm.engine
    mtp_rows, launched = [], []
    forward = engine.runner.drafter.mtp.forward
    engine.runner.drafter.mtp.forward = lambda hidden, *a: mtp_rows.append(hidden.shape[0]) or forward(hidden, *a)
    launch = engine.runner.launch

    def counting_launch(batch, *a, **k):
        before = len(mtp_rows)
        out = launch(batch, *a, **k)
        launched.append((bool(batch.prefills), len(mtp_rows) - before))
        return out

    engine.runner.launch = counting_launch
    before = engine.stats["steps_ahead"]
    assert [result(o) for o in llm.generate(CODE_PROMPTS, params)] == plain
    assert llm.last_stats["speculative"]["drafted"] == 0
    assert all(n == 1 for prefill, n in launched if prefill), "a step with prompt rows skipped the MTP layer"
    assert not any(n for prefill, n in launched if not prefill), "a decode step of requests that never draft ran it"
    assert engine.stats["steps_ahead"] - before > 20, "steps of requests that never speculate are not run ahead"

    # three requests speculate; three more join them (a step of six sequences): those never draft, and the
    # first three draft only while fewer than four sequences decode
    tok = llm.tokenizer
    first = [engine.add_request(tok.encode(p), q) for p, q in zip(CODE_PROMPTS[:3], params[:3])]
    for _ in range(3):
        engine.step()
    late = [engine.add_request(tok.encode(p), q) for p, q in zip(CODE_PROMPTS[3:], params[3:])]
    drafted_with_six, steps = None, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 2:  # the joining step (three sequences decode: drafts allowed) has been read back
            drafted_with_six = sum(s.num_drafted for s in first)
        elif steps > 2 and all(s.status.name == "RUNNING" for s in first + late):
            assert sum(s.num_drafted for s in first) == drafted_with_six, "drafts in a step of six sequences"
    assert [s.speculates for s in first + late] == [True] * 3 + [False] * 3
    assert all(s.num_drafted > 0 for s in first) and not any(s.num_drafted for s in late)
    assert sum(s.num_drafted for s in first) > drafted_with_six
    assert [s.token_ids[s.num_prompt_tokens :] for s in first + late] == [p[0] for p in plain]


def test_a_prefix_cached_by_requests_that_never_speculate_holds_the_mtp_entries_of_a_miss(invariant):
    """Prompt pages registered for prefix caching by requests that never speculate (``disable_by_batch_size``) hold
    the MTP layer's cache entries a speculating request computes for the same prompt, bitwise: a later hit drafts
    from them."""
    prompt = LLM(progress=False).tokenizer.encode(CODE_PROMPTS[1] * 6)[:80]
    spec = {"num_speculative_tokens": 2, "disable_by_batch_size": 2}
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def mtp_entries(llm, seq) -> torch.Tensor:
        full = len(prompt) // 16 * 16  # the registered (full) pages
        slots = torch.tensor([llm.engine.allocator.slot(seq, p) for p in range(full)])
        return llm.engine.kv_cache[-1].flatten(0, 1)[slots].clone()

    def served(n: int):
        llm = LLM(progress=False, speculative_config=spec, block_size=16)
        seqs = [llm.engine.add_request(prompt, params) for _ in range(n)]
        llm.engine.step()  # the prompts' step: n sequences
        entries = mtp_entries(llm, seqs[0])
        llm.engine.abort_all()
        return [s.speculates for s in seqs], entries

    crowd, cached = served(2)
    alone, fresh = served(1)
    assert crowd == [False, False] and alone == [True]
    assert torch.equal(cached, fresh)


def test_cache_entries_are_those_of_a_run_without_speculation(invariant):
    """Rejected drafts leave nothing behind: once a sequence has computed N positions, the latents of positions
    below N are bitwise those a run without speculation writes, in every layer, and the MTP layer's entries are
    the same whatever the number of drafts."""
    prompt = LLM(progress=False).tokenizer.encode(CODE_PROMPTS[1])
    n = len(prompt) + 30

    def cache_after(spec) -> tuple[torch.Tensor, float]:
        llm = LLM(progress=False, speculative_config=spec, block_size=16)
        engine = llm.engine
        seq = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0))
        while seq.num_computed < n:
            engine.step()
        slots = torch.tensor([engine.allocator.slot(seq, p) for p in range(n)])
        cache = engine.kv_cache.flatten(1, 2)[:, slots]
        rate = engine.spec_stats.acceptance_rate
        engine.abort_all()
        return cache, rate

    plain, _ = cache_after(None)
    one, rate1 = cache_after({"num_speculative_tokens": 1})
    three, rate3 = cache_after({"num_speculative_tokens": 3})
    assert 0 < rate3 < 1 and 0 < rate1 < 1, "both accepted and rejected drafts are meant to occur"
    layers = plain.shape[0]
    assert torch.equal(one[:layers], plain) and torch.equal(three[:layers], plain)
    assert torch.equal(one[layers:], three[layers:]), "the MTP layer's cache depends on the number of drafts"


@pytest.mark.parametrize("mode, ahead", [("swap", False), ("recompute", True)])
def test_preemption_in_the_middle_of_speculation_loses_nothing(mtp_checkpoint, invariant, monkeypatch, mode, ahead):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts, params = requests(16, rng, 258)
    for p in params:
        p.max_tokens, p.ignore_eos = rng.randint(20, 40), True
    kw = dict(block_size=8, progress=False)
    plain = [result(o) for o in LLM(mtp_checkpoint, **kw).generate(prompts, params)]
    with_drafts = []
    preempt = Scheduler._preempt

    def spy(self, seq):
        with_drafts.append(seq.num_drafted)
        return preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    spec = {"num_speculative_tokens": 2, "launch_ahead": ahead}
    llm = LLM(mtp_checkpoint, num_blocks=12, preemption_mode=mode, speculative_config=spec, **kw)
    outs = [result(o) for o in llm.generate(prompts, params)]
    assert sum(d > 0 for d in with_drafts) >= 4, f"too few preemptions after speculation began: {with_drafts}"
    differ = [i for i in range(len(prompts)) if outs[i] != plain[i]]
    assert not differ, f"requests {differ} differ after {mode} preemption under speculation (seed {seed})"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_step_launched_ahead_preempts_no_sequence_in_flight(invariant, monkeypatch, mode):
    """With a cache too small for every request, drafts take only pages no other decoding sequence needs for its own
    step: a step scheduled while the one before still runs preempts nobody (a sequence in flight, preempted, would
    take the tokens of that step after it left). One request stops on a token sampled while the cache is full."""
    prompts = CODE_PROMPTS + [p + " x = 1" for p in CODE_PROMPTS]
    params = [SamplingParams(max_tokens=20 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(block_size=8, num_blocks=9, preemption_mode=mode, enable_prefix_caching=False, progress=False)
    params[3].stop_token_ids = [LLM(**kw).generate(prompts[3], params[3])[0].outputs[0].token_ids[1]]
    plain = [result(o) for o in LLM(**kw).generate(prompts, params)]
    preempted = []
    preempt = Scheduler._preempt

    def spy(self, seq):
        preempted.append((seq.request_id, seq.drafts_in_flight, seq.token_ids[-1]))
        return preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    replayed = replay_graphs_on_cpu(monkeypatch)
    llm = LLM(speculative_config={"num_speculative_tokens": 2, "launch_ahead": True}, **kw)
    outs = [result(o) for o in llm.generate(prompts, params)]
    assert replayed
    assert len(preempted) >= 3, preempted
    assert not [p for p in preempted if p[1] or p[2] == PENDING], f"sequences preempted in flight: {preempted}"
    assert llm.engine.stats["steps_ahead"] > llm.engine.stats["steps"] / 2
    assert outs == plain and plain[3][3] == "stop"
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_verification_rule_follows_the_target_distribution():
    """The rule as the engine applies it: the target samples row ``i`` with the seed of its position, and the draft
    is accepted when it equals that sample. Over many seeds the acceptance rate of a draft ``d`` is ``p(d)`` and
    the tokens taken on rejection follow ``p`` without ``d``, renormalised (chi-square test)."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    vocab, n = 12, 6000
    logits = torch.randn(1, vocab, generator=g) * 1.5
    p = torch.softmax(logits[0].double(), -1)
    for draft in (int(p.argmax()), int(p.argsort()[vocab // 2])):
        seeds = torch.tensor([step_seed(s, 3) for s in range(n)])
        y = ops.sample(
            logits.expand(n, vocab).contiguous(),
            torch.ones(n),
            torch.ones(n),
            torch.zeros(n, dtype=torch.int32),
            seeds,
        ).tolist()
        # each seed's step: a row verifying `draft` (sampled y) and the row after it (the bonus token)
        tokens = torch.tensor([[t, 0] for t in y]).flatten()
        drafts = torch.tensor([[draft, -1]] * n).flatten()
        accepted = accepted_counts(tokens, drafts, torch.arange(2 * n) // 2 * 2)[::2].tolist()
        rate = sum(accepted) / n
        sigma = (p[draft] * (1 - p[draft]) / n).sqrt()
        assert abs(rate - p[draft]) < 5 * sigma, (draft, rate, float(p[draft]))
        rejected = torch.bincount(torch.tensor([t for t, a in zip(y, accepted) if not a]), minlength=vocab).double()
        assert rejected[draft] == 0
        residual = p.clone()
        residual[draft] = 0
        expected = residual / residual.sum() * rejected.sum()
        keep = expected > 5
        chi2 = float(((rejected[keep] - expected[keep]) ** 2 / expected[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (draft, chi2, dof)


def test_acceptance_and_confidence_counts():
    # four sequences' sampler rows in one step: drafts [5, 6, 7] all accepted; [5, 6, 7] with the second refused;
    # [5] refused; no drafts
    rows = [([5, 6, 7, 8], [5, 6, 7, -1]), ([5, 9, 7, 8], [5, 6, 7, -1]), ([4, 5], [5, -1]), ([4], [-1])]
    tokens = torch.tensor([t for sampled, _ in rows for t in sampled])
    drafts = torch.tensor([d for _, verified in rows for d in verified])
    first = torch.tensor([0] * 4 + [4] * 4 + [8] * 2 + [10])
    got = accepted_counts(tokens, drafts, first).tolist()
    assert got == [3] * 4 + [1] * 4 + [0] * 2 + [0]
    assert confident_drafts([0.9, 0.6, 0.2, 0.95], 0.5) == 2
    assert confident_drafts([0.1, 0.9], 0.5) == 0
    assert confident_drafts([0.1, 0.9], 0.0) == 2


def test_accepted_from_host_rows_is_accepted_counts():
    """The engine's form of the acceptance count (index arithmetic on the host, ``accepted_from``) gives
    ``accepted_counts``' counts on random steps: sequences of 1 to 5 rows, drafts that match their row's token or
    not."""
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
        first = [f for i, n in enumerate(sizes) for f in [sum(sizes[:i])] * n]
        follow = [r + 1 if r + 1 < len(first) and first[r + 1] == f else -1 for r, f in enumerate(first)]
        tokens = [rng.randrange(4) for _ in first]
        inputs = [rng.randrange(4) for _ in first]
        for r, f in enumerate(follow):  # most drafts right
            if f >= 0 and rng.random() < 0.7:
                inputs[f] = tokens[r]
        tokens_t, inputs_t = torch.tensor(tokens), torch.tensor(inputs)
        drafts = torch.tensor([inputs[f] if f >= 0 else -1 for f in follow])
        want = accepted_counts(tokens_t, drafts, torch.tensor(first)).tolist()
        rows = torch.tensor(acceptance_rows(first, follow))
        assert accepted_from(tokens_t, inputs_t, rows).tolist() == want, (sizes, tokens, inputs)


def test_rows_moved_in_and_out_of_place_agree():
    """``moved_decode_rows`` (inside the decode graphs) moves each row as ``shift_decode_rows`` does in place:
    positions and lengths by the shift, the slot from the block table at the new position; rows that do not move
    (padding rows, slot -1, among them) keep their slots, and its inputs are left as they were."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    rows, width, block = 9, 6, 4
    table = torch.randint(0, 50, (rows, width), generator=g, dtype=torch.int32)
    lens = torch.randint(1, block * (width - 2), (rows,), generator=g, dtype=torch.int32)
    lens[-2:] = 0  # padding rows
    positions = (lens - 1).clamp(min=0)
    slots = (table.gather(1, (positions // block).long()[:, None])[:, 0] * block + positions % block).long()
    slots[-2:] = -1
    shift = torch.randint(0, 4, (rows,), generator=g, dtype=torch.int32)
    shift[0], shift[1], shift[-2:] = 0, 3, 0  # a row that stays, one that moves, the padding rows
    fb = ForwardBatch(positions=positions, slot_mapping=slots, num_decode=rows, block_table=table, seq_lens=lens)
    before = [t.clone() for t in (positions, slots, lens)]
    moved = moved_decode_rows(fb, shift, block)
    assert all(torch.equal(a, b) for a, b in zip(before, (positions, slots, lens)))
    eager = ForwardBatch(
        positions=positions.clone(),
        slot_mapping=slots.clone(),
        num_decode=rows,
        block_table=table,
        seq_lens=lens.clone(),
    )
    still = shift == 0
    shift_decode_rows(eager, shift, block)
    assert torch.equal(moved.positions, eager.positions) and torch.equal(moved.seq_lens, eager.seq_lens)
    assert torch.equal(moved.slot_mapping[~still], eager.slot_mapping[~still])
    at = positions.long() + shift.long()  # the slot at the new position, from the block table
    want = table.gather(1, (at // block)[:, None])[:, 0].long() * block + at % block
    assert torch.equal(moved.slot_mapping[~still], want[~still])
    assert torch.equal(moved.slot_mapping[still], slots[still]) and (moved.slot_mapping[-2:] == -1).all()


def test_device_seeds_are_the_host_seeds():
    """A step run ahead of the host draws its seeds on the device: bit for bit ``step_seed``'s."""
    rng = random.Random()
    seeds = [rng.getrandbits(63) for _ in range(2000)] + [0, (1 << 63) - 1]
    steps = [rng.randrange(1 << 31) for _ in range(2000)] + [0, (1 << 31) - 1]
    got = step_seeds(torch.tensor(seeds), torch.tensor(steps)).tolist()
    assert got == [step_seed(a, b) for a, b in zip(seeds, steps)]


def test_cli_flag_runs_and_reports(capsys):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    argv = ["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--speculative-config", spec]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative decoding:" in out and "mean accepted length" in out
    with pytest.raises(SystemExit) as e:
        main(["generate", "--speculative-config", "{num_speculative_tokens: 2"])
    assert e.value.code == 2
    assert "--speculative-config" in capsys.readouterr().err
    assert main(["generate", "--max-tokens", "2", "--speculative-config", '{"num_speculative_tokens": 0}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().out


def test_prefix_cache_hits_keep_every_token(mtp_checkpoint, invariant):
    """Requests sharing a long prefix reuse its cached pages (the MTP layer's included) under speculation, and take
    the tokens they take with neither."""
    rng = random.Random(3)
    shared = random_prompts(258, [48], seed=9)[0]
    prompts = [shared + p for p in random_prompts(258, [rng.randint(1, 12) for _ in range(6)], seed=4)]
    params = [
        SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True) for i in range(6)
    ]
    kw = dict(block_size=8, prefill_chunk_size=16, progress=False)
    plain = LLM(mtp_checkpoint, enable_prefix_caching=False, **kw)
    want = [result(o) for o in plain.generate(prompts, params)]
    llm = LLM(mtp_checkpoint, speculative_config={"num_speculative_tokens": 2}, **kw)
    llm.generate(prompts[:1], params[:1])  # the prefix, cached
    assert [result(o) for o in llm.generate(prompts, params)] == want
    assert llm.last_stats["cached_prompt_tokens"] >= 6 * 48 - 16, llm.last_stats
    assert llm.last_stats["speculative"]["drafted"] > 0
