"""TEST DOUBLE of torch_npu: shared checks, the call log and the emulated chip.

Nothing here touches an NPU. The double enforces the constraints torch_npu's documentation states (layouts,
dtypes, block sizes, alignment) and raises ``DocumentedRejection`` where the real library would refuse the call;
features the docs describe but this double does not emulate raise ``NotEmulated`` (the backend must not use them).
Outputs the docs leave undefined (rows of a fully masked query, rows past the valid count) are filled with NaN or
a fixed byte pattern so that a caller who reads them fails loudly.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: The chip the double pretends to be; the ascend backend reads it through ``torch_npu.npu.get_device_name``.
DEFAULT_SOC = "Ascend950PR"
SOC_ENV = "DEEPINFER_TORCH_NPU_DOUBLE_SOC"


class DocumentedRejection(RuntimeError):
    """The real torch_npu would reject this call: the message names the documented constraint."""


class NotEmulated(NotImplementedError):
    """A documented torch_npu feature that this test double does not implement."""


CALLS: list[tuple[str, dict[str, Any]]] = []


def record(op: str, **info: Any) -> None:
    """Logs one call (op name and the layout facts a wiring test asserts on)."""
    CALLS.append((op, info))


def soc() -> str:
    return os.environ.get(SOC_ENV, DEFAULT_SOC)


def is_950() -> bool:
    name = soc()
    return name.startswith("Ascend950") or name.startswith("Ascend910_95")


def require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise DocumentedRejection(f"{op}: {message} (torch_npu test double, per the op-plugin documentation)")


def not_emulated(cond: bool, op: str, message: str) -> None:
    if cond:
        raise NotEmulated(f"{op}: {message} is documented but not emulated by the torch_npu test double")


def dtype_in(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], op: str, name: str) -> None:
    require(t.dtype in dtypes, op, f"{name} dtype must be one of {[str(d) for d in dtypes]}, got {t.dtype}")


def contiguous(t: torch.Tensor | None, op: str, name: str) -> None:
    if t is not None:
        require(t.is_contiguous(), op, f"{name} must be contiguous (non-contiguous tensors are not supported)")


def is_transposed_view(t: torch.Tensor) -> bool:
    """``t`` is the transpose of a contiguous tensor over its last two dims, judged by strides as op-plugin does
    (``stride(-2) == 1`` and ``stride(-1) == size(-2)``), so degenerate sizes of 1 are still seen as transposed."""
    if t.dim() < 2:
        return False
    return t.stride(-2) == 1 and t.stride(-1) == max(t.shape[-2], 1) and t.transpose(-1, -2).is_contiguous()


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills ``t`` with what an undefined output should look like to a caller: NaN, or 0x7B bytes for integers."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(0x7B)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


FP8_MAX = 448.0
