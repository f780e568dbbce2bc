"""The built-in ``reference`` backend: plain PyTorch in fp32 math on any torch device.

It is the specification every backend is tested against, and the fallback for arguments a backend does not
support. Each op family has a file of the same name as in ``deepinfer.ops``. Every reference is batch-invariant:
work is done per sequence, per row or per expert, and matrix products go row by row in batch-invariant mode.
"""

from __future__ import annotations

import torch

from ..hookspecs import hookimpl
from ..records import BackendSpec, OpImpl
from . import (
    activation,
    attention,
    compressed_attention,
    gemm,
    hyper_connection,
    moe,
    norm,
    rope,
    sampling,
    sparse_attention,
)

_MODULES = (
    attention,
    sparse_attention,
    gemm,
    moe,
    norm,
    rope,
    activation,
    sampling,
    hyper_connection,
    compressed_attention,
)


@hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name="reference",
        device_type="cpu",
        aliases=("cpu", "ref"),
        probe=lambda: (True, "plain PyTorch; runs on any torch device"),
        capabilities=frozenset({"fp8_e4m3", "kv_fp8_ds_mla", "batch_invariant"}),
        version=torch.__version__,
    )


@hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    from ..ops import OP_NAMES

    by_name = {name: getattr(m, name) for m in _MODULES for name in OP_NAMES if hasattr(m, name)}
    return [OpImpl(op, "reference", "torch", by_name[op], batch_invariant=True) for op in OP_NAMES]
