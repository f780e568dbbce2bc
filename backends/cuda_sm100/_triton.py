"""Helpers shared by this backend's Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from deepinfer import Decline, QTensor

from .probe import interpreting

# Fused multiply-adds by default, as every kernel here was measured and checked with: Triton 3.10 turns them off
# where a launch does not say (3.9 warns). Where a launch must not fuse it says so (``enable_fp_fusion=False``).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# The Triton interpreter has no bf16 arithmetic, so kernels take an fp32 path for dot products there (see ``dot``);
# on a GPU the same kernels feed bf16/fp8 to the tensor cores.
INTERPRET = interpreting()

# Programmatic dependent launch (compute capability 9.0 and later). Every `tl` kernel of this backend is launched with
# ``launch_pdl=PDL`` and begins with ``pdl_wait()``: the next kernel in the stream may then be launched while this one
# runs, and waits at its own ``pdl_wait()`` until this one has finished, so its launch latency hides behind this
# kernel's tail (benchmarks/NOTES.md, cross-cutting: 2026-12-02 — programmatic dependent launch).
# ``DEEPINFER_CUDA_PDL=0`` turns it off; the interpreter has no such instructions.
PDL = not INTERPRET and os.environ.get("DEEPINFER_CUDA_PDL", "1") != "0"
_PDL = tl.constexpr(PDL)
_INTERPRET = tl.constexpr(INTERPRET)


def device_type() -> str:
    """Where this backend's kernels take their tensors: the GPU, or the CPU under the interpreter."""
    return "cpu" if INTERPRET else "cuda"


def on_device(*tensors: torch.Tensor | None) -> bool:
    want = device_type()
    return all(t is None or t.device.type == want for t in tensors)


def placed(**tensors: torch.Tensor | QTensor | None) -> bool | Decline:
    """True where every tensor argument given (None skipped, a QTensor by its data) is where this backend's kernels
    take it (``device_type``); else a ``Decline`` naming the first that is not, for a ``supports`` to return."""
    want = device_type()
    for name, t in tensors.items():
        t = t.data if isinstance(t, QTensor) else t
        if t is not None and t.device.type != want:
            return Decline(f"{name} is on {t.device.type}, expected {want}")
    return True


@functools.cache
def hopper(index: int) -> bool:
    """Whether GPU ``index`` is an SM90 (Hopper) one: the Gluon kernels' ``wgmma`` is Hopper's."""
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def num_sms(index: int = 0) -> int:
    if INTERPRET:
        return 4
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_ready(*tensors: torch.Tensor, dims: int = 2) -> bool:
    """Whether each ``dims``-D tensor can be read by TMA copies: its last dimension contiguous, its base and other
    strides 16-byte aligned."""
    return all(
        t.dim() == dims
        and t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in tensors
    )


@triton.jit
def pdl_wait():
    """The first statement of every kernel launched with ``launch_pdl=PDL``: lets the stream's next kernel launch,
    then waits until the previous kernel has completed and its writes are visible. Nothing before it may touch
    global memory."""
    if _PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n`` <= 1), in plain Python: ``triton.next_power_of_2`` goes through
    Triton's constexpr-function wrapper, tens of microseconds a call on the host."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints on the host (``triton.cdiv`` without its wrapper's cost)."""
    return -(-a // b)


@triton.jit
def dot(a, b, acc, FP32: tl.constexpr):
    """``acc + a @ b`` in fp32.

    ``FP32`` is the interpreter's path: it has no bf16 arithmetic, and its ``tl.dot`` calls numpy's BLAS, whose result
    for one row can depend on where the row sits in the tile. An explicit product and sum over K treats every row
    alike, so the interpreter checks the same batch invariance a GPU's tensor cores give.
    """
    if FP32:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if a.dtype == tl.float32:  # fp32 operands stay fp32 (Triton's default would round them to tf32)
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def pow2_ceil(x):
    """The smallest power of two >= x for positive normal fp32 x, exactly (no log2 approximation)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x, PREROUND: tl.constexpr):
    """``x`` (already within +-448) as float8 e4m3, rounded to nearest even.

    The interpreter's own cast mis-rounds values that round up into the next binade (7.99 -> 4), so there the value
    is first rounded in fp32 to a multiple of its e4m3 spacing (adding and removing a number whose ulp is that
    spacing), after which the cast is exact. GPUs round correctly in the cast itself.
    """
    if PREROUND:
        exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals: 2^-9
        spacing = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
        shifter = tl.where(x < 0, -spacing, spacing) * 8388608.0
        x = (x + shifter) - shifter
    return x.to(tl.float8e4nv)


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x`` as ``dtype``, rounded to nearest even on a GPU and under the interpreter alike, so that the errors a CPU
    conformance run measures are those of a GPU's casts. The interpreter's fp32 -> bf16 cast truncates and flushes
    subnormals, so there the bf16 bits are rounded from x's in integer arithmetic (NaN kept as NaN)."""
    if dtype == tl.bfloat16 and _INTERPRET:
        x = x.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        rounded = tl.where(x != x, (bits >> 16) | 0x40, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)  # NaN: quiet
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
