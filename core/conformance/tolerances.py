"""Conformance tolerances, as data: the largest worst-row relative error ``|out - ref| / |ref|`` a backend may
show against the fp32 reference, keyed ``op/variant`` (falling back to ``op``). A backend can raise one for
itself, with the reason, through ``BackendSpec.tolerances``; the report shows which value applied and why.

Where the numbers come from: a bf16 result rounded once is within 2^-8 (0.4%) of the fp32 value per element;
kernels that keep bf16 intermediates (P in P.V, partial sums across splits) stay near 1%. FP8 paths quantise the
same way as the reference, so only accumulation order and output rounding remain. Integer outputs (ids,
offsets, tokens) are always exact.
"""

from __future__ import annotations

TOLERANCES: dict[str, float] = {
    "mla_decode/bf16": 1e-2,
    "mla_decode/fp8_ds_mla": 1e-2,  # the cache is stored quantised; both sides read the same bytes
    "attention_varlen": 1e-2,
    "write_kv_cache/bf16": 0.0,  # a copy
    "write_kv_cache/fp8_ds_mla": 2e-2,  # one e4m3 step where x/scale lands on a rounding tie
    "write_index_cache/bf16": 0.0,  # a copy
    "write_index_cache/fp8_ds_index": 2e-2,  # as write_kv_cache/fp8_ds_mla
    # indexer_topk: the score gap, relative to the row's largest score, between a position only one side keeps and
    # the reference's last kept score (conformance/sparse_attention.py); bf16 q and keys multiply exactly, so only
    # the order of fp32 additions remains. Integer-valued inputs score exactly: compared exactly.
    "indexer_topk/bf16": 1e-3,
    "indexer_topk/fp8_ds_index": 1e-3,
    "indexer_topk/exact": 0.0,
    "sparse_mla/bf16": 1e-2,
    "sparse_mla/fp8_ds_mla": 1e-2,
    "quantize_fp8": 2e-2,  # ditto; scales themselves are compared through the dequantised values
    "gemm/bf16": 1e-2,
    "gemm/fp32": 1e-4,
    "gemm/fp8": 1e-2,
    "grouped_gemm/bf16": 1e-2,
    "grouped_gemm/fp8": 1e-2,
    # FP4 weights are exact in bf16 and fp32: a bf16 result rounded once, or an fp32 product near fp32 accuracy.
    "grouped_gemm/fp4": 1e-2,
    "grouped_gemm/fp4-fp32": 1e-4,
    "moe_route": 1e-5,  # fp32 weights; ids exact
    "moe_route_hash": 1e-5,  # ditto
    "ep_dispatch": 0.0,  # a permutation: exact
    "ep_combine": 1e-2,  # fp32 sums of bf16 rows, rounded to bf16
    "rms_norm": 1e-2,
    "layer_norm": 1e-2,
    "rope": 1e-2,
    "silu_and_mul": 1e-2,
    "silu_and_mul/fp8": 2e-2,
    # hyper-connections: bf16 streams round the collapsed input or the new streams once; fp32 cases check post and
    # comb (after the Sinkhorn iterations) near fp32 accuracy: sums over N*D products in another order.
    "hc_pre": 1e-2,
    "hc_pre/fp32": 1e-4,
    "hc_post": 1e-2,
    "hc_post/fp32": 1e-5,
    "hc_head": 1e-2,
    "hc_head/fp32": 1e-4,
    # DeepSeek-V4's compressed attention: a bf16 result rounded once (the pooling weights rounded to kv's dtype first,
    # as transformers does); fp32 cases near fp32 accuracy. The indexer's cases are integer-valued: exact.
    "compress_kv": 1e-2,
    "compress_kv/fp32": 1e-5,
    "indexer_topk_entries/exact": 0.0,
    "sparse_attention_sinks": 1e-2,
    "sparse_attention_sinks/fp32": 1e-5,
    "sample": 0.0,  # greedy rows exact; sampled rows must lie in the kept set
    "apply_token_bitmask": 0.0,  # bitwise: kept logits unchanged, forbidden ones -inf
    "sample/distribution": 0.05,  # total variation between drawn frequencies and softmax(logits / T)
}


def tolerance(op: str, variant: str, overrides: dict[str, tuple[float, str]] | None = None) -> tuple[float, str]:
    """The tolerance for ``op/variant`` and where it comes from."""
    key = f"{op}/{variant}"
    for k in (key, op):
        if overrides and k in overrides:
            value, why = overrides[k]
            return value, f"backend override: {why}"
    for k in (key, op):
        if k in TOLERANCES:
            return TOLERANCES[k], "default"
    raise KeyError(f"no conformance tolerance for {key}")
