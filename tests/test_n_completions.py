"""``SamplingParams.n``: several completions of one prompt from ``LLM.generate`` and ``LLM.stream``, each the
completion a single request with its seed gives (``sample_seed``), bitwise in batch-invariant mode; the engine itself
takes one completion a request."""

from __future__ import annotations

import pytest
from model_helpers import one_thread  # noqa: F401 (autouse fixture)

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.errors import RequestError
from deepinfer.model.sampling_params import sample_seed

PROMPTS = ["def merge(a, b):", "import os\n"]


@pytest.fixture(scope="module")
def llm(deepinfer_backend_name):
    return LLM(None, deepinfer_backend_name, dtype="float32", progress=False, block_size=16, prefill_chunk_size=16)


@pytest.fixture(scope="module")
def deepinfer_backend_name(pytestconfig):
    return pytestconfig.getoption("deepinfer_backend") or "reference"


def test_each_of_n_seeded_completions_is_the_one_its_seed_gives(llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=42, logprobs=0)
    with deepinfer.batch_invariant():
        outs = llm.generate(PROMPTS, params)
        assert llm.last_stats["requests"] == 2
        singles = [
            llm.generate(p, SamplingParams(max_tokens=12, temperature=1.0, seed=sample_seed(42, i), logprobs=0))[0]
            for p in PROMPTS
            for i in range(3)
        ]
    for k, out in enumerate(outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for i, c in enumerate(out.outputs):
            single = singles[3 * k + i].outputs[0]
            assert (c.token_ids, c.logprobs, c.text) == (single.token_ids, single.logprobs, single.text)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three draws, not one drawn three times"
    assert sample_seed(42, 0) == 42 and len({sample_seed(42, i) for i in range(100)}) == 100


def test_greedy_completions_agree_and_streaming_tags_each_completion(llm):
    params = SamplingParams(n=2, max_tokens=10, temperature=0)
    (out,) = llm.generate(PROMPTS[0], params)
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    finals = {o.outputs[0].index: o.outputs[0] for o in llm.stream(PROMPTS[0], params) if o.finished}
    assert {i: c.token_ids for i, c in finals.items()} == {i: c.token_ids for i, c in enumerate(out.outputs)}


def test_bad_n_is_refused_and_the_engine_takes_one_completion_a_request(llm):
    for n in (0, -1, 1.5, True, 129):
        with pytest.raises(RequestError, match="n must be"):
            SamplingParams(n=n)
    with pytest.raises(RequestError, match="one completion per request"):
        llm.engine.add_request([5, 6, 7], SamplingParams(n=2))


def test_each_completion_has_its_own_grammar_matcher(llm):
    """Sampled completions of a constrained request each follow the constraint on their own (one matcher each: a
    shared one would be fed every completion's tokens and refuse or end them early)."""
    from deepinfer.model.structured_output import StructuredOutputsParams

    choices = ["return a + b", "return sorted(a + b)", "yield from a"]
    params = SamplingParams(
        n=4, max_tokens=16, temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    (out,) = llm.generate(PROMPTS[0], params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs), [c.text for c in out.outputs]
