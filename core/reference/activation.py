"""Reference ``silu_and_mul``."""

from __future__ import annotations

import torch

from ..qtensor import quantize_rows


def silu_and_mul(x, *, quantize, scale_format, masked_m, limit):
    """Every row, including those past ``masked_m`` (unspecified there by the contract)."""
    gate, up = x.float().chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    y = torch.nn.functional.silu(gate) * up
    return quantize_rows(y, 128, scale_format) if quantize else y.to(x.dtype)
