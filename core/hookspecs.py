"""The plugin hooks a backend package implements (pluggy project ``deepinfer``).

A backend is a module named by an entry point in the ``deepinfer`` group::

    [project.entry-points.deepinfer]
    mybackend = "my_package.plugin"

whose functions are marked with ``deepinfer.hookimpl``. Both hooks return records; see ``deepinfer.records``.
"""

from __future__ import annotations

import pluggy

from .records import BackendSpec, OpImpl

hookspec = pluggy.HookspecMarker("deepinfer")
hookimpl = pluggy.HookimplMarker("deepinfer")


@hookspec
def deepinfer_backend() -> BackendSpec:
    """Describe the backend this plugin provides."""


@hookspec
def deepinfer_op_impls() -> list[OpImpl]:
    """List the op implementations this plugin provides (each names its backend)."""
