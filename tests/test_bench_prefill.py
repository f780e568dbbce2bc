"""``benchmarks/bench_prefill.py``'s roofline counts FLOPs from the config (``prefill_flops``, ``prefill_flops_v4``);
here they must equal the FLOPs of the products the model actually runs in one step, counted from the shapes each op
is called with (the reference backend on a tiny checkpoint), for DeepSeek-V3's decompressed prefill, DeepSeek-V3.2's
sparse one and DeepSeek-V4's compressed one, with a chunk that continues a cached prefix beside decoding sequences
(V4: and a fresh chunk, so that every cap the formula applies is met both ways). Formulas with planted bugs (a cap
dropped, a width taken for another) must differ from the count."""

from __future__ import annotations

import dataclasses
import inspect
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
from deepinfer.model.config_v4 import CSA, HCA, SLIDING  # noqa: E402
from deepinfer.model.scheduler import PrefillChunk, ScheduledBatch  # noqa: E402
from deepinfer.qtensor import FP4Tensor  # noqa: E402

# ops that compute no matrix product (norms, rope, routing, quantisation, cache writes, sampling, and compress_kv's
# pooling: one softmax weight times one value per slot and channel)
NO_PRODUCT = {
    "write_kv_cache", "write_index_cache", "quantize_fp8", "moe_route", "moe_route_hash", "ep_dispatch", "ep_combine",
    "rms_norm", "layer_norm", "rope", "silu_and_mul", "sample", "apply_token_bitmask", "compress_kv",
}  # fmt: skip


def _rows(t) -> int:
    data = t.data if isinstance(t, QTensor) else t
    return data.numel() // data.shape[-1]


def _causal_pairs(cu_q, lens_k) -> int:
    """Query-key pairs where each query attends to its position and every one before it."""
    total = 0
    for i in range(len(cu_q) - 1):
        nq, nk = int(cu_q[i + 1] - cu_q[i]), int(lens_k[i])
        total += sum(nk - nq + j + 1 for j in range(nq))
    return total


def _gemm(a) -> tuple[int, str | None]:
    w = a["w"]
    n, k = w.shape[-2:]  # (an FP4Tensor's shape is the logical one)
    rows = int(a["masked_m"].sum()) if a.get("masked_m") is not None else _rows(a["a"])
    return 2 * rows * n * k, "fp8" if isinstance(w, QTensor) else "fp4" if isinstance(w, FP4Tensor) else None


def _attention_varlen(a) -> tuple[int, str | None]:
    q, v, cu_k = a["q"], a["v"], a["cu_seqlens_k"]
    pairs = _causal_pairs(a["cu_seqlens_q"], (cu_k[1:] - cu_k[:-1]).tolist())
    return 2 * pairs * q.shape[1] * (q.shape[2] + v.shape[2]), None


def _mla_decode(a) -> tuple[int, str | None]:
    q = a["q"]
    return 2 * int(a["seq_lens"].sum()) * q.shape[2] * (q.shape[3] + a["kv_lora_rank"]), None


def _sparse_mla(a) -> tuple[int, str | None]:
    q = a["q"]
    return 2 * int((a["indices"] >= 0).sum()) * q.shape[1] * (q.shape[2] + a["kv_lora_rank"]), None


def _indexer_topk(a) -> tuple[int, str | None]:
    q = a["q"]
    pairs = _causal_pairs(a["cu_seqlens_q"], a["seq_lens"].tolist())
    return 2 * pairs * q.shape[1] * q.shape[2], "fp8" if a["index_cache"].dtype == torch.uint8 else None


def _indexer_topk_entries(a) -> tuple[int, str | None]:
    q = a["q"]
    return 2 * int(a["key_count"].sum()) * q.shape[1] * q.shape[2], None


def _sparse_attention_sinks(a) -> tuple[int, str | None]:
    q, kv = a["q"], a["kv"]
    return 2 * int((a["indices"] >= 0).sum()) * q.shape[1] * (q.shape[2] + kv.shape[1]), None


def _hc_pre(a) -> tuple[int, str | None]:  # the projection onto the mixes, then the collapse 1 x N by N x D
    t, n, d = a["streams"].shape
    return 2 * t * n * d * a["fn"].shape[0] + 2 * t * n * d, None


