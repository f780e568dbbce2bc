"""cuBLAS through torch for ``gemm``: the block-scaled FP8 product (``scaled_mm``) and the dense bf16 / fp16 / fp32
one, their ``supports``, and the probes that ask once (never inside a CUDA graph capture) whether cuBLAS agrees with
this backend's Triton kernels (``gemm.py``), or, for batch-invariant mode, gives their bits at a row count.

``gemm_fp8_cublas_waves`` (default mode only, on Hopper): where cuBLAS's 128 x 128 tiles make one to three whole waves
and a few tiles more, cuBLAS takes the rows of the whole waves, writing into the output in place, and the few-row
Gluon kernel of ``gemm_gluon`` the rest, instead of cuBLAS running a last wave of a few tiles at most of a whole wave's
time (``cublas_whole_waves``; (2112, 7168) at 1024-3072 rows: benchmarks/HISTORY.md, 2026-12-04 — cuBLAS in whole
waves)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
import triton

from deepinfer import Decline, QTensor, TransientDecline
from deepinfer.qtensor import quantize_blocks

from ._triton import INTERPRET, num_sms, placed
from .gemm import FP8_BLOCK, _as_fp8, gemm_fp8, gemm_triton

try:
    from . import gemm_gluon
except ImportError:  # a Triton without Gluon's Hopper language: no few-row kernel, so no cuBLAS in whole waves
    gemm_gluon = None

CUBLAS_FP8_MIN_M = 256  # below, the Triton kernel (split over K where the GPU would idle) is faster


def gemm_fp8_cublas(a, w, *, out_dtype, bias, out: torch.Tensor | None = None):
    """cuBLAS block-scaled FP8 through torch's ``scaled_mm`` (1x128 activation and 128x128 weight scales, fp32
    accumulation); not batch-invariant. cuBLAS takes row counts that are multiples of 4: rows are padded. ``out``
    (rows a multiple of 4): written in place, through the out form of the op behind ``scaled_mm``."""
    qa = _as_fp8(a, w)
    m, pad = qa.shape[0], -qa.shape[0] % 4
    data, scale = qa.data.contiguous(), qa.scale
    if pad:
        data = F.pad(data.view(torch.uint8), (0, 0, 0, pad)).view(data.dtype)
        scale = F.pad(scale, (0, 0, 0, pad))
    scale_a = scale.t().contiguous().t()  # cuBLAS reads activation scales outer-dim-major
    w_data, w_scale = w.data.contiguous(), w.scale.contiguous()  # (copies only of strided views)
    recipe = F.ScalingType
    if out is not None:
        return torch._scaled_mm_v2(
            data, w_data.t(), [scale_a], [recipe.BlockWise1x128.value], [], [w_scale.t()],
            [recipe.BlockWise128x128.value], [], None, out_dtype, [], False, out=out,
        )  # fmt: skip
    out = F.scaled_mm(
        data, w_data.t(), scale_a, recipe.BlockWise1x128, w_scale.t(), recipe.BlockWise128x128, output_dtype=out_dtype
    )
    return out[:m]


@functools.cache
def _cublas_fp8_agrees() -> bool:
    """Whether this torch and cuBLAS run the block-scaled product, and agree with the Triton kernel, at a shape
    cuBLAS accepts (asked once, outside graph capture)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(128, 512, device="cuda", generator=gen).bfloat16()
    w = quantize_blocks(torch.randn(256, 512, device="cuda", generator=gen))
    try:
        got = gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None).float()
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError):
        return False
    want = gemm_fp8(a, w, out_dtype=torch.float32, bias=None)
    return bool(((got - want).norm() / want.norm()) < 1e-2)


