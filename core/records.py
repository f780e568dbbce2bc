"""The records plugins return: a backend's description, its op implementations, and why one declines a call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class BackendSpec:
    """What a backend is.

    name: unique backend name (``DEEPINFER_ACCELERATOR`` and ``deepinfer.use`` accept it).
    device_type: the torch device type its kernels run on: ``cuda``, ``npu`` or ``cpu``. Only non-``cpu``
        backends take part in auto-detection; a ``cpu`` backend must be chosen by name.
    probe: returns ``(available, reason)``; must be cheap and free of side effects (no device context, no NPU
        init, no kernel compile), since ``deepinfer info`` calls it.
    aliases: other names it answers to (``cuda``, ``npu``...).
    capabilities: feature flags, e.g. ``fp8_e4m3``, ``fp4``, ``kv_fp8_ds_mla``, ``cuda_graphs``.
    version: the backend's version string.
    prepare_weight: optional one-time conversion of a loaded weight into the backend's physical layout,
        ``prepare_weight(name, weight) -> weight``; the result must still be a valid op argument
        (same logical shape and values).
    tolerances: per-op overrides of the conformance tolerances, ``{"op" or "op/variant": (max_rel_err, why)}``,
        for precision a backend knowingly gives up (e.g. a lossy scale conversion).
    dist_backend: the ``torch.distributed`` backend of process groups over its devices (``nccl``, ``hccl``); None:
        torch's default for the device type.
    free_memory: ``free_memory(device) -> bytes`` free on one of its devices, which the engine sizes its cache by;
        None: not known (the engine then takes a fixed default).
    """

    name: str
    device_type: str
    probe: Callable[[], tuple[bool, str]]
    aliases: tuple[str, ...] = ()
    capabilities: frozenset[str] = frozenset()
    version: str = ""
    prepare_weight: Callable[[str, Any], Any] | None = None
    tolerances: dict[str, tuple[float, str]] = field(default_factory=dict)
    dist_backend: str | None = None
    free_memory: Callable[[Any], int] | None = None


@dataclass(frozen=True)
class Decline:
    """What an ``OpImpl.supports`` returns to decline a call and say why: falsy, so a caller that only tests the
    answer (``if impl.supports(**kwargs)``) reads it as False. ``reason`` is one short clause in the present tense
    naming the argument or condition (``"kv_format is fp8_ds_mla, expected bf16"``, ``"96 programs > 0.25 x 132
    SMs"``); ``deepinfer info --ops --shapes`` shows it beside the implementation."""

    reason: str

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True)
class TransientDecline(Decline):
    """A ``Decline`` that may turn into a yes for the same arguments later in the process (it waits on a probe that
    cannot run yet): dispatch does not remember a choice made past it (``dispatch.cached_choices``)."""


def verdict(answer: object) -> tuple[bool, str]:
    """``(accepted, reason)`` of a ``supports`` answer: a ``Decline`` gives its reason; any other falsy answer (a
    plain ``False``) declines without one."""
    if isinstance(answer, Decline):
        return False, answer.reason
    return (True, "") if answer else (False, "no reason given")


@dataclass(frozen=True)
class OpImpl:
    """One implementation of one op.

    op: the op name (a function of ``deepinfer.ops``).
    backend: the ``BackendSpec.name`` it belongs to.
    provider: what computes it (``triton``, ``cublas``, ``torch_npu``, ``torch``...), shown by ``deepinfer info
        --ops``; (backend, op, provider) must be unique.
    fn: called with the op's validated arguments, as keywords.
    supports: called with the same keywords; returns a true value where ``fn`` serves them, and a falsy one where
        it does not: the next implementation, or the reference, is then used. Returning ``Decline(reason)``
        instead of ``False`` says why (``deepinfer info --ops --shapes`` lists it); a plain ``False`` still works.
        ``None`` means it supports everything valid. A backend may register several kernels of one op as separate
        implementations, each declining where an earlier one should run or where it cannot: the first that accepts
        is the kernel that runs. Its answer may depend on the arguments' metadata (dtypes, shapes, strides, devices,
        pointer alignment up to 64 bytes), on Python values and on the process's settings, never on tensor values or
        a tensor's full address: dispatch remembers it per call signature during an engine step
        (``dispatch.cached_choices``).
    batch_invariant: for a given row, ``fn`` returns bitwise the same result whatever else is in the batch and
        on every run. Only such implementations are used under ``DEEPINFER_BATCH_INVARIANT=1``.
    priority: higher is tried first among one backend's implementations of an op.
    """

    op: str
    backend: str
    provider: str
    fn: Callable[..., Any]
    supports: Callable[..., bool | Decline] | None = None
    batch_invariant: bool = False
    priority: int = 0
