"""The pluggy hooks of the ``cuda_sm100`` backend: its description and every op it implements.

This module imports without Triton: the kernel modules are imported by ``deepinfer_op_impls``, which registers
nothing when Triton is not installed. The backend is then listed, with its aliases, as unavailable because
``triton is not installed`` (its probe), as the ``ascend`` backend is without torch_npu.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer import BackendSpec, OpImpl, hookimpl

from . import probe

NAME = "cuda_sm100"


@hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name=NAME,
        device_type="cuda",
        aliases=("cuda", "nvidia"),
        probe=probe.probe,
        capabilities=probe.capabilities(),
        version="0.1.0",
        dist_backend="nccl",
        free_memory=lambda device: torch.cuda.mem_get_info(device)[0],
    )


def _impl(op, provider, fn, supports, *, invariant=True, priority=0) -> OpImpl:
    return OpImpl(op, NAME, provider, fn, supports=supports, batch_invariant=invariant, priority=priority)


def _mla_decode_impls(attention) -> list[OpImpl]:
    """One implementation per kernel ``attention.mla_decode`` chooses between, in ``MLA_KERNELS``' order: first the
    default mode's (adaptive spans; ``gluon-split-halves``, ``gluon-split``, ``triton-split``), then the
    batch-invariant ones (fixed spans: ``gluon-scores-first``, ``gluon-fixed-split-halves``, ``gluon-fixed-split``,
    ``triton-fixed-split``). ``triton-split`` accepts every supported call, so the default mode never reaches the
    batch-invariant ones."""
    impls = []
    for invariant in (False, True):
        for kernel in attention.MLA_KERNELS:
            if kernel == "gluon-scores-first" and not invariant:
                continue
            provider = kernel.replace("split", "fixed-split") if invariant else kernel
            fn = partial(attention.mla_decode, invariant=invariant, kernel=kernel)
            supports = attention.mla_kernel_supports(kernel, invariant)
            impls.append(_impl("mla_decode", provider, fn, supports, invariant=invariant, priority=-len(impls)))
    return impls


def _gemm_impls(gemm, gemm_cublas) -> list[OpImpl]:
    """cuBLAS and the Triton kernels, in the order tried: FP8 weights by cuBLAS from ``CUBLAS_FP8_MIN_M`` rows, else
    by the swapped Triton kernel up to ``SWAP_MAX_M`` rows, else by the tiled one; dense ones by cuBLAS, else Triton
    (fp32 weights at a few rows of one K span by the Triton kernel first).
    The ``-unsplit`` ones are the batch-invariant variants (no split over K; cuBLAS only where it gave their bits).
    The Gluon kernels of ``gemm_gluon`` come before all of them."""
    fp8, fp8_unsplit = partial(gemm.gemm_fp8, invariant=False), partial(gemm.gemm_fp8, invariant=True)
    return [
        _impl("gemm", "cublas-fp8", gemm_cublas.gemm_fp8_cublas, gemm_cublas.cublas_fp8_supports, invariant=False,
              priority=3),
        _impl("gemm", "cublas-fp8-unsplit", gemm_cublas.gemm_fp8_cublas, gemm_cublas.cublas_fp8_invariant_supports,
              priority=3),
        _impl("gemm", "triton-fp8-swapped", partial(fp8, swap=True), gemm.fp8_swapped_supports, invariant=False,
              priority=2),
        _impl("gemm", "triton-fp8-swapped-unsplit", partial(fp8_unsplit, swap=True), gemm.fp8_swapped_supports,
              priority=2),
        _impl("gemm", "triton-fp8", partial(fp8, swap=False), gemm.fp8_supports, invariant=False, priority=1),
        _impl("gemm", "triton-fp8-unsplit", partial(fp8_unsplit, swap=False), gemm.fp8_supports, priority=1),
        _impl("gemm", "triton-fp32-few-rows", gemm.gemm_triton, gemm.fp32_few_rows_supports, invariant=False,
              priority=2),
        _impl("gemm", "cublas", gemm_cublas.gemm_cublas, gemm_cublas.cublas_supports, invariant=False, priority=1),
        _impl("gemm", "cublas-unsplit", gemm_cublas.gemm_cublas, gemm_cublas.cublas_invariant_supports, priority=1),
        _impl("gemm", "triton", gemm.gemm_triton, gemm.triton_dense_supports),
    ]  # fmt: skip


def _grouped_gemm_impls(gemm) -> list[OpImpl]:
    """FP4 weights first (``tcgen05-fp4``, ``tl.dot_scaled`` where the device has the ``fp4`` capability, while
    ``gemm.FP4_TCGEN05`` is on; ``triton-fp4-few`` and ``triton-fp4``, upcasting inside the kernel), then one
    implementation per kernel ``gemm.grouped_gemm`` chooses between, in ``GROUPED_KERNELS``' order; the decode
    tiles (``triton-fp4-few``, ``triton-decode``) and the Gluon kernel of prefill rows (``gluon-ws``) are not
    batch-invariant."""
    supports = {
        "gluon-ws": gemm.grouped_gluon_supports,
        "triton-masked-swapped": gemm.grouped_masked_swapped_supports,
        "triton-decode": gemm.grouped_decode_supports,
        "triton": gemm.grouped_supports,
    }
    fp4 = [
        _impl("grouped_gemm", "tcgen05-fp4", gemm.grouped_fp4_native, gemm.grouped_fp4_native_supports, priority=3),
        _impl(
            "grouped_gemm",
            "triton-fp4-few",
            partial(gemm.grouped_gemm_fp4, tile=gemm.FP4_TILE_FEW),
            gemm.grouped_fp4_few_supports,
            invariant=False,
            priority=2,
        ),
        _impl("grouped_gemm", "triton-fp4", gemm.grouped_gemm_fp4, gemm.grouped_fp4_supports, priority=1),
    ]
    return fp4 + [
        _impl("grouped_gemm", kernel, partial(gemm.grouped_gemm, kernel=kernel), supports[kernel],
              invariant=kernel not in ("triton-decode", "gluon-ws"), priority=-i)
        for i, kernel in enumerate(gemm.GROUPED_KERNELS)
    ]  # fmt: skip


@hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    if not probe.triton_installed():
        return []  # the probe says why the backend is unavailable; there are no kernels to register
    from . import (
        activation,
        attention,
        compressed_attention,
        gemm,
        gemm_cublas,
        hyper_connection,
        moe,
        norm,
        rope,
        sampling,
        sparse_attention,
    )

    try:
        from . import gemm_gluon
    except ImportError:  # a Triton without Gluon's Hopper language: cuBLAS and the Triton kernels serve every gemm
        gemm_gluon = None

    impls = [
        *_mla_decode_impls(attention),
        _impl("attention_varlen", "triton", attention.attention_varlen, attention.varlen_supports),
        _impl("write_kv_cache", "triton", attention.write_kv_cache, attention.write_supports),
        _impl("quantize_fp8", "triton", gemm.quantize_fp8, gemm.quantize_supports),
        *_gemm_impls(gemm, gemm_cublas),
        *_grouped_gemm_impls(gemm),
        _impl("moe_route", "triton", moe.moe_route, moe.route_supports),
        _impl("moe_route_hash", "triton", moe.moe_route_hash, moe.route_hash_supports),
        _impl("ep_dispatch", "triton", moe.ep_dispatch, moe.dispatch_supports),
        _impl("ep_combine", "triton", moe.ep_combine, moe.combine_supports),
        _impl("rms_norm", "triton", norm.rms_norm, norm.supports),
        _impl("rope", "triton", rope.rope, rope.supports),
        _impl("silu_and_mul", "triton", activation.silu_and_mul, activation.supports),
        _impl("sample", "triton", sampling.sample, sampling.supports),
        _impl("apply_token_bitmask", "triton", sampling.apply_token_bitmask, sampling.apply_token_bitmask_supports),
        _impl("hc_pre", "triton", hyper_connection.hc_pre, hyper_connection.pre_supports),
        _impl("hc_post", "triton", hyper_connection.hc_post, hyper_connection.post_supports),
        _impl("hc_head", "triton", hyper_connection.hc_head, hyper_connection.head_supports),
        _impl("layer_norm", "triton", norm.layer_norm, norm.layer_norm_supports),
        _impl("compress_kv", "triton", compressed_attention.compress_kv, compressed_attention.compress_supports),
        _impl(
            "indexer_topk_entries",
            "triton",
            compressed_attention.indexer_topk_entries,
            compressed_attention.topk_supports,
        ),
        _impl(
            "sparse_attention_sinks",
            "triton",
            compressed_attention.sparse_attention_sinks,
            compressed_attention.attend_supports,
        ),
        _impl("write_index_cache", "triton", sparse_attention.write_index_cache, sparse_attention.write_supports),
        _impl("indexer_topk", "triton", sparse_attention.indexer_topk, sparse_attention.topk_supports),
        _impl(
            "sparse_mla",
            "gluon-split",
            sparse_attention.sparse_mla_gluon_kernel,
            sparse_attention.sparse_gluon_supports,
            invariant=False,
            priority=2,
        ),
        _impl(
            "sparse_mla",
            "triton",
            sparse_attention.sparse_mla,
            sparse_attention.sparse_supports,
            invariant=False,
            priority=1,
        ),
        _impl(
            "sparse_mla",
            "triton-unsplit",
            partial(sparse_attention.sparse_mla, invariant=True),
            sparse_attention.sparse_supports,
        ),
    ]
    if gemm_gluon is not None:  # the first two give the unsplit Triton kernel's bits: batch-invariant mode takes them
        impls.append(_impl("gemm", "gluon-fp8-ws", gemm_gluon.gemm_fp8, gemm_gluon.supports, priority=4))
        impls.append(
            _impl("gemm", "gluon-fp8-few", gemm_gluon.gemm_fp8_few_rows, gemm_gluon.few_rows_supports, priority=4)
        )
        impls.append(
            _impl(
                "gemm",
                "cublas-fp8-waves",
                gemm_cublas.gemm_fp8_cublas_waves,
                gemm_cublas.cublas_waves_supports,
                invariant=False,
                priority=4,
            )
        )
    return impls
