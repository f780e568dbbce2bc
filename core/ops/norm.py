"""Normalisation ops: ``rms_norm`` (with the fused residual add) and ``layer_norm``."""

from __future__ import annotations

import torch

from ..dispatch import call
from ..validation import FLOAT_DTYPES, Check


def rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, with an optional residual add fused in front.

    x: ``[..., H]`` float; w: ``[H]`` float; residual: like x or None. ``h = x + residual`` (or ``x``), rounded to
    x's dtype; ``y = h / sqrt(mean(h^2) + eps) * w`` computed in fp32 from the rounded ``h`` and returned in x's
    dtype. eps: a finite number >= 0. Returns ``(y, h)``: ``h`` is the new residual stream.
    """
    c = Check("rms_norm")
    c.tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise c.fail("x", "at least 1 dim", "a 0-d tensor")
    c.tensor("w", w, dtypes=FLOAT_DTYPES, shape=(x.shape[-1],))
    if residual is not None:
        c.tensor("residual", residual, dtypes=(x.dtype,), shape=tuple(x.shape))
    c.number("eps", eps, low=0.0, finite=True)
    c.same_device(x=x, w=w, residual=residual)
    return call("rms_norm", x=x, w=w, eps=float(eps), residual=residual)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (DeepSeek-V3.2's indexer-key norm).

    x: ``[..., H]`` float; w, b: ``[H]`` float. ``y = (x - mean(x)) / sqrt(var(x) + eps) * w + b`` with the biased
    variance, computed in fp32 and returned in x's dtype. eps: a finite number >= 0.
    """
    c = Check("layer_norm")
    c.tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise c.fail("x", "at least 1 dim", "a 0-d tensor")
    c.tensor("w", w, dtypes=FLOAT_DTYPES, shape=(x.shape[-1],))
    c.tensor("b", b, dtypes=FLOAT_DTYPES, shape=(x.shape[-1],))
    c.number("eps", eps, low=0.0, finite=True)
    c.same_device(x=x, w=w, b=b)
    return call("layer_norm", x=x, w=w, b=b, eps=float(eps))
