"""GEMM ops on Ascend: ``quantize_fp8``, ``gemm``, ``grouped_gemm``.

Fused operators (torch_npu; the Ascend 950 modes from the aclnnQuantMatmulV5 / aclnnGroupedMatmulV4 docs):
- ``quantize_fp8`` (fp32 scales) -> ``npu_dynamic_block_quant(x, min_scale=1e-4/448, dst_type=float8_e4m3fn,
  row_block_size=1, col_block_size=128)``: the docs' scale is ``max(amax / 448, min_scale)``, which is the
  DeepSeek-V3 recipe ``max(amax, 1e-4) / 448``. ``ue8m0`` scales run the plain-torch composite.
- ``gemm`` FP8 -> ``npu_quant_matmul`` in the 950's G-B mode (``group_sizes=[1, 128, 128]``): activation scales
  ``(m, K/128)``, weight ``(k, n)`` and scale ``(K/128, ceil(n/128))``. DeepSeek's ``[N, K]`` weight and
  ``[ceil(N/128), K/128]`` ``weight_scale_inv`` are passed as transposed views, the transposition the docs allow
  when weight and scale are transposed alike: the 128x128 fp32 scales need no conversion and no precision is lost.
  G-B takes no bias for FP8, so a bias is added afterwards in fp32.
- ``gemm`` MXFP8 (opt-in, ``DEEPINFER_ASCEND_FP8_GEMM=mx``): weight and activation re-quantised to MXFP8 (32
  values per power-of-two E8M0 scale, ``npu_dynamic_mx_quant``), ``group_sizes=[1, 1, 32]``. Lossy: see
  ``MX_TOLERANCE``.
- ``grouped_gemm`` -> ``npu_grouped_matmul`` with one x, one ``[E, K, N]`` weight (a transposed view of the
  core's ``[E, N, K]``), ``group_list`` of per-expert counts (``group_list_type`` 1; the docs refuse a count list
  of length 1, so one expert's count goes as its cumsum, type 0), ``split_item`` 3; FP8 in G-B mode with
  ``per_token_scale [M, K/128]`` and ``scale [E, K/128, ceil(N/128)]`` (transposed view). The masked layout is
  run as E groups of ``max_m`` rows each (rows past ``masked_m`` are computed and left unspecified), so it needs
  no host synchronisation.
- ``grouped_gemm`` with FP4 expert weights (``FP4Tensor``: e2m1 pairs a byte, one ue8m0 scale per 32 values of a
  row): the documented ``npu_grouped_matmul`` takes no such weight (its int4 weights are antiquantised integers with
  a scale and an offset per group, not e2m1 codes), so the weight is decoded in plain torch to the activation's dtype
  on every call (exact in bf16 and fp32), then runs the dense ``npu_grouped_matmul`` above (README assumption 31).
- bf16 ``gemm`` is ``torch.nn.functional.linear`` on the NPU (aclnn MatMul): plain torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from deepinfer import Decline, FP4Tensor, QTensor
from deepinfer.qtensor import round_scale_ue8m0

from . import probe

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-4
GB_GROUPS = [1, 128, 128]
MX_GROUPS = [1, 1, 32]
FP8_GEMM_ENV = "DEEPINFER_ASCEND_FP8_GEMM"

#: Conformance tolerance while the MXFP8 recipe is on, with the reason (measured through the test double, which
#: reproduces the quantisation exactly; kernel accumulation order is not modelled).
MX_TOLERANCE = (
    1.5e-1,
    "MXFP8 recipe (DEEPINFER_ASCEND_FP8_GEMM=mx): weights and activations are re-quantised to e4m3 with one "
    "power-of-two scale per 32 values instead of DeepSeek's fp32 scale per 128 (per 128x128 for weights), so "
    "values round to different e4m3 grid points than the reference's",
)


def mx_recipe() -> bool:
    """Whether FP8 GEMMs use the MXFP8 recipe instead of the (lossless) G-B block recipe."""
    return os.environ.get(FP8_GEMM_ENV, "block").lower() == "mx"


@dataclass(frozen=True)
class MxWeight:
    """A weight in the MXFP8 layout npu_quant_matmul takes: ``x2 (k, n)`` e4m3 (transposed view of ``[n, k]``) and
    ``x2_scale (ceil(k/64), n, 2)`` E8M0 bytes (transposed view of ``(n, ceil(k/64), 2)``)."""

    x2: torch.Tensor
    x2_scale: torch.Tensor


def to_mx_weight(w: QTensor) -> MxWeight:
    """Re-quantises a 128x128-block FP8 weight to MXFP8 (lossy: e4m3 values are rounded again on a new grid)."""
    npu = probe.torch_npu()
    data, scale = npu.npu_dynamic_mx_quant(w.dequantize(torch.bfloat16), dst_type=FP8)
    return MxWeight(data.t(), scale.transpose(0, 1))


# ---------------------------------------------------------------------------------------------------------------
# quantize_fp8


def quantize_rows_torch(x: torch.Tensor, block: int, scale_format: str) -> QTensor:
    """DeepSeek-V3 ``(1, block)`` quantisation in plain torch (fp32 math), any float input."""
    *lead, k = x.shape
    groups = x.float().reshape(*lead, k // block, block)
    scale = groups.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    if scale_format == "ue8m0":
        scale = round_scale_ue8m0(scale)
    data = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(x.shape)
    return QTensor(data, scale, (1, block), scale_format)


def quantize_fp8_block_quant(x, *, block, scale_format) -> QTensor:
    """``quantize_fp8`` through ``npu_dynamic_block_quant``."""
    if x.shape[-2] == 0:
        return quantize_rows_torch(x, block, scale_format)  # empty: nothing to launch
    npu = probe.torch_npu()
    # FP8 dst_type is assumed for the 950 (the doc lists int8); the returned scale is the multiplier
    # max(amax / 448, min_scale), as the doc's example shows (its formula writes the reciprocal). README 6.
    data, scale = npu.npu_dynamic_block_quant(
        x, min_scale=SCALE_FLOOR / FP8_MAX, dst_type=FP8, row_block_size=1, col_block_size=BLOCK
    )
    return QTensor(data, scale, (1, BLOCK), scale_format)


def quantize_fp8_block_quant_supports(x, *, block, scale_format) -> bool | Decline:
    if not (answer := probe.placed(x=x)) or not (answer := probe.capable("fp8_e4m3")):
        return answer
    if x.dtype not in (torch.bfloat16, torch.float16):
        return Decline(f"x is {x.dtype}, expected bfloat16 or float16")
    if block != BLOCK:
        return Decline(f"block {block}, expected {BLOCK}")
    if scale_format != "fp32":
        return Decline(f"scale_format {scale_format!r}, expected 'fp32'")
    return True


def quantize_fp8_torch(x, *, block, scale_format) -> QTensor:
    return quantize_rows_torch(x, block, scale_format)


def _activation(a, scale_format: str) -> QTensor:
    """The (1, 128) FP8 form of a gemm activation: as given, or quantised with the weight's scale format."""
    if isinstance(a, QTensor):
        return a
    if scale_format == "fp32" and a.dtype in (torch.bfloat16, torch.float16):
        return quantize_fp8_block_quant(a, block=BLOCK, scale_format="fp32")
    return quantize_rows_torch(a, BLOCK, scale_format)


