"""DeepSeek-V3.2 with FP8 caches (``fp8_ds_mla`` latents beside ``fp8_ds_index`` indexer keys, pages of bytes),
in batch-invariant mode: requests with prompts far longer than ``index_topk`` (some sharing a prefix), run at once
on a cache too small for all of them and preempted in the middle of decoding by swap or by recomputation, with
prefix caching on, give bitwise the tokens and log-probabilities each request gets alone with an ample cache."""

from __future__ import annotations

import pytest
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse fixture)
from test_model_batch_invariance import V32

import deepinfer
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.scheduler import Scheduler

V32_FP8 = V32 | dict(index_head_dim=128, kv_lora_rank=128)  # the FP8 records group 128 values under one scale


def result(out) -> tuple:
    return out.outputs[0].token_ids, out.outputs[0].logprobs, out.prompt_logprobs


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_fp8_caches_survive_preemption_bitwise(mode, tmp_path, monkeypatch):
    path = small_checkpoint(tmp_path, seed=3, **V32_FP8)
    shared = random_prompts(258, [40], seed=4)[0]
    prompts = [shared + p for p in random_prompts(258, [30, 52, 9], seed=5)] + random_prompts(258, [75, 44], seed=6)
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.8 * (i % 2), seed=i, ignore_eos=True, logprobs=0, prompt_logprobs=i % 3 or None
        )
        for i in range(len(prompts))
    ]
    generated_at_preemption = []
    preempt = Scheduler._preempt

    def spy(self, seq):
        generated_at_preemption.append(seq.num_generated)
        return preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    kw = dict(dtype="float32", kv_format="fp8_ds_mla", block_size=8, prefill_chunk_size=13, progress=False)
    with deepinfer.batch_invariant():
        ample = LLM(path, "reference", enable_prefix_caching=False, **kw)
        assert ample.engine.index_format == "fp8_ds_index"
        alone = [result(ample.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
        llm = LLM(path, "reference", num_blocks=20, preemption_mode=mode, max_num_batched_tokens=32, **kw)
        outs = [result(o) for o in llm.generate(prompts, params)]
    assert sum(g > 0 for g in generated_at_preemption) >= 2, f"preempted after generating: {generated_at_preemption}"
    assert outs == alone
    assert llm.engine.allocator.num_free == 20
