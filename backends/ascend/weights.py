"""One-time weight layout conversion on Ascend (``BackendSpec.prepare_weight``), after the checkpoint is loaded.

- FP8 weights with DeepSeek's 128x128 fp32 ``weight_scale_inv``: nothing to convert for the default G-B recipe;
  the 950's ``npu_quant_matmul`` / ``npu_grouped_matmul`` take the ``[N, K]`` data and ``[N/128, K/128]`` scales
  as transposed views (see ``gemm.py``). Lossless.
- With ``DEEPINFER_ASCEND_FP8_GEMM=mx`` 2-D FP8 weights also get their MXFP8 form (e4m3 with one E8M0 scale per
  32 values, ``(k/64, n, 2)`` scale layout) attached as ``QTensor.prepared``, computed once here. Lossy: the
  backend declares the conformance tolerance for it (``gemm.MX_TOLERANCE``). The logical data and scales stay as
  loaded, so validation and the reference fallback still see the checkpoint's values.
- bf16/fp16 linear weights ([N, K], names in ``NZ_LINEAR_SUFFIXES``) are cast to the NZ (FRACTAL_NZ, format 29)
  layout with ``npu_format_cast``, which torch_npu's docs recommend for matmul weights; the tensor keeps its
  logical shape and values. Expert weights ([E, N, K]) are cast only where the chip's grouped matmul takes NZ
  weights (the ``nz_grouped_weight`` capability: the 950's grouped matmul docs list ND weights only). Weights the
  model reshapes or slices (embeddings, MLA's absorbed ``kv_b_proj``) are left in ND.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer import QTensor

from . import gemm, probe

ACL_FORMAT_FRACTAL_NZ = 29
NZ_LINEAR_SUFFIXES = (
    "q_a_proj.weight",
    "qkv_a_proj.weight",
    "q_b_proj.weight",
    "q_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "lm_head.weight",
)
NZ_EXPERT_SUFFIXES = ("w13_weight", "w2_weight", "experts.gate_up_proj", "experts.down_proj")


def prepare_weight(name: str, weight: Any) -> Any:
    """The backend's physical form of a loaded weight; the result is still a valid op argument (same logical
    shape and values)."""
    if isinstance(weight, QTensor):
        if gemm.mx_recipe() and weight.dim() == 2 and weight.block == (128, 128) and probe.has("mxfp8"):
            return gemm.with_mx_weight(weight)
        return weight
    if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float16):
        return weight
    if not probe.on_device(weight):
        return weight
    if weight.dim() == 2 and name.endswith(NZ_LINEAR_SUFFIXES):
        return probe.torch_npu().npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)
    if weight.dim() == 3 and name.endswith(NZ_EXPERT_SUFFIXES) and probe.has("nz_grouped_weight"):
        return probe.torch_npu().npu_format_cast(weight, ACL_FORMAT_FRACTAL_NZ)
    return weight
