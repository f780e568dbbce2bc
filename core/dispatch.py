"""Routes a validated op call to the selected backend's implementation.

The first implementation (highest priority) whose ``supports`` accepts the arguments runs; if none does, the
reference runs and a ``FallbackWarning`` is shown once per (backend, op), or ``NotSupportedError`` is raised under
``DEEPINFER_STRICT=1``. Under ``DEEPINFER_BATCH_INVARIANT=1`` (or inside ``batch_invariant()``) only
implementations declared batch-invariant are considered. ``explain`` and ``explain_call`` say, without running
a kernel, which implementation a call takes and why the ones before it declined (``deepinfer info --ops``).

The choice cache. Inside ``cached_choices()`` (the engine opens one for each step it launches) ``resolve`` remembers
its choice per call signature, so that the many calls of one step with equal signatures (a layer's ops, layer after
layer) ask the ``supports`` once. The key is the op, the backend's name, whether batch-invariant mode is on, and
each argument by name: a tensor (a ``torch.Tensor`` or ``Parameter``; no other subclass) by its type, dtype, shape,
strides, device and ``data_ptr() % POINTER_ALIGNMENT``; a ``QTensor`` / ``FP4Tensor`` by its data and scale tensors,
its block and scale format and the type of ``prepared``; a tuple or list by its items; a bool, int, float, str,
None, dtype or device by its type and value. A call with any other argument (a process group, a handle, an expert
placement) is not remembered, nor is a choice made past a ``TransientDecline``, nor one of a backend's only
implementation of an op (its ``supports`` costs about what a key does). A ``supports`` never reads tensor values
(``OpImpl.supports``), nor a tensor's identity or full address; everything else it reads (module constants, the
environment, the device's properties) must not change inside the block. Blocks and their choices are per thread: a
thread's outermost block starts and ends with an empty cache, so a change between steps (a test's monkeypatch, a
benchmark's ``--set``) is always seen; code that changes such a thing inside a block calls ``clear_choice_cache()``
(``registry.reload`` does, for its thread). Outside any block nothing is remembered. A remembered fallback still
raises under ``DEEPINFER_STRICT=1`` and warns as above; ``explain`` and ``explain_call`` always ask every
``supports``. The cache holds at most ``MAX_CHOICES`` entries and is emptied when full.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import registry, selection
from .errors import FallbackWarning, NotSupportedError
from .qtensor import FP4Tensor, QTensor
from .records import OpImpl, TransientDecline, verdict

MAX_CHOICES = 4096  # remembered choices; shapes vary (prefill chunk lengths), so the cache is emptied when full
# A ``supports`` may test a pointer's alignment up to this many bytes (TMA copies want 16). Not more: CPU allocations
# are 64-byte aligned, so a larger modulus would tell apart calls the supports answer alike (layer after layer).
POINTER_ALIGNMENT = 64

_invariant_override: list[bool] = []
_warned: set[tuple[str, str]] = set()
_last: dict[str, tuple[OpImpl, bool]] = {}
_intercepted: list[tuple[str, str | None]] = []  # (op, backend) whose next call explain_call answers instead


class _ChoiceCache(threading.local):
    """One thread's remembered choices (call key -> the implementation chosen; None: the reference fallback) and its
    ``cached_choices()`` blocks entered and not left."""

    def __init__(self) -> None:
        self.choices: dict[tuple, OpImpl | None] = {}
        self.depth = 0


_cache = _ChoiceCache()
_UNSEEN = object()


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


@contextlib.contextmanager
def cached_choices() -> Iterator[None]:
    """Inside the block ``resolve`` remembers its choices (the module docstring's contract); the outermost block
    starts and ends with an empty cache."""
    if not _cache.depth:
        _cache.choices.clear()
    _cache.depth += 1
    try:
        yield
    finally:
        _cache.depth -= 1
        if not _cache.depth:
            _cache.choices.clear()


def clear_choice_cache() -> None:
    """Forgets this thread's remembered choices: for code that changes what a ``supports`` reads inside
    ``cached_choices``."""
    _cache.choices.clear()


class _Unkeyable(Exception):
    """An argument the key cannot describe: the call is not remembered."""


def _tensor_key(t: torch.Tensor) -> tuple:
    return type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % POINTER_ALIGNMENT


def _by_value(v: object) -> tuple:
    return type(v), v


def _items_key(items: tuple | list) -> tuple:
    return type(items), *map(_arg_key, items)


def _qtensor_key(q: QTensor) -> tuple:
    fields = _arg_key(q.data), _arg_key(q.scale), _arg_key(q.block), _arg_key(q.scale_format)
    return QTensor, *fields, type(q.prepared)


def _fp4_key(q: FP4Tensor) -> tuple:
    return FP4Tensor, _arg_key(q.data), _arg_key(q.scale), type(q.prepared)


# By exact type: a tensor subclass other than a Parameter may answer these questions its own way.
_DESCRIBE = {
    torch.Tensor: _tensor_key,
    torch.nn.Parameter: _tensor_key,
    QTensor: _qtensor_key,
    FP4Tensor: _fp4_key,
    tuple: _items_key,
    list: _items_key,
    **dict.fromkeys((bool, int, float, str, type(None), torch.dtype, torch.device), _by_value),
}


def _arg_key(value: object) -> tuple:
    describe = _DESCRIBE.get(type(value))
    if describe is None:
        raise _Unkeyable
    return describe(value)


def _choice_key(op: str, backend: str, invariant: bool, kwargs: dict[str, Any]) -> tuple | None:
    """What the choice for this call depends on (the module docstring); None where an argument has no key."""
    try:
        return op, backend, invariant, tuple(kwargs), tuple(map(_arg_key, kwargs.values()))
    except (_Unkeyable, RuntimeError):  # or a tensor without storage (no data_ptr): asked every time, as before
        return None


def _walk(impls: list[OpImpl], invariant: bool, kwargs: dict[str, Any], remember: bool) -> tuple[OpImpl | None, bool]:
    """The first of ``impls`` that accepts the call (None: none does), and whether the choice may be remembered:
    ``remember`` and no ``supports`` on the way answered a ``TransientDecline``."""
    for impl in impls:
        if invariant and not impl.batch_invariant:
            continue
        if impl.supports is None:
            return impl, remember
        answer = impl.supports(**kwargs)
        if answer:
            return impl, remember
        if remember and isinstance(answer, TransientDecline):
            remember = False
    return None, remember


def _fall_back(op: str, backend: str, invariant: bool) -> tuple[OpImpl, bool]:
    """The reference, where no implementation of ``backend`` accepts a call: warned once per (backend, op), refused
    under ``DEEPINFER_STRICT=1``."""
    if backend == "reference":
        return reference_impl(op), False
    mode = " in batch-invariant mode" if invariant else ""
    if strict_enabled():
        raise NotSupportedError(
            f"{op}: backend {backend!r} has no implementation that supports these arguments{mode}, and "
            "DEEPINFER_STRICT=1 forbids the fallback to the reference"
        )
    if (backend, op) not in _warned:
        _warned.add((backend, op))
        warnings.warn(
            f"{op}: backend {backend!r} has no implementation that supports these arguments{mode}; "
            "running the reference (shown once)",
            FallbackWarning,
            stacklevel=5,
        )
    return reference_impl(op), True


def resolve(op: str, kwargs: dict[str, Any], backend: str | None = None) -> tuple[OpImpl, bool]:
    """The implementation that runs ``op`` with ``kwargs`` on ``backend`` (default: the selected one), and
    whether it is a fallback to the reference. Inside ``cached_choices`` a call whose key was seen takes the
    remembered choice without asking any ``supports``."""
    name = backend or selection.current_backend().name
    invariant = batch_invariant_enabled()
    impls = registry.get().impls_for(name, op)
    # a lone implementation's supports costs about what a key does: only choices between several are remembered
    key = _choice_key(op, name, invariant, kwargs) if _cache.depth and len(impls) > 1 else None
    impl = _UNSEEN if key is None else _cache.choices.get(key, _UNSEEN)
    if impl is _UNSEEN:
        impl, remember = _walk(impls, invariant, kwargs, key is not None)
        if remember:
            if len(_cache.choices) >= MAX_CHOICES:
                _cache.choices.clear()
            _cache.choices[key] = impl
    return (impl, False) if impl is not None else _fall_back(op, name, invariant)


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
