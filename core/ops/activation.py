"""Activation ops: ``silu_and_mul`` (SwiGLU), optionally emitting FP8 for the next GEMM."""

from __future__ import annotations

import torch

from ..dispatch import call
from ..qtensor import SCALE_FORMATS, QTensor
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled

FP8_BLOCK = 128


def silu_and_mul(
    x: torch.Tensor,
    *,
    quantize: bool = False,
    scale_format: str = "fp32",
    masked_m: torch.Tensor | None = None,
    limit: float | None = None,
) -> torch.Tensor | QTensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]`` (gate then up), computed in fp32.

    With ``limit`` (a finite number > 0; DeepSeek-V4's ``swiglu_limit``), the clipped SwiGLU of transformers'
    DeepseekV4: the gate is clamped to at most ``limit`` and up to ``[-limit, limit]`` (in fp32, before the
    product): ``silu(min(gate, limit)) * clamp(up, -limit, limit)``. None (the default) clamps nothing.

    Returns ``[..., I]`` in x's dtype, or with ``quantize=True`` an FP8 ``QTensor`` with ``(1, 128)`` scales in
    ``scale_format``, quantised from the fp32 product as ``quantize_fp8`` does (``I % 128 == 0``). ``x`` is 2-D
    (tokens) or 3-D (the masked expert layout ``[E, max_m, 2I]``). With ``masked_m [E]`` int32 in ``[0, max_m]``
    (3-D ``x`` only), as ``grouped_gemm`` takes it, rows at or past ``masked_m[e]`` are unspecified in the output:
    a backend may skip them, which is most of the buffer at decode sizes.
    """
    c = Check("silu_and_mul")
    c.tensor("x", x, dtypes=FLOAT_DTYPES, ndim=(2, 3))
    if x.shape[-1] % 2:
        raise c.fail("x", "an even last dim (gate and up halves)", f"shape {list(x.shape)}")
    if not isinstance(quantize, bool):
        raise c.fail("quantize", "a bool", repr(quantize))
    c.choice("scale_format", scale_format, SCALE_FORMATS)
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < float("inf")
    ):
        raise c.fail("limit", "None or a finite number > 0", repr(limit))
    if quantize and (x.shape[-1] // 2) % FP8_BLOCK:
        raise c.fail("x", f"I = last dim / 2 a multiple of {FP8_BLOCK} to quantise", f"shape {list(x.shape)}")
    if masked_m is not None:
        if x.ndim != 3:
            raise c.fail("masked_m", "only with a 3-D x (the masked expert layout)", f"x of shape {list(x.shape)}")
        c.index("masked_m", masked_m, length=x.shape[0])
        c.same_device(x=x, masked_m=masked_m)
        if value_checks_enabled(masked_m):
            c.values_in_range("masked_m", masked_m, 0, x.shape[1], what="row counts")
    return call(
        "silu_and_mul",
        x=x,
        quantize=quantize,
        scale_format=scale_format,
        masked_m=masked_m,
        limit=None if limit is None else float(limit),
    )
