"""DeepSeek-V4 with its routed experts sharded over 2 Gloo ranks on the CPU, against one process holding every
expert: the same greedy and seeded tokens with log-probabilities within fp32 noise, bitwise the same in
batch-invariant mode, through hash-routed and top-k routed MoE layers, chunked prefill and decode; each rank holds
its block of the experts only. The harness (``ep_harness.launch``) kills whatever is left, so a bug fails, never
hangs."""

from __future__ import annotations

import pytest
import torch
from ep_harness import launch

import deepinfer
from deepinfer.model import LLM, SamplingParams

ENGINE = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16)
LENGTHS = [1, 6, 21, 40]
WORLD = 2


def build(path, ep: int | None) -> LLM:
    return LLM(path, "reference", dtype="float32", progress=False, ep=ep, **ENGINE)


def generation(path, ep: int | None, invariant: bool) -> dict:
    llm = build(path, ep)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, llm.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)] * 2 + [
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=s, ignore_eos=True, logprobs=0) for s in (1, 2)
    ]
    with deepinfer.batch_invariant(invariant):
        outs = llm.generate(prompts, params)
    # as numpy arrays: pickled by value (a tensor would be shared with the parent through this process, which may
    # have exited by the time the parent reads it)
    experts = [(ffn.w13.numpy().copy(), ffn.w2.numpy().copy()) for *_, ffn, _ in llm.model.layers]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [o.outputs[0].logprobs for o in outs],
        "local": llm.ep.local,
        "experts": experts,
    }


def sc_normal(rank: int, world: int, path) -> dict:
    return generation(path, world, invariant=False)


def sc_invariant(rank: int, world: int, path) -> dict:
    return generation(path, world, invariant=True)


SCENARIOS = {"normal": sc_normal, "invariant": sc_invariant}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from test_model_v4 import CONFIGS, v4_checkpoint

    path = tmp_path_factory.mktemp("v4-ep")
    v4_checkpoint(path, seed=9, **CONFIGS["plain"])
    return path


@pytest.fixture(scope="module")
def runs(ckpt):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = {name: generation(ckpt, None, invariant=name == "invariant") for name in ("normal", "invariant")}
    finally:
        torch.set_num_threads(before)
    ranks = launch(__name__, WORLD, list(SCENARIOS), args=(ckpt,), pg_timeout_s=30.0, deadline_s=120.0)
    return one, ranks


def payloads(ranks, name: str) -> list:
    out = []
    for rank in range(WORLD):
        err, payload, _ = ranks[(rank, name)]
        assert err is None, f"rank {rank}:\n{err}"
        out.append(payload)
    return out


def test_v4_with_sharded_experts_gives_one_process_tokens(runs):
    one, ranks = runs
    ref = one["normal"]
    for rank, got in enumerate(payloads(ranks, "normal")):
        assert got["tokens"] == ref["tokens"], f"rank {rank}"
        for g, w in zip(got["logprobs"], ref["logprobs"]):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-4)


def test_v4_with_sharded_experts_is_bitwise_one_process_in_batch_invariant_mode(runs):
    one, ranks = runs
    ref = one["invariant"]
    for rank, got in enumerate(payloads(ranks, "invariant")):
        assert (got["tokens"], got["logprobs"]) == (ref["tokens"], ref["logprobs"]), f"rank {rank}"


def test_each_rank_holds_its_block_of_v4_experts(runs):
    one, ranks = runs
    full = one["normal"]["experts"]
    per = full[0][0].shape[0] // WORLD
    for rank, got in enumerate(payloads(ranks, "normal")):
        assert got["local"] == tuple(range(rank * per, (rank + 1) * per))
        for (w13, w2), (f13, f2) in zip(got["experts"], full):
            assert (w13 == f13[rank * per : (rank + 1) * per]).all()
            assert (w2 == f2[rank * per : (rank + 1) * per]).all()
