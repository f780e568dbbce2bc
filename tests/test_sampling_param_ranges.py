"""Sampling parameters at the ends of their ranges, on the embedded model: a seed is any int (only its value modulo
2**64 counts), on the host's seeds and on the device's (``step_seeds``, which speculative steps launched ahead use),
and a ``top_k`` of the vocabulary size or more, however large, is off.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)

import deepinfer
from deepinfer.model import LLM, SamplingParams

SEEDS = [5, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64 + 5, 2**70 + 3]


@pytest.fixture(scope="module")
def llm(pytestconfig):
    backend = pytestconfig.getoption("deepinfer_backend") or "reference"
    return LLM(None, backend, progress=False, dtype="float32", max_model_len=128, num_blocks=32, block_size=16)


def test_any_int_seed_draws_the_same_on_the_host_and_on_the_device(llm):
    """``ModelRunner._sample`` with the device's seeds (a shift of every row by the drafts of a step in flight, here
    none) draws what it draws with the host's: a seed beyond int64 must not overflow the device's int64 seeds."""
    engine = llm.engine
    logits = torch.randn(len(SEEDS), llm.config.vocab_size, generator=torch.Generator().manual_seed(0))
    seqs = [engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=s)) for s in SEEDS]
    for seq in seqs:
        engine.abort(seq)
    with deepinfer.use(llm.backend):
        host = engine.runner._sample(logits, seqs, None, None)
        device = engine.runner._sample(logits, seqs, None, torch.zeros(len(seqs), dtype=torch.int64))
    assert host.tolist() == device.tolist()
    reduced = [engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=s % 2**64)) for s in SEEDS]
    for seq in reduced:
        engine.abort(seq)
    with deepinfer.use(llm.backend):
        assert engine.runner._sample(logits, reduced, None, None).tolist() == host.tolist()


def test_a_top_k_of_the_vocabulary_or_more_is_off(llm):
    vocab = llm.config.vocab_size
    prompts = ["def f(x):", "import os\n"]

    def texts(top_k):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, top_k=top_k)
        return [out.outputs[0].text for out in llm.generate(prompts, params)]

    off = texts(0)
    for top_k in (vocab, vocab + 1, 2**31, 2**40):
        assert texts(top_k) == off
