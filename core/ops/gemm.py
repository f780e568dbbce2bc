"""GEMM ops: ``quantize_fp8``, ``gemm``, ``grouped_gemm``.

Conventions: "NT" products (``out = a @ w.T``, weights ``[N, K]``), fp32 accumulation, bf16 output by default.
FP8 operands are ``QTensor``s with the DeepSeek-V3 recipe: activations ``block=(1, 128)``, weights
``block=(128, 128)``; a bf16 activation against an FP8 weight is quantised inside the op (backends may fuse it),
with the weight's ``scale_format``. ``grouped_gemm`` also takes FP4 expert weights (``FP4Tensor``: packed e2m1 with one
ue8m0 scale per 32 values of a row, DeepSeek-V4's routed experts) against a float activation.
"""

from __future__ import annotations

import torch

from ..dispatch import call
from ..qtensor import SCALE_FORMATS, FP4Tensor, QTensor
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled

FP8_BLOCK = 128
ACT_BLOCK = (1, FP8_BLOCK)
WEIGHT_BLOCK = (FP8_BLOCK, FP8_BLOCK)


def _check_fp8_k(c: Check, arg: str, k: int) -> None:
    if k % FP8_BLOCK:
        raise c.fail(arg, f"K (last dim) a multiple of the FP8 block {FP8_BLOCK}", f"K = {k}")


def _check_activation(c: Check, a, w, *, ndim: int, widen: bool = False) -> None:
    """``a`` against weight ``w`` (already checked): dtype pairing and K. ``widen``: a bf16 / fp16 ``a`` may meet an
    fp32 ``w``."""
    k = w.shape[-1]
    if isinstance(a, QTensor):
        c.qtensor("a", a, block=ACT_BLOCK, ndim=ndim)
        if not isinstance(w, QTensor):
            raise c.fail("w", "an FP8 QTensor weight when 'a' is an FP8 QTensor", f"a {w.dtype} tensor")
    else:
        c.tensor("a", a, dtypes=FLOAT_DTYPES, ndim=ndim)
        if isinstance(w, QTensor):
            _check_fp8_k(c, "a", a.shape[-1])
        elif a.dtype != w.dtype:
            widens = widen and a.dtype in (torch.bfloat16, torch.float16)
            if not (widens and w.dtype == torch.float32):
                expected = f"dtype {a.dtype} (the dtype of 'a')" + (" or torch.float32" if widens else "")
                raise c.fail("w", expected, f"dtype {w.dtype}")
    if a.shape[-1] != k:
        raise c.fail("a", f"K = {k} in the last dim (the K of 'w')", f"shape {list(a.shape)}")


def quantize_fp8(x: torch.Tensor, *, block: int = FP8_BLOCK, scale_format: str = "fp32") -> QTensor:
    """Quantises ``x [M, K]`` or ``[E, M, K]`` to FP8 e4m3 per row per ``block`` channels.

    Each group gets ``scale = max(amax, 1e-4) / 448`` (``ue8m0``: rounded up to a power of two) and data
    ``clamp(x / scale, -448, 448)`` in e4m3. A group holding a NaN gets a NaN scale (its data bytes are unspecified),
    so all its dequantised values are NaN: a NaN is never turned into a finite value. ``K`` must be a multiple of
    ``block``. Returns a ``QTensor`` with ``block=(1, block)`` and scales ``[..., M, K // block]`` fp32.
    Batch-invariant by construction (per-row).
    """
    c = Check("quantize_fp8")
    c.tensor("x", x, dtypes=FLOAT_DTYPES, ndim=(2, 3))
    c.positive_int("block", block)
    c.choice("scale_format", scale_format, SCALE_FORMATS)
    if x.shape[-1] % block:
        raise c.fail("x", f"K (last dim) a multiple of block={block}", f"shape {list(x.shape)}")
    return call("quantize_fp8", x=x, block=block, scale_format=scale_format)


