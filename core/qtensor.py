"""``QTensor``: an FP8 e4m3 tensor with block scales, and the DeepSeek-V3 quantisation recipe; ``FP4Tensor``: packed
e2m1 values with one ue8m0 scale per 32 values of a row (DeepSeek-V4's FP4 routed experts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4  # amax below this quantises as if it were this (DeepSeek-V3 recipe)
SCALE_FORMATS = ("fp32", "ue8m0")
FP4_GROUP = 32  # values of a row per ue8m0 scale
FP4_DATA_DTYPE = torch.int8  # two e2m1 codes a byte, the low nibble the even element
UE8M0_DTYPE = torch.float8_e8m0fnu  # a scale's byte is the exponent of a power of two, biased by 127 (255: NaN)
# The values of the 16 e2m1 codes (sign bit 3, exponent bits 2..1, mantissa bit 0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class QTensor:
    """FP8 data with fp32 block scales: ``value = data * scale`` broadcast over blocks.

    data: ``[..., M, K]`` float8_e4m3fn.
    scale: ``[..., ceil(M / block[0]), ceil(K / block[1])]`` float32, the logical (row-major, unpadded) layout;
        the multiplier that restores the value (``weight_scale_inv`` in Hugging Face checkpoints).
    block: ``(rows, cols)`` covered by one scale: ``(1, 128)`` for activations, ``(128, 128)`` for weights.
    scale_format: ``"fp32"`` (any positive value) or ``"ue8m0"`` (every scale is a power of two).
    prepared: backend-owned physical form of this weight (set by a backend's ``prepare_weight``), or None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    scale_format: str = "fp32"
    prepared: Any = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values (reference math, fp32 unless asked otherwise)."""
        bm, bk = self.block
        m, k = self.data.shape[-2:]
        s = self.scale.float().repeat_interleave(bm, dim=-2)[..., :m, :]
        s = s.repeat_interleave(bk, dim=-1)[..., :k]
        return (self.data.float() * s).to(dtype)

    def __getitem__(self, rows) -> QTensor:
        """Selects rows of a ``(1, k)``-blocked tensor (rows own their scales)."""
        if self.block[0] != 1:
            raise TypeError("only (1, k)-blocked QTensors can be indexed by row")
        return QTensor(self.data[rows], self.scale[rows], self.block, self.scale_format)


@dataclass
class FP4Tensor:
    """FP4 weights as DeepSeek-V4 stores its routed experts: ``value = e2m1(code) * 2^(scale byte - 127)``.

    data: ``[..., N, K / 2]`` int8, two e2m1 codes a byte; the low nibble is element ``2j`` of the row, the high
        nibble element ``2j + 1``.
    scale: ``[..., N, K / 32]`` ``torch.float8_e8m0fnu`` (ue8m0): one power of two per 32 values of a row.
    prepared: backend-owned physical form of this weight (set by a backend's ``prepare_weight``), or None.

    ``shape`` is the logical ``[..., N, K]``. Every value is exactly representable in bf16 and fp32.
    """

    data: torch.Tensor
    scale: torch.Tensor
    prepared: Any = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The represented values (reference math: e2m1 table lookup times the scale, in fp32)."""
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.data.device)
        u8 = self.data.view(torch.uint8).long()
        values = torch.stack([lut[u8 & 0xF], lut[u8 >> 4]], dim=-1).flatten(-2)
        return (values * self.scale.float().repeat_interleave(FP4_GROUP, dim=-1)).to(dtype)


def fp4_from_fp32_scales(data: torch.Tensor, scale: torch.Tensor) -> FP4Tensor | None:
    """An ``FP4Tensor`` of packed ``data`` and its scales given as fp32 (or bf16) values: None unless every scale is
    a positive normal power of two (which ue8m0 holds exactly)."""
    s = scale.float()
    bits = s.view(torch.int32)
    exponent = bits >> 23
    if not bool(((bits & 0x807FFFFF) == 0).all() and ((exponent > 0) & (exponent < 255)).all()):
        return None
    return FP4Tensor(data, exponent.to(torch.uint8).view(UE8M0_DTYPE))


def scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The logical scale shape of a tensor of ``shape`` quantised in ``block`` blocks over its last two dims."""
    *lead, m, k = shape
    return (*lead, math.ceil(m / block[0]), math.ceil(k / block[1]))


def round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``scale`` (so the quantised values still fit in e4m3).

    ``2^ceil(log2(scale))`` alone is not enough: an fp32 log2 rounds a scale a few ulps above a power of two down
    to that power, which would give a scale below ``scale``; the result is corrected by one binade either way.
    """
    p = torch.exp2(torch.ceil(torch.log2(scale)))
    p = torch.where(p < scale, p * 2, p)
    return torch.where(p * 0.5 >= scale, p * 0.5, p)


def quantize_rows(x: torch.Tensor, block: int, scale_format: str) -> QTensor:
    """Reference ``(1, block)`` quantisation of the last dim (``K % block == 0``), in fp32 math."""
    *lead, k = x.shape
    xb = x.float().reshape(*lead, k // block, block)
    amax = xb.abs().amax(dim=-1).clamp_min(SCALE_FLOOR)
    scale = amax / FP8_MAX
    if scale_format == "ue8m0":
        scale = round_scale_ue8m0(scale)
    data = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(x.shape)
    return QTensor(data, scale, (1, block), scale_format)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128), scale_format: str = "fp32") -> QTensor:
    """``(bm, bk)`` block quantisation of the last two dims (weights), in fp32 math; any M and K."""
    bm, bk = block
    *lead, m, k = w.shape
    pm, pk = -m % bm, -k % bk
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pm))
    blocks = wp.reshape(*lead, (m + pm) // bm, bm, (k + pk) // bk, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(SCALE_FLOOR)
    scale = amax / FP8_MAX
    if scale_format == "ue8m0":
        scale = round_scale_ue8m0(scale)
    s = scale.repeat_interleave(bm, dim=-2)[..., :m, :].repeat_interleave(bk, dim=-1)[..., :k]
    data = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QTensor(data, scale, block, scale_format)
