"""What the Gluon kernels share: names that moved between Triton versions, programmatic dependent launch, TMA
descriptors, a view of shared memory."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Gluon is experimental and renames things: Triton 3.6 (the H200 machine's) has ``tma.async_copy_global_to_shared``
# and ``gl.thread_barrier``; later versions ``tma.async_load`` and ``gl.barrier``, and refuse the old names. The same
# goes for cp.async: ``async_copy.async_copy_global_to_shared``, then ``async_copy.async_load``.
TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
TMA_STORE = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
BARRIER = getattr(gl, "thread_barrier", None) or gl.barrier
ASYNC_LOAD = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
ASYNC_COMMIT, ASYNC_WAIT = async_copy.commit_group, async_copy.wait_group
REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # ``_reinterpret`` in Triton 3.6


# Gluon has no ``gdc_launch_dependents`` / ``gdc_wait``: the same instructions, inline. A kernel launched with
# ``launch_pdl`` must call ``wait_previous`` before it touches global memory (tests/test_cuda_sm100_launch.py).
@gluon.jit
def launch_dependents(PDL: gl.constexpr):
    """Lets the stream's next kernel launch now (programmatic dependent launch, as ``_triton.pdl_wait``)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)  # fmt: skip


@gluon.jit
def wait_previous(PDL: gl.constexpr):
    """Waits until the stream's previous kernel has finished and its writes are visible (``PDL``)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def plain_rows(smem, shape: gl.constexpr):
    """``smem`` (unswizzled) seen as ``shape``, whose rows ``.index(i).load`` reads one at a time."""
    if REINTERPRET:
        return smem.reinterpret(smem.dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        return smem._reinterpret(smem.dtype, shape, gl.SwizzledSharedLayout(1, 1, 1, [0]))


def tma_descriptor(tensor: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
    """A TMA descriptor of ``tensor`` in ``box``es of Gluon ``dtype``, in the default NVMMA shared layout (the one
    the kernels allocate their stages in)."""
    return TensorDescriptor.from_tensor(tensor, box, gl.NVMMASharedLayout.get_default_for(box, dtype))