def _hc_post(a) -> tuple[int, str | None]:  # [post | comb^T] (N x N+1) by [block_out; streams] (N+1 x D)
    t, n, d = a["streams"].shape
    return 2 * t * n * (n + 1) * d, None


COUNTERS = {
    "gemm": _gemm,
    "grouped_gemm": _gemm,
    "attention_varlen": _attention_varlen,
    "mla_decode": _mla_decode,
    "sparse_mla": _sparse_mla,
    "indexer_topk": _indexer_topk,
    "indexer_topk_entries": _indexer_topk_entries,
    "sparse_attention_sinks": _sparse_attention_sinks,
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
    "hc_head": _hc_pre,  # the same two products, onto N mixes
}


class FlopSpy:
    """Counts ``2 m k n`` for every product the wrapped ops compute, from their arguments' shapes: in all
    (``flops``), of FP8 weights or over an FP8 key cache (``fp8``), of FP4 weights (``fp4``)."""

    def __init__(self, monkeypatch):
        self.flops = self.fp8 = self.fp4 = 0
        for name, counter in COUNTERS.items():
            monkeypatch.setattr(ops, name, self._wrap(getattr(ops, name), counter))

    def _wrap(self, real, counter):
        signature = inspect.signature(real)

        def spied(*args, **kwargs):
            flops, kind = counter(signature.bind(*args, **kwargs).arguments)
            self.flops += flops
            self.fp8 += flops if kind == "fp8" else 0
            self.fp4 += flops if kind == "fp4" else 0
            return real(*args, **kwargs)

        return spied


def test_every_op_is_counted_or_known_to_compute_no_product():
    assert set(COUNTERS) | NO_PRODUCT == set(ops.OP_NAMES)


