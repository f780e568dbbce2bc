"""The pluggy hooks of the ``ascend`` backend (torch_npu on Huawei Ascend; targets Ascend 950PR / 950DT).

Each op has a fused implementation whose provider names the torch_npu operator it calls (``torch_npu.<op>``) and,
where the fused operator's documented envelope does not cover every valid argument, a plain-torch one that runs on
the NPU (``torch-composite``); the fused one is tried first. ``deepinfer info --ops --backend ascend`` lists them.

Most of these operators' docs list Atlas A2/A3 only; the backend assumes the 950 runs the same contracts (README
assumption 5). See README.md for every assumption, the precision notes and the hardware conformance command.
"""

from __future__ import annotations

import torch

from deepinfer import BackendSpec, OpImpl, hookimpl

from . import (
    activation,
    attention,
    compressed_attention,
    ep_mc2,
    gemm,
    hyper_connection,
    moe,
    norm,
    probe,
    rope,
    sampling,
    sparse_attention,
    weights,
)

NAME = "ascend"
FUSED, COMPOSITE = 10, 0
COMPOSITE_PROVIDER = "torch-composite"


def _fused(op: str, provider: str, fn, supports) -> OpImpl:
    return OpImpl(op, NAME, provider, fn, supports=supports, priority=FUSED)


def _composite(op: str, fn, *device_args: str, batch_invariant: bool = False) -> OpImpl:
    return OpImpl(
        op,
        NAME,
        COMPOSITE_PROVIDER,
        fn,
        supports=probe.supports_on_device(*device_args),
        batch_invariant=batch_invariant,
        priority=COMPOSITE,
    )


