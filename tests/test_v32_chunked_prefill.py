"""DeepSeek-V3.2's sparse attention under chunked prefill, in batch-invariant mode: prompts far longer than
``index_topk`` prefilled in chunks whose ends fall inside pages and between top-k windows give bitwise the tokens,
generated log-probabilities and prompt log-probabilities of one whole prefill, with the ``bf16`` caches and with
``fp8_ds_mla`` beside FP8 indexer keys (``fp8_ds_index``)."""

from __future__ import annotations

import pytest
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from test_model_batch_invariance import V32

import deepinfer
from deepinfer.model import LLM, SamplingParams

FP8 = dict(kv_lora_rank=128, index_head_dim=128)  # the FP8 records group 128 values under one scale


def result(out) -> tuple:
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_chunked_prefill_is_bitwise_one_prefill(kv_format, tmp_path):
    path = small_checkpoint(tmp_path, seed=1, **(V32 | (FP8 if kv_format == "fp8_ds_mla" else {})))
    prompts = random_prompts(258, [150, 97, 61, 13], seed=3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    kw = dict(dtype="float32", block_size=8, kv_format=kv_format, enable_prefix_caching=False, progress=False)
    with deepinfer.batch_invariant():
        llm = LLM(path, "reference", prefill_chunk_size=1024, **kw)
        assert llm.engine.index_format == ("bf16" if kv_format == "bf16" else "fp8_ds_index")
        whole = [result(o) for o in llm.generate(prompts, params)]
        for chunk, budget in [(5, 5), (13, 16)]:  # chunk ends inside pages of 8, beside decodes of other requests
            llm = LLM(path, "reference", prefill_chunk_size=chunk, max_num_batched_tokens=budget, **kw)
            assert [result(o) for o in llm.generate(prompts, params)] == whole, f"chunks of {chunk}"
