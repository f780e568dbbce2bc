"""The pluggy hooks of the ``cuda_sm100`` backend."""

from __future__ import annotations

from deepinfer import BackendSpec, OpImpl, hookimpl

from . import probe

NAME = "cuda_sm100"


@hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name=NAME,
        device_type="cuda",
        aliases=("cuda", "nvidia"),
        probe=probe.probe,
        capabilities=probe.capabilities(),
        version="0.1.0",
    )


@hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    return []