def op_impls() -> list[OpImpl]:
    fia = "torch_npu.npu_fused_infer_attention_score_v2"
    return [
        _fused("mla_decode", fia, attention.mla_decode_fia, attention.mla_decode_fia_supports),
        _composite("mla_decode", attention.mla_decode_composite, "q", "kv_cache", "block_table", "seq_lens"),
        _fused("attention_varlen", fia, attention.attention_varlen_fia, attention.attention_varlen_fia_supports),
        _composite("attention_varlen", attention.attention_varlen_composite, "q", "k", "v"),
        _fused(
            "write_kv_cache",
            "torch_npu.npu_scatter_nd_update_",
            attention.write_kv_cache_scatter,
            attention.write_kv_cache_scatter_supports,
        ),
        _fused(
            "write_index_cache",
            "torch_npu.npu_scatter_nd_update_",
            sparse_attention.write_index_cache_scatter,
            sparse_attention.write_index_cache_scatter_supports,
        ),
        _fused(
            "indexer_topk",
            "torch_npu.npu_lightning_indexer",
            sparse_attention.indexer_topk_lightning,
            sparse_attention.indexer_topk_lightning_supports,
        ),
        _composite(
            "indexer_topk",
            sparse_attention.indexer_topk_torch,
            "q",
            "weights",
            "index_cache",
            "block_table",
            "cu_seqlens_q",
            "seq_lens",
        ),
        _fused(
            "sparse_mla",
            "torch_npu.npu_sparse_flash_attention",
            sparse_attention.sparse_mla_sfa,
            sparse_attention.sparse_mla_sfa_supports,
        ),
        _composite("sparse_mla", sparse_attention.sparse_mla_torch, "q", "kv_cache", "indices"),
        _fused(
            "quantize_fp8",
            "torch_npu.npu_dynamic_block_quant",
            gemm.quantize_fp8_block_quant,
            gemm.quantize_fp8_block_quant_supports,
        ),
        _composite("quantize_fp8", gemm.quantize_fp8_torch, "x"),
        _fused("gemm", "torch_npu.npu_quant_matmul", gemm.gemm_quant_matmul, gemm.gemm_quant_matmul_supports),
        _composite("gemm", gemm.gemm_torch, "a", "w", "bias"),
        _fused("grouped_gemm", "torch_npu.npu_grouped_matmul", gemm.grouped_gemm_gmm, gemm.grouped_gemm_gmm_supports),
        _fused(
            "grouped_gemm",
            "fp4-decode+torch_npu.npu_grouped_matmul",
            gemm.grouped_gemm_fp4_gmm,
            gemm.grouped_gemm_fp4_gmm_supports,
        ),
        _composite("grouped_gemm", gemm.grouped_gemm_torch, "a", "w"),
        _fused("moe_route", "torch_npu.npu_moe_gating_top_k", moe.moe_route_gating, moe.moe_route_gating_supports),
        _composite("moe_route", moe.moe_route_torch, "logits", "bias"),
        _composite("moe_route_hash", moe.moe_route_hash_torch, "logits", "expert_ids"),
        _fused(
            "ep_dispatch",
            "torch_npu.npu_moe_init_routing_v2",
            moe.ep_dispatch_init_routing,
            moe.ep_dispatch_init_routing_supports,
        ),
        _fused(
            "ep_combine",
            "torch_npu.npu_moe_finalize_routing",
            moe.ep_combine_finalize,
            moe.ep_combine_finalize_supports,
        ),
        _fused(
            "ep_dispatch",
            "torch_npu.npu_moe_distribute_dispatch_v2",
            ep_mc2.ep_dispatch_mc2,
            ep_mc2.ep_dispatch_mc2_supports,
        ),
        _fused(
            "ep_combine",
            "torch_npu.npu_moe_distribute_combine_v2",
            ep_mc2.ep_combine_mc2,
            ep_mc2.ep_combine_mc2_supports,
        ),
        _fused("rms_norm", "torch_npu.npu_(add_)rms_norm", norm.rms_norm_fused, norm.rms_norm_fused_supports),
        _composite("rms_norm", norm.rms_norm_torch, "x", "w", "residual"),
        _composite("layer_norm", norm.layer_norm_torch, "x", "w", "b"),
        _fused("rope", "torch_npu.npu_rotary_mul", rope.rope_rotary_mul, rope.rope_rotary_mul_supports),
        _fused(
            "silu_and_mul",
            "torch_npu.npu_swiglu",
            activation.silu_and_mul_swiglu,
            activation.silu_and_mul_swiglu_supports,
        ),
        _fused(
            "hc_pre",
            "torch_npu.npu_rms_norm",
            hyper_connection.hc_pre_rms_norm,
            hyper_connection.hc_pre_rms_norm_supports,
        ),
        _composite("hc_pre", hyper_connection.hc_pre_torch, "streams", "fn", "base", "scale"),
        _fused(
            "hc_head",
            "torch_npu.npu_rms_norm",
            hyper_connection.hc_head_rms_norm,
            hyper_connection.hc_head_rms_norm_supports,
        ),
        _composite("hc_head", hyper_connection.hc_head_torch, "streams", "fn", "base", "scale"),
        _composite("hc_post", hyper_connection.hc_post_torch, "block_out", "streams", "post", "comb"),
        _composite("compress_kv", compressed_attention.compress_kv_torch, "kv", "gate", "position_bias"),
        _composite(
            "indexer_topk_entries",
            compressed_attention.indexer_topk_entries_torch,
            "q",
            "weights",
            "keys",
            "key_start",
            "key_count",
        ),
        _composite(
            "sparse_attention_sinks",
            compressed_attention.sparse_attention_sinks_torch,
            "q",
            "kv",
            "indices",
            "sinks",
        ),
        OpImpl(
            "sample",
            NAME,
            COMPOSITE_PROVIDER,
            sampling.sample_torch,
            supports=sampling.sample_torch_supports,
            batch_invariant=True,
        ),
        _composite(
            "apply_token_bitmask", sampling.apply_token_bitmask_torch, "logits", "bitmask", batch_invariant=True
        ),
    ]


def tolerances() -> dict[str, tuple[float, str]]:
    """Conformance tolerances this backend knowingly needs beyond the core's, as data with the reason."""
    out = {}
    if gemm.mx_recipe():
        out["gemm/fp8"] = gemm.MX_TOLERANCE
    if "dsa_fp32_weights" not in probe.declared_capabilities():  # the 950 (and the target, before the chip is known)
        out["indexer_topk/bf16"] = out["indexer_topk/fp8_ds_index"] = sparse_attention.BF16_WEIGHTS_TOLERANCE
    return out


@hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name=NAME,
        device_type=probe.declared_device_type(),
        aliases=("npu",),
        probe=probe.probe,
        capabilities=probe.declared_capabilities(),
        version="0.1.0",
        prepare_weight=weights.prepare_weight,
        tolerances=tolerances(),
        dist_backend="hccl",
        free_memory=lambda device: torch.npu.mem_get_info(device)[0],  # torch_npu's torch.npu namespace
    )


@hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    return op_impls()
