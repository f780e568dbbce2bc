"""DeepSeek-V4 (a window of 8, rates 4 and 128) at the edges of its windows and of the context.

Prompts of one token, of exactly the sliding window and of one more; a context (``max_model_len``) that ends right
after the first HCA window closes (129: the last sampled token is read at position 127, the window's last) and one of
exactly the window plus one. Every request stops at the context or at ``max_tokens`` with ``length``, and its prompt
and generated log-probabilities are within 1e-3 nats of transformers' fp32 oracle (greedy tokens its best, or within
that of it). A prompt of the whole context is refused.
"""

from __future__ import annotations

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from test_v4_prefix_groups import FLASH_RATES

from deepinfer.model import LLM, SamplingParams
from deepinfer.model.errors import RequestError

WINDOW = FLASH_RATES["sliding_window"]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-flash-rates")
    return path, v4.v4_checkpoint(path, seed=5, **FLASH_RATES)


@pytest.mark.parametrize(
    "max_model_len, lengths",
    [(None, [1, WINDOW, WINDOW + 1]), (129, [1, WINDOW + 1, 127, 128]), (WINDOW + 1, [1, WINDOW])],
)
def test_window_and_context_edges_match_transformers(
    max_model_len,
    lengths,
    flash,
    deepinfer_backend,
    deepinfer_device,
):
    path, oracle = flash
    g = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in lengths]
    max_tokens = 20
    llm = LLM(
        path,
        deepinfer_backend,
        device=deepinfer_device,
        dtype="float32",
        block_size=64,
        prefill_chunk_size=5,
        max_model_len=max_model_len,
        progress=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    for p, out in zip(prompts, llm.generate(prompts, params)):
        gen = out.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "length"
        assert len(p) + len(gen) == min(llm.max_model_len, len(p) + max_tokens)
        full = p + gen
        ref = v4.oracle_logprobs(oracle, full)
        errs = [abs(ref[j - 1, full[j]].item() - out.prompt_logprobs[j]) for j in range(1, len(p))]
        errs += [abs(ref[len(p) - 1 + j, t].item() - lp) for j, (t, lp) in enumerate(zip(gen, out.outputs[0].logprobs))]
        assert max(errs) < v4.TOL
        for j, t in enumerate(gen):
            row = ref[len(p) - 1 + j]
            assert int(row.argmax()) == t or float(row.max() - row[t]) < v4.TOL
    if max_model_len is not None:
        with pytest.raises(RequestError, match="context"):
            llm.generate([[5] * max_model_len], params)
