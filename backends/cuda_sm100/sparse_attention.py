"""DeepSeek Sparse Attention (DSA): ``write_index_cache`` (``indexer_topk`` and ``sparse_mla`` to follow).

``write_index_cache`` is one program per token: a bf16 copy, or DeepSeek's FP8 indexer key (e4m3 values and one
power-of-two fp32 scale per 128 values), rounded as ``deepinfer.index_cache.pack_fp8_ds_index`` rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.index_cache import FP8_GROUP

from ._triton import INTERPRET, PDL, cast, next_pow2, on_device, pdl_wait, pow2_ceil, to_e4m3

# --- write_index_cache ------------------------------------------------------------------------------------------


@triton.jit
def _write_index_kernel(
    k_ptr,
    slots_ptr,
    cache_ptr,
    cache_f32_ptr,
    stride_t,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUPS: tl.constexpr,
    WIDTH: tl.constexpr,
    FP8: tl.constexpr,
    PREROUND: tl.constexpr,
):
    """Token ``program_id(0)``'s key into its slot (none for slot ``-1``). FP8: per 128 values, ``scale =
    2^ceil(log2(max(amax, 1e-4) / 448))`` (``pow2_ceil``, exact), then ``x / scale`` (exact) rounded to e4m3."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if slot < 0:
        return
    base = slot * WIDTH
    if FP8:
        g = tl.arange(0, GROUPS)
        cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        gmask = g < D // 128
        x = tl.load(k_ptr + t * stride_t + cols, mask=gmask[:, None], other=0.0).to(tl.float32)
        scale = pow2_ceil(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) / 448.0)
        q = to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0), PREROUND).to(tl.uint8, bitcast=True)
        tl.store(cache_ptr + base + cols, q, mask=gmask[:, None])
        tl.store(cache_f32_ptr + (base + D) // 4 + g, scale, mask=gmask)
    else:
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(k_ptr + t * stride_t + cols, mask=mask, other=0.0)
        tl.store(cache_ptr + base + cols, cast(x, tl.bfloat16), mask=mask)


def write_index_cache(k, index_cache, slot_mapping):
    tokens, head_dim = k.shape
    if tokens == 0:
        return
    fp8 = index_cache.dtype == torch.uint8
    flat = index_cache.view(-1)
    _write_index_kernel[(tokens,)](
        k,
        slot_mapping,
        flat,
        flat.view(torch.float32) if fp8 else flat,
        k.stride(0),
        D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        GROUPS=next_pow2(head_dim // FP8_GROUP),
        WIDTH=index_cache.shape[2],
        FP8=fp8,
        PREROUND=INTERPRET,
        launch_pdl=PDL,
    )


def write_supports(k, index_cache, slot_mapping) -> bool:
    return on_device(k, index_cache, slot_mapping) and k.stride(1) == 1 and k.shape[1] <= 8192