def cublas_fp8_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    a_data = a.data if isinstance(a, QTensor) else a
    if INTERPRET:
        return Decline("cuBLAS does not run in the Triton interpreter")
    if not isinstance(w, QTensor) or w.block != (FP8_BLOCK, FP8_BLOCK):
        return Decline(f"w is not FP8 with ({FP8_BLOCK}, {FP8_BLOCK}) scale blocks")
    if isinstance(a, QTensor) and a.block != (1, FP8_BLOCK):
        return Decline(f"a's scale blocks are {a.block}, not (1, {FP8_BLOCK})")
    if a_data.dim() != 2 or a_data.shape[0] < CUBLAS_FP8_MIN_M:
        return Decline(f"{a_data.shape[0]} rows < {CUBLAS_FP8_MIN_M}")
    if w.shape[1] % (4 * FP8_BLOCK):  # cuBLAS wants a multiple of 4 scale blocks along K
        return Decline(f"K = {w.shape[1]} is not a multiple of {4 * FP8_BLOCK}")
    if bias is not None:
        return Decline("a bias is given")
    if out_dtype != torch.bfloat16:
        return Decline(f"out_dtype is {out_dtype}, expected torch.bfloat16")
    if a_data.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return Decline(f"a is {a_data.dtype}, not bf16 or e4m3")
    if not (answer := placed(a=a, w=w)):
        return answer
    if not hasattr(F, "scaled_mm"):
        return Decline("this torch has no scaled_mm")
    if not (ready := _cublas_fp8_ready()):
        return _refused(ready, "cuBLAS's block-scaled FP8 product is not known to agree here")
    return True


def _refused(answer: bool | None, why: str) -> Decline:
    """The decline of a probe's ``answer`` (``_cublas_fp8_ready``, ``_cublas_agreed``): transient where the probe has
    not been asked yet (None), for good where it said no."""
    return (TransientDecline if answer is None else Decline)(why)


def _cublas_fp8_ready() -> bool | None:
    """``_cublas_fp8_agrees()``; None inside a CUDA graph capture where it was not asked yet (it is never asked for
    the first time there)."""
    if _cublas_fp8_agrees.cache_info().currsize or not torch.cuda.is_current_stream_capturing():
        return _cublas_fp8_agrees()
    return None


_cublas_answers: dict[tuple, bool] = {}  # per key (FP8 or dense product): whether cuBLAS gave the Triton bits


def _cublas_agreed(key: tuple, probe: Callable[[], bool]) -> bool | None:
    """``probe()``'s answer for ``key``, asked once; None inside a CUDA graph capture where it was not asked yet (it
    is never asked for the first time there)."""
    if key not in _cublas_answers:
        if torch.cuda.is_current_stream_capturing():
            return None
        _cublas_answers[key] = probe()
    return _cublas_answers[key]


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def cublas_fp8_invariant_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """cuBLAS in batch-invariant mode: where it runs, and only at a row count where it gave the unsplit Triton
    kernel's bits (asked once per row count and weight shape, outside graph capture, on random activations)."""
    answer = cublas_fp8_supports(a, w, out_dtype=out_dtype, bias=bias)
    if not answer:
        return answer
    m = (a.data if isinstance(a, QTensor) else a).shape[0]
    agreed = _cublas_agreed((m, *w.shape, w.data.device.index or 0), lambda: _cublas_gives_unsplit_bits(m, w))
    if not agreed:
        return _refused(agreed, f"at {m} rows cuBLAS does not give the unsplit kernel's bits (or was not asked yet)")
    return True


