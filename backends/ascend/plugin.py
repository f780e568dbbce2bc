"""The pluggy hooks of the ``ascend`` backend."""

from __future__ import annotations

import importlib.util

from deepinfer import BackendSpec, OpImpl, hookimpl

NAME = "ascend"


def probe() -> tuple[bool, str]:
    """Available when torch_npu imports and reports an NPU; importing it needs CANN's libraries."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (pip install 'deepinfer[ascend]')"
    try:
        import torch_npu
    except Exception as e:  # CANN libraries missing or mismatched: say so, never crash deepinfer
        return False, f"torch_npu is not importable: {type(e).__name__}: {e}"
    if not torch_npu.npu.is_available():
        return False, "torch_npu imports but finds no NPU"
    return True, f"torch_npu {getattr(torch_npu, '__version__', '?')}"


@hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(name=NAME, device_type="npu", aliases=("npu",), probe=probe, version="0.1.0")


@hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    return []
