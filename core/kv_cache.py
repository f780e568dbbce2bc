"""The paged MLA latent cache and its formats.

A cache is ``[num_blocks, block_size, width]``; token slot ``s`` lives at block ``s // block_size``, offset
``s % block_size``. Per token it holds the latent ``c`` (``kv_lora_rank`` values) followed by ``k_rope``
(``rope_dim`` values). Formats:

- ``bf16``: ``width = kv_lora_rank + rope_dim`` bfloat16 values.
- ``fp8_ds_mla``: ``width`` bytes (uint8), FlashMLA's byte order: ``kv_lora_rank`` e4m3 values of ``c`` | one
  fp32 scale per 128 values of ``c`` (powers of two) | ``rope_dim`` bf16 values of ``k_rope``. For DeepSeek-V3
  (512, 64) that is 512 + 16 + 128 = 656 bytes. ``kv_lora_rank`` must be a multiple of 128.
"""

from __future__ import annotations

import torch

from .qtensor import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, round_scale_ue8m0

KV_FORMATS = ("bf16", "fp8_ds_mla")
FP8_GROUP = 128


def kv_cache_dtype(kv_format: str) -> torch.dtype:
    return torch.bfloat16 if kv_format == "bf16" else torch.uint8


def fp8_ds_mla_offsets(kv_lora_rank: int) -> tuple[int, int]:
    """Byte offsets of the scales and of the rope part in an ``fp8_ds_mla`` record."""
    return kv_lora_rank, kv_lora_rank + 4 * (kv_lora_rank // FP8_GROUP)


def kv_cache_width(kv_format: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Size of the cache's last dim (elements of ``kv_cache_dtype``) for one token."""
    if kv_format == "bf16":
        return kv_lora_rank + rope_dim
    return fp8_ds_mla_offsets(kv_lora_rank)[1] + 2 * rope_dim


def kv_format_of(kv_cache: torch.Tensor) -> str:
    """The format a cache tensor is in, from its dtype."""
    return "fp8_ds_mla" if kv_cache.dtype == torch.uint8 else "bf16"


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    *,
    kv_lora_rank: int,
    rope_dim: int,
    kv_format: str = "bf16",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """An uninitialised cache of ``num_blocks`` pages of ``block_size`` tokens."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "fp8_ds_mla" and kv_lora_rank % FP8_GROUP:
        raise ValueError(f"fp8_ds_mla needs kv_lora_rank % {FP8_GROUP} == 0, got {kv_lora_rank}")
    width = kv_cache_width(kv_format, kv_lora_rank, rope_dim)
    return torch.empty(num_blocks, block_size, width, dtype=kv_cache_dtype(kv_format), device=device)


def pack_fp8_ds_mla(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """Reference quantisation of ``latent [T, kv_lora_rank + rope_dim]`` into ``fp8_ds_mla`` records ``[T, width]``.

    Each group of 128 latent values gets ``scale = 2^ceil(log2(max(amax, 1e-4) / 448))``; the rope part is stored
    as bf16.
    """
    t, n_scales = latent.shape[0], kv_lora_rank // FP8_GROUP  # explicit sizes: T may be 0
    c = latent[:, :kv_lora_rank].float().reshape(t, n_scales, FP8_GROUP)
    scale = round_scale_ue8m0(c.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX)
    q = (c / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(t, kv_lora_rank)
    rope = latent[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    return torch.cat(
        [q.view(torch.uint8), scale.contiguous().view(torch.uint8).reshape(t, 4 * n_scales), rope.view(torch.uint8)],
        dim=1,
    )


def unpack_fp8_ds_mla(packed: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``fp8_ds_mla`` records ``[..., width]`` back to fp32 ``[..., kv_lora_rank + rope_dim]``."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    n_scales = kv_lora_rank // FP8_GROUP

    def field(start: int, stop: int | None, dtype: torch.dtype) -> torch.Tensor:
        # A fresh row-major copy: a one-record slice counts as contiguous yet keeps the record's row stride, which
        # need not be a multiple of the field's element size (odd rope_dim).
        return flat[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)

    scales_at, rope_at = fp8_ds_mla_offsets(kv_lora_rank)
    q = field(0, scales_at, FP8_DTYPE).float()
    scale = field(scales_at, rope_at, torch.float32)
    rope = field(rope_at, None, torch.bfloat16).float()
    n = flat.shape[0]  # explicit sizes: there may be no record
    c = (q.reshape(n, n_scales, FP8_GROUP) * scale.unsqueeze(-1)).reshape(n, kv_lora_rank)
    return torch.cat([c, rope], dim=1).reshape(*lead, kv_lora_rank + rope.shape[1])


def read_tokens(kv_cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """The fp32 latent+rope values at ``slots`` (any int tensor of slots), whatever the format."""
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])[slots.long()]
    if kv_cache.dtype == torch.uint8:
        return unpack_fp8_ds_mla(flat, kv_lora_rank)
    return flat.float()