def gemm(
    a: torch.Tensor | QTensor,
    w: torch.Tensor | QTensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[M, N] = a[M, K] @ w[N, K].T (+ bias[N])``, accumulated in fp32, returned in ``out_dtype``.

    Operand combinations:
    - ``a`` and ``w`` float tensors of the same dtype (bf16, fp16 or fp32);
    - ``a`` bf16 or fp16, ``w`` fp32: ``a``'s values multiply the fp32 weight as they are (a router whose weight is
      not a bf16 value, without an fp32 copy of the activations first);
    - ``a`` float, ``w`` FP8 ``QTensor`` with ``(128, 128)`` scales ``[ceil(N/128), K/128]``: ``a`` is quantised
      inside per ``(1, 128)`` with the weight's scale format; ``K % 128 == 0``;
    - ``a`` FP8 ``QTensor`` with ``(1, 128)`` scales ``[M, K/128]``, ``w`` FP8 as above.
    ``M = 0`` gives an empty ``[0, N]`` result. Errors: ``InputError`` naming the argument for any other dtype,
    shape, block, scale shape or device mismatch.
    """
    c = Check("gemm")
    if isinstance(w, QTensor):
        c.qtensor("w", w, block=WEIGHT_BLOCK, ndim=2)
        _check_fp8_k(c, "w", w.shape[1])
    else:
        c.tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2)
    _check_activation(c, a, w, ndim=2, widen=True)
    c.choice("out_dtype", out_dtype, FLOAT_DTYPES)
    if bias is not None:
        c.tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(w.shape[0],))
    c.same_device(a=a.data if isinstance(a, QTensor) else a, w=w.data if isinstance(w, QTensor) else w, bias=bias)
    return call("gemm", a=a, w=w, out_dtype=out_dtype, bias=bias)


def grouped_gemm(
    a: torch.Tensor | QTensor,
    w: torch.Tensor | QTensor | FP4Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One GEMM per expert: rows of expert ``e`` times ``w[e] [N, K]`` transposed. Exactly one layout keyword:

    - contiguous (``expert_offsets``): ``a [M, K]`` with rows grouped by expert, ``expert_offsets [E+1]`` int32,
      nondecreasing from 0 to M; expert ``e`` owns rows ``offsets[e]:offsets[e+1]`` (empty experts allowed).
      Returns ``[M, N]``.
    - masked (``masked_m``): ``a [E, max_m, K]``, ``masked_m [E]`` int32 in ``[0, max_m]``; returns
      ``[E, max_m, N]`` where rows at or past ``masked_m[e]`` are unspecified. No host synchronisation is needed
      (CUDA-graph safe on backends that support it).

    ``w`` is ``[E, N, K]``: float with the dtype of ``a``, or an FP8 ``QTensor`` with ``(128, 128)`` scales
    ``[E, ceil(N/128), K/128]``, or an ``FP4Tensor`` (data ``[E, N, K/2]`` int8, scales ``[E, N, K/32]`` ue8m0,
    ``K % 32 == 0``). ``a`` may be an FP8 ``QTensor`` ``(1, 128)`` when ``w`` is FP8, or float (then quantised
    inside, as in ``gemm``). Against an ``FP4Tensor``, ``a`` is a float tensor (bf16, fp16 or fp32) used as given:
    the result is ``a`` times the weight's exact values (``FP4Tensor.dequantize``), accumulated in fp32.

    ``out``: where given, the result is written into it and it is returned. It has the result's shape, ``out_dtype``
    and ``a``'s device, its last dim contiguous and any other strides (e.g. the heads of a ``[rows, heads, N]``
    buffer, transposed), and it must not share memory with ``a`` or ``w``. In the masked layout its rows at or past
    ``masked_m[e]`` are unspecified afterwards, as in a returned result. Backends may write it directly; where one
    returns another tensor, the op copies that into ``out``.
    """
    c = Check("grouped_gemm")
    if (expert_offsets is None) == (masked_m is None):
        raise c.fail("expert_offsets/masked_m", "exactly one of them", "both" if masked_m is not None else "neither")
    ndim = 2 if expert_offsets is not None else 3
    if isinstance(w, FP4Tensor):
        c.fp4tensor("w", w, ndim=3)
        if isinstance(a, QTensor):
            raise c.fail("a", "a float tensor against an FP4Tensor weight", "an FP8 QTensor")
        c.tensor("a", a, dtypes=FLOAT_DTYPES, ndim=ndim)
        if a.shape[-1] != w.shape[-1]:
            raise c.fail("a", f"K = {w.shape[-1]} in the last dim (the K of 'w')", f"shape {list(a.shape)}")
    else:
        if isinstance(w, QTensor):
            c.qtensor("w", w, block=WEIGHT_BLOCK, ndim=3)
            _check_fp8_k(c, "w", w.shape[2])
        else:
            c.tensor("w", w, dtypes=FLOAT_DTYPES, ndim=3)
        _check_activation(c, a, w, ndim=ndim)
    num_experts = w.shape[0]
    c.choice("out_dtype", out_dtype, FLOAT_DTYPES)
    a_data = a.data if isinstance(a, QTensor) else a
    if expert_offsets is not None:
        c.index("expert_offsets", expert_offsets, length=num_experts + 1)
        c.same_device(a=a_data, expert_offsets=expert_offsets)
        if value_checks_enabled(expert_offsets):
            c.nondecreasing_offsets("expert_offsets", expert_offsets, a.shape[0])
    else:
        c.index("masked_m", masked_m, length=num_experts)
        if a.shape[0] != num_experts:
            raise c.fail("a", f"{num_experts} experts in dim 0 (the E of 'w')", f"shape {list(a.shape)}")
        c.same_device(a=a_data, masked_m=masked_m)
        if value_checks_enabled(masked_m):
            c.values_in_range("masked_m", masked_m, 0, a.shape[1], what="row counts")
    c.same_device(a=a_data, w=w.data if isinstance(w, (QTensor, FP4Tensor)) else w)
    if out is not None:
        c.tensor("out", out, dtypes=(out_dtype,), shape=(*a.shape[:-1], w.shape[1]))
        if out.stride(-1) != 1 and out.shape[-1] > 1:
            raise c.fail("out", "its last dim contiguous (stride 1)", f"strides {list(out.stride())}")
        c.same_device(a=a_data, out=out)
        if any(st == 0 and n > 1 for st, n in zip(out.stride(), out.shape)):
            raise c.fail("out", "no two elements in one place (no stride 0)", f"strides {list(out.stride())}")
        for name, t in (("a", a_data), ("w", w.data if isinstance(w, (QTensor, FP4Tensor)) else w)):
            if out.numel() and t.numel() and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                raise c.fail("out", f"memory apart from '{name}'", f"a view of the memory of '{name}'")
    layout = {"expert_offsets": expert_offsets, "masked_m": masked_m}
    if out is None:  # implementations see `out` only where it is given
        return call("grouped_gemm", a=a, w=w, **layout, out_dtype=out_dtype)
    result = call("grouped_gemm", a=a, w=w, **layout, out_dtype=out_dtype, out=out)
    return result if result is out else out.copy_(result)
