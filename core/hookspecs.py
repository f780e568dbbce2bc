"""The plugin hooks a backend package implements (pluggy project ``deepinfer``).

A backend is a module named by an entry point in the ``deepinfer`` group::

    [project.entry-points.deepinfer]
    mybackend = "my_package.plugin"

whose functions are marked with ``deepinfer.hookimpl``. Both hooks return records; see ``deepinfer.records``.

Each kernel a backend can choose between for an op is best registered as its own ``OpImpl`` (its own provider
name and priority), with a ``supports`` that returns ``Decline(reason)`` where it does not serve the call: then
``deepinfer info --ops`` can list the kernels in the order they are tried and say, per input shape, which one runs
and why the ones before it declined, and conformance reports name the kernel that ran.
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
    """List the op implementations this plugin provides (each names its backend); among one backend's
    implementations of an op, the highest ``priority`` whose ``supports`` accepts the arguments runs."""
