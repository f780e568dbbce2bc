"""TEST DOUBLE of the ``torch_npu.npu`` device namespace: one emulated device on the CPU, no NPU involved."""

from __future__ import annotations

from ._common import soc


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def get_device_name(device: int | None = None) -> str:
    """The emulated chip (``DEEPINFER_TORCH_NPU_DOUBLE_SOC``, default Ascend950PR)."""
    return soc()


def synchronize(device: int | None = None) -> None:
    return None