@pytest.mark.parametrize(
    "model,kv_format", [("v3", "bf16"), ("v32", "bf16"), ("v32", "fp8_ds_mla")], ids=["v3", "v32", "v32-fp8"]
)
def test_roofline_flops_are_the_flops_the_model_runs(model, kv_format, tmp_path, monkeypatch):
    config = dict(bench_model.V32 if model == "v32" else bench_model.V3, num_hidden_layers=3, first_k_dense_replace=1)
    config |= bench_model.TINY | ({"index_n_heads": 8, "index_topk": 64} if model == "v32" else {})
    # every dimension the count names distinct (the value head from the key's too; every FP8 product's K a multiple of
    # 128), so that a formula taking one for another fails
    config |= {
        "qk_nope_head_dim": 48,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
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
    assert spy.fp4 == 0
    assert bench_prefill.step_flops(llm, [(80, 120)], [100, 100]) == counted
    planted = {"attention over every earlier token": {"index_topk": 1 << 20}} if model == "v32" else {}
    planted["experts at the dense width"] = {"moe_intermediate_size": config["intermediate_size"]}
    planted["values at the key width"] = {"v_head_dim": config["qk_nope_head_dim"] + config["qk_rope_head_dim"]}
    for bug, fields in planted.items():
        wrong = bench_prefill.prefill_flops(
            dataclasses.replace(llm.config, **fields), [(80, 120)], [100, 100], index_fp8
        )
        assert wrong["total"] != spy.flops, bug


# DeepSeek-V4 at toy sizes with every dimension the count names distinct (and every K of a linear the checkpoint
# holds in FP8 a multiple of 128): each attention type once, the first layer hash-routed.
V4_DISTINCT = {
    "num_hidden_layers": 3,
    "layer_types": [CSA, SLIDING, HCA],
    "num_hash_layers": 1,
    "vocab_size": 600,
    "hidden_size": 256,
    "q_lora_rank": 384,
    "moe_intermediate_size": 128,
    "num_attention_heads": 8,
    "head_dim": 96,
    "qk_rope_head_dim": 32,
    "o_groups": 3,
    "o_lora_rank": 512,
    "n_routed_experts": 20,
    "num_experts_per_tok": 5,
    "hc_mult": 4,
    "sliding_window": 12,
    "compress_rates": {CSA: 2, HCA: 16},
    "index_n_heads": 6,
    "index_head_dim": 80,
    "index_topk": 7,
}


def _dequantize_linears(llm: LLM) -> None:
    """The model's FP8 linears dequantised in place, as the loader leaves a weight whose scales the FP8 ops cannot
    use (``V4Checkpoint.read_fp8``)."""
    dtype = llm.model.lm_head.dtype
    plain = lambda w: w.dequantize().to(dtype) if isinstance(w, QTensor) else w
    for _, attn, _, moe, _ in llm.model.layers:
        attn.w = {name: plain(w) for name, w in attn.w.items()}
        moe.s13, moe.s2 = plain(moe.s13), plain(moe.s2)


@pytest.mark.parametrize(
    "kv_format,fp8_linears",
    [("bf16", True), ("fp8_ds_mla", True), ("bf16", False)],
    ids=["bf16", "fp8", "dequantised-linears"],
)
def test_v4_roofline_flops_are_the_flops_the_model_runs(kv_format, fp8_linears, tmp_path, monkeypatch):
    config = dict(bench_model.V4) | bench_model.TINY_V4 | V4_DISTINCT
    bench_model.write_checkpoint_v4(tmp_path / "ckpt", config, torch.device("cpu"), seed=0)
    llm = LLM(tmp_path / "ckpt", "reference", device="cpu", kv_format=kv_format, num_blocks=160, max_num_seqs=4,
              max_model_len=1024, enforce_eager=True, progress=False)  # fmt: skip
    assert llm.model.cfg.layer_types == (CSA, SLIDING, HCA)
    assert all(isinstance(moe.w13, FP4Tensor) for moe in llm.model.moe_layers())
    if not fp8_linears:
        _dequantize_linears(llm)
    assert bench_prefill.holds_fp8_linears(llm) == fp8_linears
    # a chunk continuing an 80-token prefix (prefilled by real steps), a fresh one shorter than the window and than
    # index_topk compressed entries, and sequences decoding beside them, one long, one short (odd contexts: a formula
    # taking the context for the new token's position would count an entry more)
    with deepinfer.use("reference"):
        decodes = bench_model.fake_context(llm, 1, 101, seed=0) + bench_model.fake_context(llm, 1, 7, seed=1)
        seq = bench_prefill.prompt_sequence(llm, "chunk", 200, 80, seed=3)
        fresh = bench_prefill.prompt_sequence(llm, "fresh", 10, 0, seed=4)
        batch = ScheduledBatch(decodes=decodes, prefills=[PrefillChunk(seq, 80, 200), PrefillChunk(fresh, 0, 10)])
        spy = FlopSpy(monkeypatch)
        llm.engine.runner.execute(batch)
    chunks, decode_lens = [(80, 120), (0, 10)], [101, 7]
    counted = bench_prefill.prefill_flops_v4(llm.config, chunks, decode_lens, fp8_linears)
    assert spy.flops > 0 and counted["total"] == spy.flops
    assert counted["fp8"] == spy.fp8 and counted["fp8"] + counted["bf16"] == counted["total"]
    assert counted["parts"]["experts"] == spy.fp4 > 0  # FP4 experts: in the bf16 class
    assert (counted["fp8"] > 0) == fp8_linears
    assert bench_prefill.step_flops(llm, chunks, decode_lens) == counted

    cfg = llm.config
    planted = {
        "attention over the whole prefix, no window": {"sliding_window": 1 << 20},
        "compressed sparse attention over every entry": {"index_topk": 1 << 20},
        "experts at the hidden width": {"moe_intermediate_size": cfg.hidden_size},
        "one routed expert too few": {"num_experts_per_tok": cfg.num_experts_per_tok - 1},
        "the compression rates swapped": {"compress_rates": {CSA: 16, HCA: 2}},
        "every layer heavily compressed": {"layer_types": (HCA,) * 3},
        "indexer at the attention's head count": {"index_n_heads": cfg.num_attention_heads},
        "one output group": {"o_groups": 1},
        "two residual streams": {"hc_mult": 2},
    }
    for bug, fields in planted.items():
        wrong = bench_prefill.prefill_flops_v4(dataclasses.replace(cfg, **fields), chunks, decode_lens, fp8_linears)
        assert wrong["total"] != spy.flops, bug
    wrong = bench_prefill.prefill_flops_v4(cfg, chunks, decode_lens, not fp8_linears)
    assert wrong["fp8"] != spy.fp8, "the FP8 class of linears the model does not hold in FP8"
