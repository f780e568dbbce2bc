"""Speculative decoding on DeepSeek-V3.2 (the MTP layer keeps its own layers of the latent and indexer-key caches),
in batch-invariant mode, with prompts far longer than ``index_topk``:

- drafts that are mostly right (a run without speculation's tokens, one in four spoiled), so that accepted drafts'
  cache entries are kept and read by later steps, with and without preemption by swap or recomputation: every token
  and log-probability is bitwise that of a run without speculation;
- the MTP layer's first draft of a token and the state behind it, made by the engine after decode and verification
  steps, are bitwise those made after a prefill of the same tokens: its cache entries (the indexer's included) hold
  what a prefill writes."""

from __future__ import annotations

import random

import pytest
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from test_model_batch_invariance import V32 as V32_MODEL

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.speculative import MTPDrafter

V32 = V32_MODEL | dict(num_nextn_predict_layers=1)
KW = dict(dtype="float32", block_size=8, prefill_chunk_size=16, max_num_batched_tokens=64, progress=False)


@pytest.fixture(scope="module")
def v32_mtp(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("v32_mtp"), seed=1, **V32)


def result(out) -> tuple:
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def spoiled_drafts(monkeypatch, continuations: dict, rng: random.Random, recorded: list | None = None) -> None:
    """The drafts a step verifies become those of ``continuations`` (prompt -> its tokens without speculation),
    each spoiled with probability 1/4 (the MTP layer still runs: its cache entries and next drafts are made);
    ``recorded`` gets ``(tokens, first draft, MTP state)`` of every sequence about to draft."""
    propose = MTPDrafter.propose

    def spoiled(self, seqs, *args, **kwargs):
        for seq in seqs:
            if recorded is not None and seq.next_draft is not None:
                recorded.append((tuple(seq.token_ids), seq.next_draft[0], seq.draft_state.clone()))
        propose(self, seqs, *args, **kwargs)
        if continuations:
            for seq in seqs:
                full = continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
                true = full[seq.num_tokens : seq.num_tokens + len(seq.drafts)]
                seq.drafts = [t if rng.random() > 0.25 else (t + 1) % 258 for t in true]
        return []  # the drafts are on the host: no chained drafts on the device replace them

    monkeypatch.setattr(MTPDrafter, "propose", spoiled)


@pytest.mark.parametrize("mode", [None, "swap", "recompute"])
def test_accepted_drafts_keep_every_token(v32_mtp, monkeypatch, mode):
    rng = random.Random(1)
    prompts = random_prompts(258, [rng.randint(20, 120) for _ in range(8)], seed=2)
    params = [
        SamplingParams(max_tokens=rng.randint(10, 30), temperature=0.8 * (i % 2), seed=i, ignore_eos=True, logprobs=0)
        for i in range(len(prompts))
    ]
    extra = {} if mode is None else {"num_blocks": 30, "preemption_mode": mode}
    with deepinfer.batch_invariant():
        plain = LLM(v32_mtp, "reference", **KW).generate(prompts, params)
        spoiled_drafts(monkeypatch, {tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, plain)}, rng)
        llm = LLM(v32_mtp, "reference", speculative_config={"num_speculative_tokens": 3}, **(KW | extra))
        outs = llm.generate(prompts, params)
    assert [result(o) for o in outs] == [result(o) for o in plain]
    stats = llm.last_stats["speculative"]
    assert stats["acceptance_rate"] > 0.4 and stats["mean_accepted_length"] > 1.8, stats
    assert mode is None or llm.engine.num_preemptions > 0


def test_mtp_drafts_after_decode_are_those_after_a_prefill(v32_mtp, monkeypatch):
    prompts = random_prompts(258, [20, 70, 130], seed=4)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    recorded: list = []
    continuations: dict = {}
    with deepinfer.batch_invariant():
        plain = LLM(v32_mtp, "reference", **KW).generate(prompts, greedy)
        continuations.update({tuple(p): p + o.outputs[0].token_ids for p, o in zip(prompts, plain)})
        spoiled_drafts(monkeypatch, continuations, random.Random(0), recorded)
        spec = {"num_speculative_tokens": 3}
        llm = LLM(v32_mtp, "reference", speculative_config=spec, enable_prefix_caching=False, **KW)
        llm.generate(prompts, greedy)
        assert llm.last_stats["speculative"]["accepted"] > 10
        after_decode = list(recorded)
        continuations.clear()  # the MTP layer's own drafts from here
        fresh = LLM(v32_mtp, "reference", speculative_config=spec, enable_prefix_caching=False, **KW)
        for tokens, draft, state in after_decode:
            recorded.clear()  # the prompt ends one token short: its prefill samples the last one, then drafts
            fresh.generate([list(tokens[:-1])], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            ((_, draft_again, state_again),) = [r for r in recorded if r[0] == tokens]
            assert draft_again == draft and state_again.equal(state), f"after {len(tokens)} tokens"
