"""Speculative decoding on DeepSeek-V4 with V4-Flash's rates (4 and 128) and an MTP layer of heavily compressed
attention (the other tests' MTP layers attend a window or compressed sparse entries).

Drafts taken from a run without speculation and spoiled wherever the draft would close a compressed window (its
rejected cache writes include the entry of that window) or at random: every token and log-probability is bitwise
the one of plain decoding (batch-invariant mode). With the MTP layer's own drafts, each equals the layer's greedy token
recomputed from the sequence's tokens on pages of its own, across the HCA window of 128 tokens; the layer's
predictions are within 1e-3 nats of the block transformers builds.
"""

from __future__ import annotations

import random

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from test_speculative_v4 import (
    add_mtp,
    assert_drafts_are_the_layers,
    load,
    mtp_oracle,
    oracle_mtp_logprobs,
    our_mtp_logprobs,
    recorded_drafts,
)
from test_v4_prefix_groups import FLASH_RATES

from deepinfer.model import LLM, SamplingParams
from deepinfer.model.speculative import MTPDrafter
from deepinfer.selection import use

RATES = (4, 128)


@pytest.fixture(scope="module")
def flash_oracle(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-flash-hca-mtp")
    oracle = v4.v4_checkpoint(path, seed=5, **FLASH_RATES)
    add_mtp(path, seed=6, mtp_type=v4.HCA)
    return path, oracle


@pytest.fixture(scope="module")
def flash_mtp(flash_oracle):
    return flash_oracle[0]


def serve(path, backend, device, **kw) -> LLM:
    args = dict(dtype="float32", block_size=16, prefill_chunk_size=48, max_num_batched_tokens=256, progress=False)
    return LLM(path, backend, device=device, **(args | kw))


def result(out):
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.outputs[0].top_logprobs


def test_hca_mtp_layer_matches_transformers_block(flash_oracle, deepinfer_backend, deepinfer_device, tmp_path):
    """The MTP layer's predictions at every position of prompts past the end of the first HCA window, against the
    block transformers builds (``test_speculative_v4.mtp_oracle``)."""
    path, oracle = flash_oracle
    block = mtp_oracle(path, oracle, tmp_path)
    model = load(path, deepinfer_backend, deepinfer_device)
    assert model.mtp[0].block[1].kind == v4.HCA
    g = torch.Generator().manual_seed(8)
    with use(deepinfer_backend):
        for n in (129, 200):
            ids = torch.randint(2, 160, (n,), generator=g).tolist()
            ref, got = oracle_mtp_logprobs(path, oracle, block, ids), our_mtp_logprobs(model, ids)
            assert (got - ref).abs().max().item() < v4.TOL


def test_drafts_rejected_where_they_close_a_window_keep_every_token(
    flash_mtp, monkeypatch, deepinfer_backend, deepinfer_device
):
    rng = random.Random(9)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in (120, 1, 125, 126, 250, 3)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(20, 30),
            temperature=0.0 if i % 2 else 0.8,
            seed=rng.randint(0, 1 << 30),
            ignore_eos=True,
            logprobs=1,
        )
        for i in range(len(prompts))
    ]
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    plain = [result(o) for o in serve(flash_mtp, deepinfer_backend, deepinfer_device).generate(prompts, params)]
    continuations = {tuple(p): p + list(o[0]) for p, o in zip(prompts, plain)}
    propose = MTPDrafter.propose
    spoiled_at = []

    def spoiled(self, seqs, *args, **kwargs):
        out = propose(self, seqs, *args, **kwargs)
        for seq in seqs:
            true = continuations[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            drafts = []
            for pos, t in enumerate(true[seq.num_tokens : seq.num_tokens + len(seq.drafts)], seq.num_tokens):
                closes = any((pos + 1) % m == 0 for m in RATES)
                if closes or rng.random() < 0.1:
                    spoiled_at.append(pos)
                    t = (t + 1) % 160
                drafts.append(t)
            seq.drafts = drafts
        return out

    monkeypatch.setattr(MTPDrafter, "propose", spoiled)
    llm = serve(flash_mtp, deepinfer_backend, deepinfer_device, speculative_config={"num_speculative_tokens": 3})
    assert [result(o) for o in llm.generate(prompts, params)] == plain
    assert llm.last_stats["speculative"]["acceptance_rate"] > 0.3
    assert {p % 4 for p in spoiled_at} >= {3} and 127 in spoiled_at, "drafts closing CSA and HCA windows rejected"


def test_hca_mtp_drafts_are_what_the_layer_computes_alone(flash_mtp, monkeypatch, deepinfer_backend):
    seen = recorded_drafts(monkeypatch)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in (120,)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = serve(flash_mtp, deepinfer_backend, None, speculative_config={"num_speculative_tokens": 3})
    llm.generate(prompts, params)
    assert len(seen) > 5 and any(c < 128 <= c + len(d) for _, c, d in seen), "drafts across the HCA window's end"
    model = load(flash_mtp, deepinfer_backend, None)
    model.use_pages(16, mtp_layers=1, drafts=3)
    assert model.mtp[0].block[1].kind == v4.HCA
    assert_drafts_are_the_layers(model, seen, deepinfer_backend)
