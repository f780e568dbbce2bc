"""``benchmarks/bench_prefill.py``'s roofline counts FLOPs from the config (``prefill_flops``); here they must equal
the FLOPs of the products the model actually runs in one step, counted from the shapes each op is called with (the
reference backend on a tiny checkpoint), for DeepSeek-V3's decompressed prefill and DeepSeek-V3.2's sparse one, with
a chunk that continues a cached prefix beside decoding sequences."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
bench_model = pytest.importorskip("bench_model")
bench_prefill = pytest.importorskip("bench_prefill")

import deepinfer  # noqa: E402
from deepinfer import QTensor, ops  # noqa: E402
from deepinfer.model import LLM  # noqa: E402
from deepinfer.model.scheduler import PrefillChunk, ScheduledBatch  # noqa: E402


def _rows(t) -> int:
    data = t.data if isinstance(t, QTensor) else t
    return data.numel() // data.shape[-1]


class FlopSpy:
    """Counts ``2 m k n`` for every product the wrapped ops compute, from their arguments' shapes."""

    def __init__(self, monkeypatch):
        self.flops = 0
        self.fp8 = 0  # of which products of FP8 weights, and indexer scores over an FP8 key cache
        real = {name: getattr(ops, name) for name in ("gemm", "grouped_gemm", "attention_varlen", "mla_decode",
                                                      "sparse_mla", "indexer_topk")}  # fmt: skip

        def count(flops: int, fp8: bool) -> None:
            self.flops += flops
            self.fp8 += flops if fp8 else 0

        def gemm(x, w, **kw):
            n, k = (w.data if isinstance(w, QTensor) else w).shape[-2:]
            count(2 * _rows(x) * n * k, isinstance(w, QTensor))
            return real["gemm"](x, w, **kw)

        def grouped_gemm(a, w, **kw):
            n, k = (w.data if isinstance(w, QTensor) else w).shape[-2:]
            rows = int(kw["masked_m"].sum()) if kw.get("masked_m") is not None else _rows(a)
            count(2 * rows * n * k, isinstance(w, QTensor))
            return real["grouped_gemm"](a, w, **kw)

        def causal_pairs(cu_q, lens_k) -> int:  # each query attends to its position and every one before it
            total = 0
            for i in range(len(cu_q) - 1):
                nq, nk = int(cu_q[i + 1] - cu_q[i]), int(lens_k[i])
                total += sum(nk - nq + j + 1 for j in range(nq))
            return total

        def attention_varlen(q, k, v, cu_q, cu_k, **kw):
            pairs = causal_pairs(cu_q, (cu_k[1:] - cu_k[:-1]).tolist())
            self.flops += 2 * pairs * q.shape[1] * (q.shape[2] + v.shape[2])
            return real["attention_varlen"](q, k, v, cu_q, cu_k, **kw)

        def mla_decode(q, kv_cache, block_table, seq_lens, **kw):
            self.flops += 2 * int(seq_lens.sum()) * q.shape[2] * (q.shape[3] + kw["kv_lora_rank"])
            return real["mla_decode"](q, kv_cache, block_table, seq_lens, **kw)

        def sparse_mla(q, kv_cache, indices, **kw):
            self.flops += 2 * int((indices >= 0).sum()) * q.shape[1] * (q.shape[2] + kw["kv_lora_rank"])
            return real["sparse_mla"](q, kv_cache, indices, **kw)

        def indexer_topk(q, weights, index_cache, block_table, cu_q, seq_lens, **kw):
            count(2 * causal_pairs(cu_q, seq_lens.tolist()) * q.shape[1] * q.shape[2], index_cache.dtype == torch.uint8)
            return real["indexer_topk"](q, weights, index_cache, block_table, cu_q, seq_lens, **kw)

        for name, fn in (
            ("gemm", gemm),
            ("grouped_gemm", grouped_gemm),
            ("attention_varlen", attention_varlen),
            ("mla_decode", mla_decode),
            ("sparse_mla", sparse_mla),
            ("indexer_topk", indexer_topk),
        ):
            monkeypatch.setattr(ops, name, fn)  # fmt: skip


@pytest.mark.parametrize(
    "model,kv_format", [("v3", "bf16"), ("v32", "bf16"), ("v32", "fp8_ds_mla")], ids=["v3", "v32", "v32-fp8"]
)
def test_roofline_flops_are_the_flops_the_model_runs(model, kv_format, tmp_path, monkeypatch):
    config = dict(bench_model.V32 if model == "v32" else bench_model.V3, num_hidden_layers=3, first_k_dense_replace=1)
    config |= bench_model.TINY | ({"index_n_heads": 8, "index_topk": 64} if model == "v32" else {})
    # every dimension the count names distinct (and every FP8 product's K a multiple of 128), so that a formula taking
    # one for another fails
    config |= {
        "qk_nope_head_dim": 48,
        "qk_rope_head_dim": 16,
        "v_head_dim": 64,
        "q_lora_rank": 512,
        "kv_lora_rank": 384,
    }
    bench_model.write_checkpoint(tmp_path / "ckpt", config, torch.device("cpu"), seed=0)
    llm = LLM(tmp_path / "ckpt", "reference", device="cpu", kv_format=kv_format, num_blocks=32, max_num_seqs=4,
              max_model_len=1024, enforce_eager=True, progress=False)  # fmt: skip
    with deepinfer.use("reference"):
        decodes = bench_model.fake_context(llm, 2, 100, seed=0)
        seq = bench_prefill.prompt_sequence(llm, "chunk", 200, 80, seed=3)  # tokens 80..199: a continued prompt
        batch = ScheduledBatch(decodes=decodes, prefills=[PrefillChunk(seq, 80, 200)])
        spy = FlopSpy(monkeypatch)
        llm.engine.runner.execute(batch)
    index_fp8 = llm.engine.index_cache is not None and llm.engine.index_cache.dtype == torch.uint8
    assert index_fp8 == (kv_format == "fp8_ds_mla")
    counted = bench_prefill.prefill_flops(llm.config, [(80, 120)], [100, 100], index_fp8)
    assert spy.flops > 0 and counted["total"] == spy.flops
    assert counted["fp8"] == spy.fp8 and counted["fp8"] + counted["bf16"] == counted["total"]
