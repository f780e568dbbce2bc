"""GPU smoke tests of the model: CUDA-graph decode against eager decode, on a backend that declares
``cuda_graphs`` (skipped elsewhere). Run on the GPU machine with

    pytest tests/test_model_cuda.py --deepinfer-backend cuda_sm100 -v

The other model test files run there too with the same option (the model then runs on the backend's device).
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import random_prompts, small_checkpoint

from deepinfer import registry
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.engine import SHORT_PROMPT_TOKENS

# Latent and rope widths the cuda_sm100 mla_decode kernel serves in both cache formats (power-of-two widths, rope of
# at least 16, fp8_ds_mla records a multiple of 16 bytes): a reference fallback inside the step would stop capture.
KERNEL_SHAPES = dict(kv_lora_rank=512, qk_rope_head_dim=16)


@pytest.fixture
def cuda_backend(deepinfer_backend, deepinfer_device) -> str:
    spec = registry.get().lookup(deepinfer_backend)
    if "cuda_graphs" not in spec.capabilities or not torch.cuda.is_available() or deepinfer_device == "cpu":
        pytest.skip(f"{deepinfer_backend} does not run CUDA graphs here")
    return deepinfer_backend


# DeepSeek-V3.2: sparse attention with the indexer's production head shape, a top-k below the longer prompts.
V32 = dict(
    architectures=["DeepseekV32ForCausalLM"],
    model_type="deepseek_v32",
    index_n_heads=64,
    index_head_dim=128,
    index_topk=16,
)


@pytest.mark.parametrize(
    ("arch", "kv_format"), [("v3", "bf16"), ("v3", "fp8_ds_mla"), ("v32", "bf16"), ("v32", "fp8_ds_mla")]
)
def test_graph_decode_matches_eager(cuda_backend, tmp_path, arch, kv_format):
    extra = V32 if arch == "v32" else {}
    ckpt = small_checkpoint(tmp_path, seed=1, q_lora_rank=64, **KERNEL_SHAPES, **extra)
    prompts = random_prompts(258, [5, 40, 17, 1, 29], seed=2)  # 5 sequences: a padded bucket (8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    common = dict(kv_format=kv_format, block_size=16, max_num_seqs=8, progress=False)
    eager_llm = LLM(ckpt, cuda_backend, enforce_eager=True, **common)
    # the prompts run as decode rows in both (in the graphs, and eagerly here), so that only the decode path differs
    eager_llm.engine.scheduler.decode_row_tokens = SHORT_PROMPT_TOKENS
    graph_llm = LLM(ckpt, cuda_backend, **common)
    graphs = graph_llm.engine.runner.graphs
    # every bucket was captured: up to 8 sequences, and up to a short prompt's rows (SHORT_PROMPT_TOKENS)
    assert graphs is not None and sorted({b for b, _ in graphs.graphs}) == [1, 2, 4, 8, 32, 64, SHORT_PROMPT_TOKENS]
    eager, graphed = eager_llm.generate(prompts, params), graph_llm.generate(prompts, params)
    common = []
    for e, g in zip(eager, graphed):
        a, b = e.outputs[0], g.outputs[0]
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        common.append(n)
        # Along the common prefix both decoded the same context: bf16 log-probabilities agree to rounding (the
        # graph dispatches experts in low-latency mode, eager decoding in normal mode).
        assert torch.allclose(torch.tensor(a.logprobs[:n]), torch.tensor(b.logprobs[:n]), atol=0.05)
    assert sum(common) / len(common) >= 12, f"graph and eager decoding diverge early: {common}"


def test_graph_decode_with_arrivals_and_preemption(cuda_backend, tmp_path):
    ckpt = small_checkpoint(tmp_path, seed=3, **KERNEL_SHAPES)
    prompts = random_prompts(258, [30, 9, 41, 17, 3, 25, 60, 12], seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=9, ignore_eos=True)
    llm = LLM(ckpt, cuda_backend, block_size=8, num_blocks=40, max_num_seqs=8, progress=False)
    assert llm.engine.runner.graphs is not None, "the decode graphs were captured"
    outs = llm.generate(prompts, params)
    assert llm.engine.num_preemptions > 0 and all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.engine.allocator.num_free == 40


def test_batch_invariant_graph_decode_gives_the_eager_bits(cuda_backend, tmp_path, monkeypatch):
    """In batch-invariant mode the decode graphs are captured and give, bit for bit, the tokens and log-probabilities
    of eager decoding (normal-mode dispatch, no padding, synchronous scheduling), for a batch in a padded bucket and
    for each request alone, with the input tokens of steps scheduled ahead copied in on the device; graphs captured
    in the default mode are not replayed in batch-invariant mode."""
    ckpt = small_checkpoint(tmp_path, seed=5, q_lora_rank=64, **KERNEL_SHAPES)
    prompts = random_prompts(258, [5, 40, 17, 1, 29], seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)
    common = dict(block_size=16, max_num_seqs=8, progress=False)
    default_llm = LLM(ckpt, cuda_backend, **common)
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    eager_llm = LLM(ckpt, cuda_backend, enforce_eager=True, async_scheduling=False, **common)
    graph_llm = LLM(ckpt, cuda_backend, **common)
    graphs = graph_llm.engine.runner.graphs
    assert graphs is not None and graphs.invariant and sorted({b for b, _ in graphs.graphs}) == [1, 2, 4, 8]
    replays, ahead = [], []
    run = graphs.run
    graphs.run = lambda **kw: (
        replays.append(len(kw["input_ids"])) or ahead.append(kw["pending"] is not None) or run(**kw)
    )
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager_llm.generate(prompts, params)]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in graph_llm.generate(prompts, params)] == want
    assert 5 in replays, "the batch of five decoded from the bucket of 8"
    assert sum(ahead) > len(ahead) / 2, "most replays were launched before the previous step's tokens were read"
    for prompt, expected in zip(prompts, want):
        (alone,) = graph_llm.generate([prompt], params)
        assert (alone.outputs[0].token_ids, alone.outputs[0].logprobs) == expected
    assert 1 in replays
    default_graphs = default_llm.engine.runner.graphs
    assert default_graphs is not None and not default_graphs.invariant
    default_graphs.run = lambda **kw: pytest.fail("default-mode graphs replayed in batch-invariant mode")
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in default_llm.generate(prompts, params)] == want


def test_v4_graph_decode_gives_the_eager_bits(cuda_backend, tmp_path, monkeypatch):
    """DeepSeek-V4 (caches in state pages): in batch-invariant mode the captured decode graphs give, bit for bit,
    the tokens and log-probabilities of eager decoding, for a batch in a padded bucket (its padding rows on the
    scratch page), for a request alone (a bucket of one, whose hash-routed tokens may name an expert twice) and
    through graphs of several block-table widths."""
    import test_model_v4 as v4

    from deepinfer.model import cuda_graphs

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setattr(cuda_graphs, "NARROWEST_TOKENS", 8)  # graphs of several block-table widths
    v4.v4_checkpoint(tmp_path, seed=3, **v4.CONFIGS["yarn"])
    prompts = v4.prompts(seed=8)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)
    common = dict(dtype="bfloat16", block_size=4, max_num_seqs=8, max_model_len=256, progress=False)
    eager_llm = LLM(tmp_path, cuda_backend, enforce_eager=True, async_scheduling=False, **common)
    graph_llm = LLM(tmp_path, cuda_backend, **common)
    graphs = graph_llm.engine.runner.graphs
    assert graphs is not None and len(graphs.widths) == 3
    assert sorted(graphs.graphs) == [(b, w) for b in (1, 2, 4, 8) for w in graphs.widths], "every bucket captured"
    assert graphs.pad_page == graph_llm.engine.allocator.num_blocks
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager_llm.generate(prompts, params)]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in graph_llm.generate(prompts, params)] == want
    (alone,) = graph_llm.generate([prompts[2]], params)
    assert (alone.outputs[0].token_ids, alone.outputs[0].logprobs) == want[2]
    short = [prompts[2][:6]]  # decoded first in the narrowest width, then in the next
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eager_llm.generate(short, params)]
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in graph_llm.generate(short, params)] == want
