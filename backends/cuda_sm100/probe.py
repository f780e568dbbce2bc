"""Finds out, without creating a CUDA context, whether this backend can run here.

The GPU is asked through NVML (the driver's management library) rather than the CUDA runtime, so ``deepinfer
info`` and auto-detection neither initialise CUDA nor compile anything.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass

import torch

MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class GpuInfo:
    name: str
    capability: tuple[int, int]


def interpreting() -> bool:
    """Kernels run through the Triton interpreter on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _visible_index() -> int | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    return int(first) if first.isdigit() else None


def first_gpu() -> GpuInfo | str:
    """The first visible NVIDIA GPU, or why there is none."""
    index = _visible_index()
    if index is None:
        return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides every device"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return "no NVIDIA driver (libnvidia-ml.so.1 not found)"
    if nvml.nvmlInit_v2() != 0:
        return "the NVIDIA driver did not initialise (nvmlInit failed)"
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value <= index:
            return "no CUDA device"
        handle = ctypes.c_void_p()
        nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
        major, minor = ctypes.c_int(), ctypes.c_int()
        nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
        name = ctypes.create_string_buffer(96)
        nvml.nvmlDeviceGetName(handle, name, 96)
        return GpuInfo(name.value.decode(errors="replace"), (major.value, minor.value))
    finally:
        nvml.nvmlShutdown()


def triton_installed() -> bool:
    """Whether ``import triton`` can work here (found without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: its import is blocked, as if it were not installed
        return False


def probe() -> tuple[bool, str]:
    if not triton_installed():
        return False, "triton is not installed (pip install 'deepinfer[cuda]')"
    if interpreting():
        return True, "Triton interpreter on the CPU (TRITON_INTERPRET=1): correctness only, not speed"
    if torch.version.cuda is None:
        return False, f"this torch build ({torch.__version__}) has no CUDA support"
    gpu = first_gpu()
    if isinstance(gpu, str):
        return False, gpu
    if gpu.capability < MIN_CAPABILITY:
        return False, f"compute capability {gpu.capability[0]}.{gpu.capability[1]} < 9.0 ({gpu.name})"
    return True, f"{gpu.name}, compute capability {gpu.capability[0]}.{gpu.capability[1]}"


def capabilities() -> frozenset[str]:
    """Feature flags of the device at hand: FP4 and tcgen05 only on compute capability 10.x."""
    caps = {"fp8_e4m3", "kv_fp8_ds_mla", "batch_invariant"}
    gpu = None if interpreting() else first_gpu()
    if isinstance(gpu, GpuInfo):
        caps.add("cuda_graphs")
        if gpu.capability[0] == 10:
            caps |= {"fp4", "tcgen05"}
    return frozenset(caps)
