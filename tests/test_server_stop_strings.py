"""Stop strings: where the text ends, through ``RequestStream`` (shared by the server and ``LLM``) and a real server
over the embedded model.

The cut depends on the generated text alone: of several stop strings it is the one the text completes first,
however many tokens each step adds (one, or several with speculative decoding) and wherever the tokens' boundaries
fall; a stop string that straddles a token boundary, or the boundary between two streamed chunks, ends the text just
before it (after it with ``include_stop_str_in_output``), streamed or whole, with nothing past it sent; its tokens
and log-probabilities end with the token that completes it, as decoding one token a step ends them.
"""

from __future__ import annotations

import openai
import pytest
import torch
from test_server import NUM_BLOCKS, llm_kwargs, running_server, wait_idle

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.sequence import Sequence, Status
from deepinfer.model.streaming import RequestStream

PROMPT = "class Parser:\n    def"


class _Engine:
    """What ``RequestStream.update`` needs of an engine: ``abort`` (as ``LLMEngine.abort`` ends a sequence)."""

    def abort(self, seq: Sequence, finish_reason: str = "abort", stop_reason=None) -> bool:
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, finish_reason, stop_reason
        return True


def streamed_cut(tokenizer, ids: list[int], stops: list[str], per_step: int) -> tuple[str, str | None]:
    """The text and stop reason ``RequestStream`` gives for ``ids`` generated ``per_step`` tokens a step."""
    seq = Sequence("r", 0, [1], SamplingParams(max_tokens=len(ids), stop=stops), seed=0)
    seq.status = Status.RUNNING
    stream, engine, text = RequestStream(seq, tokenizer, stops), _Engine(), ""
    for i in range(0, len(ids), per_step):
        seq.token_ids.extend(ids[i : i + per_step])
        if i + per_step >= len(ids):
            seq.status, seq.finish_reason = Status.FINISHED, "length"
        delta = stream.update(engine)
        text += delta.text if delta is not None else ""
        if seq.status is Status.FINISHED:
            break
    return text, seq.stop_reason


@pytest.fixture(scope="module")
def llm(pytestconfig):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(None, pytestconfig.getoption("deepinfer_backend") or "reference", progress=False, **llm_kwargs())
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def generated(llm):
    """The embedded model's greedy tokens and text after ``PROMPT``, and each token's end offset in the text."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    ends = [len(llm.tokenizer.decode(out.token_ids[: j + 1])) for j in range(len(out.token_ids))]
    return out.token_ids, out.text, ends


def overlapping_pairs(text: str, ends: list[int]) -> list[tuple[str, str, int]]:
    """``(longer, shorter, cut)``: a stop string ending just inside the token after the one that completes a
    shorter stop string which starts after it, and where the text ends (before the shorter one, met first)."""
    pairs = []
    for e in ends[1:-1]:
        short, long = text[e - 2 : e], text[e - 3 : e + 1]
        if e >= 3 and text.find(short) == e - 2 and text.find(long) == e - 3:
            pairs.append((long, short, e - 2))
    return pairs


def test_the_stop_met_first_ends_the_text_however_many_tokens_a_step_adds(llm, generated):
    ids, text, ends = generated
    pairs = overlapping_pairs(text, ends)
    assert len(pairs) >= 5, text
    for long, short, cut in pairs:
        for per_step in (1, 2, 3, len(ids)):
            assert streamed_cut(llm.tokenizer, ids, [long, short], per_step) == (text[:cut], short), per_step


def speculative_llm(pytestconfig, drafts: int) -> LLM:
    """The embedded model as the ``llm`` fixture serves it, proposing ``drafts`` tokens a step by its MTP layer."""
    backend = pytestconfig.getoption("deepinfer_backend") or "reference"
    return LLM(None, backend, progress=False, speculative_config={"num_speculative_tokens": drafts}, **llm_kwargs())


def test_speculative_decoding_cuts_the_text_where_decoding_one_token_a_step_does(llm, generated, pytestconfig):
    _, text, ends = generated
    spec = speculative_llm(pytestconfig, 2)
    stops = [list(pair[:2]) for pair in overlapping_pairs(text, ends)]
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=s) for s in stops]
    want = [o.outputs[0].text for o in llm.generate([PROMPT] * len(stops), params)]
    assert [o.outputs[0].text for o in spec.generate([PROMPT] * len(stops), params)] == want
    assert spec.engine.spec_stats.accepted > 0


def test_speculative_decoding_ends_the_tokens_where_decoding_one_token_a_step_does(llm, generated, pytestconfig):
    """A step that accepts drafts adds several tokens: those after the one that completes the stop string are not
    part of the output (its tokens, log-probabilities and length are those of a run without speculation)."""
    _, text, ends = generated
    spec = speculative_llm(pytestconfig, 3)
    stops = [text[e - 2 : e] for e in ends[1:-1] if text.find(text[e - 2 : e]) == e - 2]
    assert len(stops) >= 10, text
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=s, logprobs=1) for s in stops]
    with deepinfer.batch_invariant():  # (log-probabilities bitwise, whatever rows a step runs)
        want = [o.outputs[0] for o in llm.generate([PROMPT] * len(stops), params)]
        got = [o.outputs[0] for o in spec.generate([PROMPT] * len(stops), params)]
    assert spec.engine.spec_stats.accepted > 0
    for stop, a, b in zip(stops, want, got):
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, "stop", stop)
        assert b.token_ids == a.token_ids, stop
        assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs, stop


def test_stops_across_token_and_chunk_boundaries_streamed_and_whole(llm, generated):
    _, text, ends = generated
    with running_server(llm) as (state, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for j, length, include in [(3, 2, False), (8, 5, True), (14, 3, False), (20, 7, False), (27, 4, True)]:
            stop = text[ends[j] - length // 2 : ends[j] - length // 2 + length]  # across token j's end
            cut = text.index(stop) + (len(stop) if include else 0)
            kw = {"model": "tiny-py", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
            extra = {"ignore_eos": True, "include_stop_str_in_output": include}
            whole = client.completions.create(**kw, extra_body=extra).choices[0]
            chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
            assert whole.text == "".join(c.choices[0].text for c in chunks) == text[:cut], stop
            for last in (whole, chunks[-1].choices[0]):
                assert (last.finish_reason, last.stop_reason) == ("stop", stop)
            assert not any(c.choices[0].finish_reason for c in chunks[:-1])
        assert wait_idle(state).num_free == NUM_BLOCKS
