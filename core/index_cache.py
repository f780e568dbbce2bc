"""The paged indexer-key cache of DeepSeek Sparse Attention (DSA) and its formats.

A cache is ``[num_blocks, block_size, width]`` and is paged like the latent cache (``deepinfer.kv_cache``): token
slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``, so one block table and one slot mapping
serve both. Per token it holds the indexer key ``k`` (``head_dim`` values, 128 for DeepSeek-V3.2). Formats:

- ``bf16``: ``width = head_dim`` bfloat16 values.
- ``fp8_ds_index``: ``width`` bytes (uint8), DeepSeek's FP8 indexer key: ``head_dim`` e4m3 values | one fp32 scale
  per 128 values (a power of two, ``2^ceil(log2(max(amax, 1e-4) / 448))``). For ``head_dim`` 128 that is
  128 + 4 = 132 bytes. ``head_dim`` must be a multiple of 128.
"""

from __future__ import annotations

import torch

from .qtensor import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, round_scale_ue8m0

INDEX_FORMATS = ("bf16", "fp8_ds_index")
FP8_GROUP = 128


def index_cache_dtype(index_format: str) -> torch.dtype:
    return torch.bfloat16 if index_format == "bf16" else torch.uint8


def index_cache_width(index_format: str, head_dim: int) -> int:
    """Size of the cache's last dim (elements of ``index_cache_dtype``) for one token."""
    if index_format == "bf16":
        return head_dim
    return head_dim + 4 * (head_dim // FP8_GROUP)


def index_format_of(index_cache: torch.Tensor) -> str:
    """The format a cache tensor is in, from its dtype."""
    return "fp8_ds_index" if index_cache.dtype == torch.uint8 else "bf16"


def allocate_index_cache(
    num_blocks: int,
    block_size: int,
    *,
    head_dim: int,
    index_format: str = "bf16",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialised indexer-key cache of ``num_blocks`` pages of ``block_size`` tokens."""
    if index_format not in INDEX_FORMATS:
        raise ValueError(f"index_format must be one of {INDEX_FORMATS}, got {index_format!r}")
    if index_format == "fp8_ds_index" and head_dim % FP8_GROUP:
        raise ValueError(f"fp8_ds_index needs head_dim % {FP8_GROUP} == 0, got {head_dim}")
    width = index_cache_width(index_format, head_dim)
    return torch.empty(num_blocks, block_size, width, dtype=index_cache_dtype(index_format), device=device)


def pack_fp8_ds_index(k: torch.Tensor) -> torch.Tensor:
    """Reference quantisation of keys ``k [T, head_dim]`` into ``fp8_ds_index`` records ``[T, width]``."""
    t, head_dim = k.shape
    groups = head_dim // FP8_GROUP
    x = k.float().reshape(t, groups, FP8_GROUP)
    scale = round_scale_ue8m0(x.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(t, head_dim)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(t, 4 * groups)], dim=1)


def unpack_fp8_ds_index(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``fp8_ds_index`` records ``[..., width]`` back to fp32 keys ``[..., head_dim]``."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    n, groups = flat.shape[0], head_dim // FP8_GROUP
    q = flat[:, :head_dim].contiguous().view(FP8_DTYPE).float()
    scale = flat[:, head_dim:].contiguous().view(torch.float32)
    return (q.reshape(n, groups, FP8_GROUP) * scale.unsqueeze(-1)).reshape(*lead, head_dim)


def read_keys(index_cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The fp32 keys at ``slots`` (any int tensor of slots), whatever the format."""
    flat = index_cache.reshape(-1, index_cache.shape[-1])[slots.long()]
    if index_cache.dtype == torch.uint8:
        return unpack_fp8_ds_index(flat, head_dim)
    return flat.float()