# ---------------------------------------------------------------------------------------------------------------
# gemm


def gemm_quant_matmul(a, w, *, out_dtype, bias) -> torch.Tensor:
    """FP8 ``gemm`` through ``npu_quant_matmul`` (G-B mode, or MX when that recipe is on)."""
    npu = probe.torch_npu()
    m, n = a.shape[0], w.shape[0]
    if m == 0 or n == 0:  # npu_quant_matmul takes no empty operand
        return torch.zeros(m, n, dtype=out_dtype, device=w.device)
    if mx_recipe():
        mx = w.prepared if isinstance(w.prepared, MxWeight) else to_mx_weight(w)
        x = a.dequantize(torch.bfloat16) if isinstance(a, QTensor) else a.to(torch.bfloat16)
        x1, x1_scale = npu.npu_dynamic_mx_quant(x, dst_type=FP8)
        # MX scales: E8M0 bytes tagged float8_e8m0fnu, laid out (m, ceil(k/64), 2) as npu_dynamic_mx_quant
        # returns them (README assumption 8).
        return npu.npu_quant_matmul(
            x1,
            mx.x2,
            mx.x2_scale,
            pertoken_scale=x1_scale,
            scale_dtype=npu.float8_e8m0fnu,
            pertoken_scale_dtype=npu.float8_e8m0fnu,
            bias=None if bias is None else bias.float(),
            output_dtype=out_dtype,
            group_sizes=MX_GROUPS,
        )
    act = _activation(a, w.scale_format)
    # G-B takes any n with ceil(n/128) scale columns (V5 doc shapes); the 128-multiple rules are the A2/A3 int8
    # kernel's (README assumption 7). Its operands must be contiguous, or for the weight a transposed contiguous one.
    out = npu.npu_quant_matmul(
        act.data.contiguous(),
        w.data.contiguous().t(),  # (k, n) as a transposed view of DeepSeek's [n, k]
        w.scale.contiguous().t(),  # (K/128, ceil(n/128)), transposed like the weight
        pertoken_scale=act.scale.contiguous(),
        output_dtype=torch.float32 if bias is not None else out_dtype,
        group_sizes=GB_GROUPS,
    )
    return out if bias is None else (out + bias.float()).to(out_dtype)


