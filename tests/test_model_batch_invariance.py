"""Batch invariance end to end: with ``DEEPINFER_BATCH_INVARIANT=1`` a request's tokens and log-probabilities (greedy
and seeded sampling) are bitwise the same alone and inside batches of 1 to 64 mixed requests, on every backend that
declares ``batch_invariant``. Prompts of different lengths are prefilled in chunks and share steps with other
requests' prefills and decodes. Preemption, by swap or by recomputation, changes nothing either."""

from __future__ import annotations

import random

import pytest
from model_helpers import one_thread, random_prompts, small_checkpoint  # noqa: F401 (one_thread: autouse fixture)

import deepinfer
from deepinfer import registry
from deepinfer.model import LLM, SamplingParams
from deepinfer.model.scheduler import Scheduler


def mixed_requests(n: int, rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(258, [rng.randint(1, 40) for _ in range(n)], seed=rng.randint(0, 1 << 30))
    params = []
    for i in range(n):
        greedy = i % 3 == 0
        params.append(
            SamplingParams(
                max_tokens=rng.randint(3, 12),
                temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                top_k=rng.choice([0, 0, 5, 50]),
                seed=rng.randint(0, 1 << 40),
                ignore_eos=True,
                logprobs=rng.choice([0, 2]),
                prompt_logprobs=0 if i % 4 == 0 else None,
            )
        )
    return prompts, params


def result(out) -> tuple:
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.top_logprobs, out.prompt_logprobs


# DeepSeek-V3.2: each query attends only to the 6 cached tokens its indexer keeps (prompts reach 40 tokens).
V32 = dict(
    architectures=["DeepseekV32ForCausalLM"],
    model_type="deepseek_v32",
    index_n_heads=8,
    index_head_dim=32,
    index_topk=6,
)


@pytest.mark.parametrize(("arch", "dtype"), [("v3", "bfloat16"), ("v3", "float32"), ("v32", "bfloat16")])
def test_tokens_identical_alone_and_in_batches_of_1_to_64(
    arch, dtype, tmp_path, monkeypatch, deepinfer_backend, deepinfer_device
):
    spec = registry.get().lookup(deepinfer_backend)
    if "batch_invariant" not in spec.capabilities:
        pytest.skip(f"{deepinfer_backend} does not declare batch_invariant")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert deepinfer.batch_invariant_enabled()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ckpt = small_checkpoint(tmp_path, seed=seed % 1000, **(V32 if arch == "v32" else {}))
    prompts, params = mixed_requests(64, rng)
    llm = LLM(
        ckpt,
        deepinfer_backend,
        device=deepinfer_device,
        dtype=dtype,
        block_size=8,
        prefill_chunk_size=16,
        max_num_batched_tokens=128,
        max_num_seqs=64,
        progress=False,
    )
    everything = [result(o) for o in llm.generate(prompts, params)]
    assert len({tuple(r[0]) for r in everything}) > 32, "the requests are meant to differ"
    for size in (1, 1, 1, 2, 5, 16, 40):
        chosen = rng.sample(range(64), size)
        outs = llm.generate([prompts[i] for i in chosen], [params[i] for i in chosen])
        for i, out in zip(chosen, outs):
            assert result(out) == everything[i], f"request {i} differs in a batch of {size} (seed {seed})"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_preemption_by_swap_and_by_recomputation_keeps_every_request_as_it_is_alone(
    dtype, tmp_path, monkeypatch, deepinfer_backend, deepinfer_device
):
    """A cache of 8 pages of 16 tokens under 40 requests of up to 80 tokens: requests are preempted over and over,
    many after generating several tokens. Whether their pages are swapped out or dropped and recomputed, every
    request's tokens and log-probabilities are bitwise those it gets alone."""
    spec = registry.get().lookup(deepinfer_backend)
    if "batch_invariant" not in spec.capabilities:
        pytest.skip(f"{deepinfer_backend} does not declare batch_invariant")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    ckpt = small_checkpoint(tmp_path, seed=seed % 1000)
    n = 40
    prompts = random_prompts(258, [rng.randint(1, 40) for _ in range(n)], seed=rng.randint(0, 1 << 30))
    params = [
        SamplingParams(
            max_tokens=rng.randint(8, 40),
            temperature=0.0 if i % 3 == 0 else rng.choice([0.7, 1.0]),
            seed=rng.randint(0, 1 << 40),
            ignore_eos=True,
            logprobs=rng.choice([0, 2]),
        )
        for i in range(n)
    ]
    generated_at_preemption: list[int] = []  # recomputation replays these generated tokens
    preempt = Scheduler._preempt

    def spy(self, seq):
        generated_at_preemption.append(seq.num_generated)
        return preempt(self, seq)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    kw = dict(device=deepinfer_device, dtype=dtype, block_size=16, progress=False)
    llm = LLM(ckpt, deepinfer_backend, num_blocks=64, **kw)
    alone = [result(llm.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]
    for mode in ("swap", "recompute"):
        generated_at_preemption.clear()
        llm = LLM(ckpt, deepinfer_backend, num_blocks=8, preemption_mode=mode, **kw)
        outs = llm.generate(prompts, params)
        where = f"{mode}, seed {seed}"
        assert llm.engine.num_preemptions == len(generated_at_preemption) >= n // 4, where
        mid_generation = sum(g >= 4 for g in generated_at_preemption)
        assert mid_generation >= n // 8, f"{mid_generation} preemptions after 4 or more generated tokens ({where})"
        differ = [i for i, out in enumerate(outs) if result(out) != alone[i]]
        assert not differ, f"{len(differ)} of {n} requests differ from their run alone ({where}): {differ}"
