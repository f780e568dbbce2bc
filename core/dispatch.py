"""Routes a validated op call to the selected backend's implementation.

The first implementation (highest priority) whose ``supports`` accepts the arguments runs; if none does, the
reference runs and a ``FallbackWarning`` is shown once per (backend, op), or ``NotSupportedError`` is raised under
``DEEPINFER_STRICT=1``. Under ``DEEPINFER_BATCH_INVARIANT=1`` (or inside ``batch_invariant()``) only
implementations declared batch-invariant are considered.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from . import registry, selection
from .errors import FallbackWarning, NotSupportedError
from .records import OpImpl

_invariant_override: list[bool] = []
_warned: set[tuple[str, str]] = set()
_last: dict[str, tuple[OpImpl, bool]] = {}


def batch_invariant_enabled() -> bool:
    """Whether batch-invariant mode is on (``DEEPINFER_BATCH_INVARIANT=1`` or ``batch_invariant()``)."""
    if _invariant_override:
        return _invariant_override[-1]
    return os.environ.get("DEEPINFER_BATCH_INVARIANT", "0") == "1"


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Turns batch-invariant mode on (or off) inside the block, whatever the environment says."""
    _invariant_override.append(enabled)
    try:
        yield
    finally:
        _invariant_override.pop()


def strict_enabled() -> bool:
    return os.environ.get("DEEPINFER_STRICT", "0") == "1"


def reference_impl(op: str) -> OpImpl:
    return registry.get().impls_for("reference", op)[0]


def resolve(op: str, kwargs: dict[str, Any], backend: str | None = None) -> tuple[OpImpl, bool]:
    """The implementation that runs ``op`` with ``kwargs`` on ``backend`` (default: the selected one), and
    whether it is a fallback to the reference."""
    name = backend or selection.current_backend().name
    invariant = batch_invariant_enabled()
    for impl in registry.get().impls_for(name, op):
        if invariant and not impl.batch_invariant:
            continue
        if impl.supports is None or impl.supports(**kwargs):
            return impl, False
    if name == "reference":
        return reference_impl(op), False
    mode = " in batch-invariant mode" if invariant else ""
    if strict_enabled():
        raise NotSupportedError(
            f"{op}: backend {name!r} has no implementation that supports these arguments{mode}, and "
            "DEEPINFER_STRICT=1 forbids the fallback to the reference"
        )
    if (name, op) not in _warned:
        _warned.add((name, op))
        warnings.warn(
            f"{op}: backend {name!r} has no implementation that supports these arguments{mode}; "
            "running the reference (shown once)",
            FallbackWarning,
            stacklevel=4,
        )
    return reference_impl(op), True


def call(op: str, **kwargs: Any) -> Any:
    """Runs ``op`` on the selected backend (arguments already validated by the op)."""
    _last[op] = resolve(op, kwargs)
    return _last[op][0].fn(**kwargs)


def last_resolution(op: str) -> tuple[OpImpl, bool]:
    """The implementation the latest call of ``op`` in this process ran, and whether it was a fallback."""
    return _last[op]


def prepare_weight(name: str, weight: Any) -> Any:
    """Hands a freshly loaded weight to the selected backend's ``prepare_weight`` (layout conversion done once
    after load); returns it unchanged when the backend has none. ``name`` is the checkpoint key."""
    convert = selection.current_backend().prepare_weight
    return weight if convert is None else convert(name, weight)