def gemm_quant_matmul_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    if not isinstance(w, QTensor):
        return Decline("w is dense, not an FP8 QTensor")
    if not (answer := probe.placed(a=a, w=w, bias=bias)) or not (answer := probe.capable("fp8_block_gemm")):
        return answer
    if mx_recipe() and not (answer := probe.capable("mxfp8")):
        return answer
    if w.shape[1] > 65535:
        return Decline(f"w's K of {w.shape[1]} > 65535")
    return True


def gemm_torch(a, w, *, out_dtype, bias) -> torch.Tensor:
    """``a @ w.T`` with plain torch on the device: ``F.linear`` when the output dtype is the input's (one rounding
    of an fp32 accumulation) when both operands have it too, fp32 otherwise; FP8 operands are dequantised first (the
    A2/A3 path)."""
    if isinstance(w, QTensor):
        act = a if isinstance(a, QTensor) else quantize_rows_torch(a, BLOCK, w.scale_format)
        out = act.dequantize() @ w.dequantize().T
    elif out_dtype == a.dtype == w.dtype:
        return torch.nn.functional.linear(a, w, None if bias is None else bias.to(a.dtype))
    else:
        out = a.float() @ w.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# grouped_gemm


def _rows(a, experts: int, masked_m):
    """The activation as one [M, K] operand and the per-expert row counts (int64, device-side)."""
    if masked_m is None:
        return a, None
    max_m = a.shape[1]
    counts = torch.full((experts,), max_m, dtype=torch.int64, device=a.device)
    if isinstance(a, QTensor):
        flat = QTensor(a.data.reshape(-1, a.shape[-1]), a.scale.reshape(experts * max_m, -1), a.block, a.scale_format)
        return flat, counts
    return a.reshape(-1, a.shape[-1]), counts


