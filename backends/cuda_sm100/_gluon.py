"""What the Gluon kernels share: names that moved between Triton versions, TMA descriptors, a view of shared memory."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._triton import PDL

# Gluon is experimental and renames things: Triton 3.6 (the H200 machine's) has ``tma.async_copy_global_to_shared``
# and ``gl.thread_barrier``; later versions ``tma.async_load`` and ``gl.barrier``, and refuse the old names.
TMA_LOAD = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
TMA_STORE = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
BARRIER = getattr(gl, "thread_barrier", None) or gl.barrier
REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))  # ``_reinterpret`` in Triton 3.6
_PDL = gl.constexpr(PDL)


@gluon.jit
def pdl_wait():
    """``_triton.pdl_wait`` for a Gluon kernel launched with ``launch_pdl=PDL`` and 4 warps, as its first statement:
    lets the stream's next kernel launch, then waits until the previous kernel has completed and its writes are
    visible. (Gluon has no ``gdc_wait``: the same two instructions, inline.)"""
    if _PDL:
        dummy = gl.full([1], 0, gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait; // $0 $1", "=r,r", [dummy],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


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
