"""Routes a validated op call to the selected backend's implementation.

The first implementation (highest priority) whose ``supports`` accepts the arguments runs; if none does, the
reference runs and a ``FallbackWarning`` is shown once per (backend, op), or ``NotSupportedError`` is raised under
``DEEPINFER_STRICT=1``. Under ``DEEPINFER_BATCH_INVARIANT=1`` (or inside ``batch_invariant()``) only
implementations declared batch-invariant are considered. ``explain`` and ``explain_call`` say, without running
a kernel, which implementation a call takes and why the ones before it declined (``deepinfer info --ops``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import registry, selection
from .errors import FallbackWarning, NotSupportedError
from .records import OpImpl, verdict

_invariant_override: list[bool] = []
_warned: set[tuple[str, str]] = set()
_last: dict[str, tuple[OpImpl, bool]] = {}
_intercepted: list[tuple[str, str | None]] = []  # (op, backend) whose next call explain_call answers instead


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


@dataclass(frozen=True)
class Choice:
    """What one implementation answers for one call. status: ``taken`` (it runs), ``declined`` (its ``supports``
    said no; ``reason`` says why where it gave a ``Decline``), ``skipped`` (not batch-invariant, in batch-invariant
    mode) or ``not tried`` (after the taken one); ``fallback``: the reference runs because nothing accepted."""

    impl: OpImpl
    status: str
    reason: str = ""


def explain(op: str, kwargs: dict[str, Any], backend: str | None = None) -> list[Choice]:
    """Each implementation of ``op`` on ``backend`` (default: the selected one) in the order ``resolve`` tries them,
    with its answer for ``kwargs``; where none accepts, the reference last (``fallback``). Calls only ``supports``."""
    name = backend or selection.current_backend().name
    invariant = batch_invariant_enabled()
    choices: list[Choice] = []
    taken = False
    for impl in registry.get().impls_for(name, op):
        if taken:
            choices.append(Choice(impl, "not tried"))
        elif invariant and not impl.batch_invariant:
            choices.append(Choice(impl, "skipped", "not batch-invariant"))
        else:
            ok, why = (True, "") if impl.supports is None else verdict(impl.supports(**kwargs))
            choices.append(Choice(impl, "taken" if ok else "declined", why))
            taken = ok
    if not taken:
        fallback = name != "reference"
        why = f"no implementation of {name!r} accepts these arguments" if fallback else ""
        choices.append(Choice(reference_impl(op), "fallback" if fallback else "taken", why))
    return choices


class _Explained(BaseException):  # not an Exception: no `except Exception` on the way may swallow it
    def __init__(self, choices: list[Choice]):
        self.choices = choices


def explain_call(op: str, run: Callable[[], Any], backend: str | None = None) -> list[Choice]:
    """``explain`` for the first call of ``op`` that ``run`` makes (through the public op, so with the arguments
    validation hands to dispatch); that call is not run, nor what follows it in ``run``. Calls of other ops before it
    run as usual. Raises ``LookupError`` if ``run`` never calls ``op``."""
    _intercepted.append((op, backend))
    try:
        run()
    except _Explained as e:
        return e.choices
    finally:
        _intercepted.pop()
    raise LookupError(f"the call never reached {op}")


def call(op: str, **kwargs: Any) -> Any:
    """Runs ``op`` on the selected backend (arguments already validated by the op)."""
    if _intercepted and _intercepted[-1][0] == op:
        raise _Explained(explain(op, kwargs, _intercepted[-1][1]))
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
