"""Rotary embedding on Ascend: ``rope`` -> ``npu_rotary_mul`` (torch_npu, op-plugin docs).

The operator computes ``x * r1 + rotate(x) * r2`` on a ``TND`` input with ``T1D`` coefficients. ``r1``/``r2`` are
full-width: for ``interleave`` (DeepSeek) each frequency's cos/sin is repeated for its channel pair
(``c0 c0 c1 c1 ...``), for ``half`` (GPT-NeoX) the half table is repeated (``c0 c1 ... c0 c1 ...``). The
coefficients are passed in the dtype of x (assumption: the docs list the same dtypes for all three and no mixed
case), so bf16 inputs see cos/sin rounded to bf16 (about 2^-9 relative).
"""

from __future__ import annotations

import torch

from deepinfer import Decline

from . import probe


def rope_rotary_mul(x, positions, cos_sin_cache, interleaved) -> torch.Tensor:
    """``rope`` through ``npu_rotary_mul``."""
    if x.shape[0] == 0:
        return x.clone()
    npu = probe.torch_npu()
    half = x.shape[-1] // 2
    table = cos_sin_cache.index_select(0, positions.long())
    cos, sin = table[:, :half], table[:, half:]
    if interleaved:
        r1, r2 = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        r1, r2 = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    r1, r2 = r1[:, None, :].to(x.dtype).contiguous(), r2[:, None, :].to(x.dtype).contiguous()  # T1D
    return npu.npu_rotary_mul(x.contiguous(), r1, r2, rotary_mode="interleave" if interleaved else "half")


def rope_rotary_mul_supports(x, positions, cos_sin_cache, interleaved) -> bool | Decline:
    if not (answer := probe.placed(x=x, positions=positions, cos_sin_cache=cos_sin_cache)):
        return answer
    if x.shape[2] >= 896:
        return Decline(f"x's head dim {x.shape[2]} >= 896")
    if x.shape[1] >= 1000:  # interleave's "B * N < 1000" has no B for TND: read as N < 1000 (README 12)
        return Decline(f"x has {x.shape[1]} heads >= 1000")
    return True
