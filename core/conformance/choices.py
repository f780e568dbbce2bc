"""Which implementation each conformance case takes on a backend, and why the ones tried before it declined.

``case_choices`` draws each case's inputs as the conformance suite does and hands them to the op, which validates
them and reaches dispatch; there ``dispatch.explain_call`` asks each implementation's ``supports`` instead of running
a kernel. ``deepinfer info --ops --shapes small|full`` prints the result.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

from .. import dispatch, ops, registry
from ..dispatch import batch_invariant
from ..errors import FallbackWarning
from ..selection import require, use
from .cases import Case, Gen
from .runner import all_cases

MODES = {"default": False, "batch-invariant": True}


@dataclass(frozen=True)
class CaseChoice:
    """One case in one mode: ``taken`` is the provider that runs (``reference (fallback)`` where the backend has
    none that accepts); ``declined``: ``(provider, reason)`` of each implementation tried before it; ``error``: why
    the case could not be explained (its inputs could not be made, say), else empty."""

    op: str
    case: str
    mode: str
    taken: str
    declined: tuple[tuple[str, str], ...] = ()
    error: str = ""


def _run(case: Case, kwargs: dict) -> None:
    fn = getattr(ops, case.op)
    case.run(fn, kwargs) if case.run else fn(**kwargs)


def explain_case(case: Case, backend: str, device: str, seed: int = 0) -> list[CaseChoice]:
    """The choice of ``backend`` for ``case`` in the default mode and, where the backend declares batch-invariant
    implementations of the op, in batch-invariant mode."""
    modes = ["default"]
    if any(i.batch_invariant for i in registry.get().impls_for(backend, case.op)):
        modes.append("batch-invariant")
    out = []
    for mode in modes:
        try:
            kwargs = case.make(Gen(seed, device))
            with use(backend), batch_invariant(MODES[mode]), warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)
                choices = dispatch.explain_call(case.op, partial(_run, case, kwargs), backend)
        except Exception as e:  # a case whose inputs cannot be made here is reported, not fatal
            out.append(CaseChoice(case.op, case.name, mode, "", error=f"{type(e).__name__}: {e}"))
            continue
        last = choices[-1] if choices[-1].status == "fallback" else next(c for c in choices if c.status == "taken")
        taken = "reference (fallback)" if last.status == "fallback" else last.impl.provider
        declined = tuple((c.impl.provider, c.reason) for c in choices if c.status == "declined")
        out.append(CaseChoice(case.op, case.name, mode, taken, declined))
    return out


def case_choices(
    backend: str, shapes: str = "small", device: str | None = None, only_ops: list[str] | None = None
) -> list[CaseChoice]:
    """``explain_case`` for every conformance case of the ``shapes`` grid (``small`` or ``full``), inputs made on
    ``device`` (default: the backend's device type)."""
    spec = require(backend)
    device = device or spec.device_type
    cases = [c for c in all_cases(shapes) if only_ops is None or c.op in only_ops]
    return [choice for case in cases for choice in explain_case(case, spec.name, device)]
