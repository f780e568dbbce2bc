"""DeepSeek-V4 served with prefill chunks that do not line up with its compression windows.

V4-Flash's rates (4 and 128) with prompts longer than the sliding window, than ``index_topk`` windows of the CSA
layer and than one HCA window, prefilled in chunks of 5, 13 and 130 tokens (and in one chunk): every chunk boundary
but a few falls inside an unfinished window, whose projections the next chunk reads back from the state pages. In
batch-invariant mode the prompt log-probabilities and the greedy tokens and their log-probabilities are bitwise those
of the one-chunk prefill (and, each prompt served alone, those it gets in the batch of prompts of other lengths),
which is within 1e-3 nats of transformers' fp32 ``DeepseekV4ForCausalLM``.
"""

from __future__ import annotations

import pytest
import test_model_v4 as v4
import torch
from model_helpers import one_thread  # noqa: F401 (autouse fixture)
from test_v4_prefix_groups import FLASH_RATES

import deepinfer
from deepinfer.model import LLM, SamplingParams

LENGTHS = [300, 129, 9, 1]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4-flash-rates")
    return path, v4.v4_checkpoint(path, seed=5, **FLASH_RATES)


def test_unaligned_chunks_give_the_bits_of_one_chunk(flash, deepinfer_backend, deepinfer_device):
    path, oracle = flash
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 160, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    got = {}
    with deepinfer.batch_invariant():
        for chunk in (512, 5, 13, 130):
            llm = LLM(
                path,
                deepinfer_backend,
                device=deepinfer_device,
                dtype="float32",
                prefill_chunk_size=chunk,
                max_num_batched_tokens=512,
                progress=False,
            )
            outs = llm.generate(prompts, params)
            got[chunk] = [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        alone = [llm.generate([p], params)[0] for p in prompts]  # chunks of 130, each prompt by itself
    assert [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone] == got[130]
    for chunk in (5, 13, 130):
        assert got[chunk] == got[512], f"chunks of {chunk}"
    for p, (prompt_lps, tokens, lps) in zip(prompts, got[512]):
        full = p + tokens
        ref = v4.oracle_logprobs(oracle, full)
        errs = [abs(ref[j - 1, full[j]].item() - prompt_lps[j]) for j in range(1, len(p))]
        errs += [abs(ref[len(p) - 1 + j, t].item() - lp) for j, (t, lp) in enumerate(zip(tokens, lps))]
        assert max(errs) < v4.TOL
        for j, t in enumerate(tokens):
            row = ref[len(p) - 1 + j]
            assert int(row.argmax()) == t or float(row.max() - row[t]) < v4.TOL