def grouped_gemm_gmm(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> torch.Tensor:
    """``grouped_gemm`` through ``npu_grouped_matmul`` (single x, single weight, single y)."""
    npu = probe.torch_npu()
    experts, n, _ = w.shape
    flat, counts = _rows(a, experts, masked_m)
    if counts is None:
        counts = torch.diff(expert_offsets.long())
    # The docs refuse a count list (group_list_type 1) of length 1; for one group its cumsum (type 0) is the same.
    list_type = 1 if experts > 1 else 0
    m = flat.shape[0]
    if m == 0:
        y = torch.zeros(0, n, dtype=out_dtype, device=w.device)
    elif isinstance(w, QTensor):
        act = _activation(flat, w.scale_format)
        # The Python API has no group_sizes: G-B's [1, 128, 128] is inferred from the scale shapes (README 7).
        # x must be contiguous, the weight contiguous or a transposed contiguous tensor.
        y = npu.npu_grouped_matmul(
            [act.data.contiguous()],
            [w.data.contiguous().transpose(1, 2)],  # [E, K, N] as a transposed view of the core's [E, N, K]
            scale=[w.scale.contiguous().transpose(1, 2)],  # [E, K/128, ceil(N/128)], transposed like the weight
            per_token_scale=[act.scale.contiguous()],
            group_list=counts,
            group_list_type=list_type,  # per-expert counts (cumulative for a single expert)
            group_type=0,  # grouped along m
            split_item=3,  # one output tensor
            output_dtype=out_dtype,
        )[0]
    else:
        y = npu.npu_grouped_matmul(
            [flat.contiguous()],
            [w.contiguous().transpose(1, 2)],
            group_list=counts,
            group_list_type=list_type,
            group_type=0,
            split_item=3,
        )[0].to(out_dtype)
    return y if masked_m is None else y.view(experts, -1, n)


def grouped_gemm_gmm_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    if isinstance(w, FP4Tensor):
        return Decline("w is an FP4Tensor")
    if not (answer := _gmm_fits(a, w, w, expert_offsets, masked_m)):
        return answer
    if isinstance(w, QTensor):
        if not (answer := probe.capable("fp8_block_gemm")):
            return answer
        if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return Decline(f"out_dtype is {out_dtype}, expected bfloat16, float16 or float32")
    return True


def grouped_gemm_fp4_gmm(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> torch.Tensor:
    """``grouped_gemm`` of an ``FP4Tensor`` weight: decoded to ``a``'s dtype in plain torch (exact), then the dense
    ``npu_grouped_matmul`` of ``grouped_gemm_gmm``."""
    dense = w.dequantize(a.dtype)
    return grouped_gemm_gmm(a, dense, expert_offsets=expert_offsets, masked_m=masked_m, out_dtype=out_dtype)


def grouped_gemm_fp4_gmm_supports(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> bool | Decline:
    """An ``FP4Tensor`` weight against a bf16 or fp32 activation (an fp16 copy could not hold every value)."""
    if not isinstance(w, FP4Tensor):
        return Decline("w is not an FP4Tensor")
    if a.dtype not in (torch.bfloat16, torch.float32):
        return Decline(f"a is {a.dtype}, expected bfloat16 or float32")
    return _gmm_fits(a, w, w.data, expert_offsets, masked_m)


def _gmm_fits(a, w, w_data, expert_offsets, masked_m) -> bool | Decline:
    """Whether ``npu_grouped_matmul`` takes the operands' placement and ``w``'s expert count and K."""
    if not (answer := probe.placed(a=a, w=w_data, expert_offsets=expert_offsets, masked_m=masked_m)):
        return answer
    if w.shape[0] > 1024:
        return Decline(f"w holds {w.shape[0]} experts > 1024")
    if w.shape[2] >= 65536:
        return Decline(f"w's K of {w.shape[2]} >= 65536")
    return True


def grouped_gemm_torch(a, w, *, expert_offsets, masked_m, out_dtype, out=None) -> torch.Tensor:
    """One matmul per expert in fp32 (FP8 and FP4 operands dequantised)."""
    del out  # a new result: the op copies it into `out`
    experts, n, _ = w.shape
    if isinstance(w, QTensor) and not isinstance(a, QTensor):
        a = quantize_rows_torch(a, BLOCK, w.scale_format)
    af = a.dequantize() if isinstance(a, QTensor) else a.float()
    wf = w.dequantize() if isinstance(w, (QTensor, FP4Tensor)) else w.float()
    if masked_m is not None:
        return torch.einsum("emk,enk->emn", af, wf).to(out_dtype)
    out = torch.zeros(af.shape[0], n, device=af.device)
    bounds = expert_offsets.tolist()
    for e in range(experts):
        if bounds[e + 1] > bounds[e]:
            out[bounds[e] : bounds[e + 1]] = af[bounds[e] : bounds[e + 1]] @ wf[e].T
    return out.to(out_dtype)


def with_mx_weight(w: QTensor) -> QTensor:
    """``w`` with its MXFP8 form attached as ``prepared`` (the logical data and scales stay as loaded)."""
    return replace(w, prepared=to_mx_weight(w))