def _cublas_gives_unsplit_bits(m: int, w: QTensor) -> bool:
    device, k = w.data.device, w.shape[1]
    gen = torch.Generator(device=device).manual_seed(m)
    code = torch.randint(0, 254, (m, k), dtype=torch.uint8, device=device, generator=gen)
    data = (code + (code >= 127).to(torch.uint8)).view(torch.float8_e4m3fn)  # any sign and magnitude, never NaN
    scale = torch.randint(-8, 8, (m, k // FP8_BLOCK), device=device, generator=gen).float().exp2()
    a = QTensor(data, scale, (1, FP8_BLOCK), w.scale_format)
    want = gemm_fp8(a, w, out_dtype=torch.bfloat16, bias=None, invariant=True)
    return _same_bits(gemm_fp8_cublas(a, w, out_dtype=torch.bfloat16, bias=None), want)


@functools.cache
def _mm_widens() -> bool:
    """Whether this torch multiplies bf16 / fp16 matrices straight into an fp32 result (``torch.mm(out_dtype=)``)."""
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


@contextlib.contextmanager
def _fp32_reductions() -> Iterator[None]:
    """Within the block cuBLAS keeps split-K partial sums of bf16 / fp16 products in fp32 (torch's default lets it
    reduce them in the operands' precision)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = before


def gemm_cublas(a, w, *, out_dtype, bias):
    """cuBLAS through torch, fp32 accumulation (split-K partials included); not batch-invariant (cuBLAS picks
    algorithms by shape). An fp32 result is never rounded to the input dtype on the way: bf16 / fp16 operands go
    straight into an fp32 result where torch can (logits over a large vocabulary: no fp32 copy of the weight each
    call), else through fp32 copies of the operands (a bf16 / fp16 ``a`` against an fp32 ``w`` too)."""
    if a.dtype != w.dtype:
        a = a.float()
    if out_dtype == torch.float32 and a.dtype != torch.float32:
        if _mm_widens():
            out = torch.mm(a, w.t(), out_dtype=torch.float32)
            return out if bias is None else out + bias.float()
        a, w = a.float(), w.float()
    with _fp32_reductions():
        out = torch.nn.functional.linear(a, w)
    if bias is not None:
        return (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)


def cublas_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    if INTERPRET:
        return Decline("cuBLAS does not run in the Triton interpreter")
    if isinstance(w, QTensor) or isinstance(a, QTensor):
        return Decline("a or w is an FP8 QTensor")
    if not (answer := placed(a=a, w=w, bias=bias)):
        return answer
    return True


CUBLAS_DENSE_INVARIANT_MIN_M = 256  # below, the Triton tile is as fast at lm_head's shape (NOTES.md, gemm)


def cublas_invariant_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """cuBLAS for bf16 / fp16 operands in batch-invariant mode: from ``CUBLAS_DENSE_INVARIANT_MIN_M`` rows, without
    a bias, and only at a row count where it gave ``gemm_triton``'s bits (asked once per row count, shape and dtypes,
    outside graph capture, on random activations against the weight itself)."""
    answer = cublas_supports(a, w, out_dtype=out_dtype, bias=bias)
    if not answer:
        return answer
    if bias is not None:
        return Decline("a bias is given")
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        return Decline(f"a is {a.dtype} and w {w.dtype}, expected both bfloat16 or both float16")
    if a.shape[0] < CUBLAS_DENSE_INVARIANT_MIN_M:
        return Decline(f"{a.shape[0]} rows < {CUBLAS_DENSE_INVARIANT_MIN_M}")
    m = a.shape[0]
    key = ("dense", m, *w.shape, a.dtype, out_dtype, w.device.index or 0)
    agreed = _cublas_agreed(key, lambda: _cublas_gives_triton_bits(m, w, out_dtype))
    if not agreed:
        return _refused(agreed, f"at {m} rows cuBLAS does not give the Triton tile's bits (or was not asked yet)")
    return True


def _cublas_gives_triton_bits(m: int, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    gen = torch.Generator(device=w.device).manual_seed(m)
    a = torch.randn(m, w.shape[1], device=w.device, generator=gen).to(w.dtype)
    want = gemm_triton(a, w, out_dtype=out_dtype, bias=None)
    return _same_bits(gemm_cublas(a, w, out_dtype=out_dtype, bias=None), want)


# --- cuBLAS in whole waves, the rest of the rows by the few-row Gluon kernel (Hopper) --------------------------------

CUBLAS_TILE = 128  # cuBLAS's tile of the block-scaled FP8 product on the H200 (nvjet_sm90_qqtst_128x128)
# The most whole waves the split takes: (2112, 7168) at 1024 / 2048 / 3072 rows (1-3 waves and a few tiles) took
# 0.82 / 0.87 / 0.89x cuBLAS's time split, but at 4096 rows (4 waves and 16 tiles) 1.05x: there cuBLAS ran another
# kernel (2 x 4 clusters, not 4 x 2), whose last partial wave cost 5 us instead of 20-23 (benchmarks/HISTORY.md,
# 2026-12-04 — cuBLAS in whole waves).
CUBLAS_SPLIT_MAX_WAVES = 3


def cublas_whole_waves(m: int, n: int, k: int, sms: int) -> int:
    """The rows of an [m, n] FP8 product over K = ``k`` whose ``CUBLAS_TILE``-square tiles make 1 to
    ``CUBLAS_SPLIT_MAX_WAVES`` whole waves of ``sms``, where the rest of the rows (at most ``gemm_gluon.FEW_MAX_M``)
    fits the few-row kernel's rule in the default mode; else 0. cuBLAS gives a partial last wave of a few tiles most of
    a whole wave's time: (2112, 7168) at 1024 rows is 1.03 waves of 132 SMs, and took 0.0469 ms against 0.0264 for
    896 rows (one wave); the few-row kernel took the other 128 rows in 0.0112 ms."""
    grid_n = triton.cdiv(n, CUBLAS_TILE)
    waves = triton.cdiv(m, CUBLAS_TILE) * grid_n // sms
    first = waves * sms // grid_n * CUBLAS_TILE
    rest = m - first
    if not 0 < waves <= CUBLAS_SPLIT_MAX_WAVES or not 0 < rest <= gemm_gluon.FEW_MAX_M or k > gemm_gluon.MAX_FEW_K:
        return 0
    _, groups, programs = gemm_gluon.few_rows_grid(rest, n, k, sms)
    return first if gemm_gluon.FEW_MIN_SHARE * sms < programs // groups and programs <= sms else 0


def gemm_fp8_cublas_waves(a, w: QTensor, *, out_dtype, bias) -> torch.Tensor:
    """``gemm`` by cuBLAS over ``cublas_whole_waves`` rows, written in place, then the few-row kernel over the rest
    (a bf16 ``a`` is quantised first)."""
    qa = _as_fp8(a, w)
    m, k = qa.shape
    n = w.shape[0]
    first = cublas_whole_waves(m, n, k, num_sms(qa.data.device.index or 0))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=qa.data.device)
    head, rest = (
        dataclasses.replace(qa, data=qa.data[rows], scale=qa.scale[rows]) for rows in (slice(first), slice(first, m))
    )
    gemm_fp8_cublas(head, w, out_dtype=torch.bfloat16, bias=None, out=out[:first])
    gemm_gluon.launch_few_rows(rest, w, out=out[first:])
    return out


def cublas_waves_supports(a, w, *, out_dtype, bias) -> bool | Decline:
    """Where cuBLAS would serve (``cublas_fp8_supports`` and not ``gemm_gluon.supports``), with the out form of the op
    behind ``scaled_mm``, the few-row kernel's operands, and rows that ``cublas_whole_waves`` splits."""
    answer = cublas_fp8_supports(a, w, out_dtype=out_dtype, bias=bias)
    answer = gemm_gluon._fp8_operands(a, w, out_dtype, bias) if answer else answer
    if not answer:
        return answer
    if gemm_gluon.supports(a, w, out_dtype=out_dtype, bias=bias):
        return Decline("gluon-fp8-ws serves these rows")
    if not hasattr(torch, "_scaled_mm_v2"):
        return Decline("this torch has no _scaled_mm_v2 (the out form of scaled_mm)")
    m = (a.data if isinstance(a, QTensor) else a).shape[0]
    if cublas_whole_waves(m, *w.shape, num_sms(w.data.device.index or 0)) == 0:
        return Decline(
            f"{m} rows do not split into 1 to {CUBLAS_SPLIT_MAX_WAVES} whole cuBLAS waves and a few-row rest"
        )
    return True
