"""Runs the conformance cases against one backend and collects a report."""

from __future__ import annotations

import datetime
import json
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import dispatch, ops, registry
from ..errors import FallbackWarning, InputError
from ..selection import require, use
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
from .cases import BadInput, Case, Gen, bitwise_equal, error, strided
from .tolerances import tolerance

FAMILIES = (
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
SHAPE_GRIDS = ("small", "full")


@dataclass
class CaseResult:
    """One check of one case. check: accuracy | strided | batch_invariance | determinism | bad_input; status: pass |
    fail | fallback (the reference ran instead of the backend) | error (the call raised)."""

    op: str
    case: str
    check: str
    status: str
    impl: str
    error: float | None = None
    tolerance: float | None = None
    detail: str = ""


@dataclass
class Report:
    backend: str
    device: str
    shapes: str
    seed: int
    date: str
    environment: dict[str, str]
    results: list[CaseResult] = field(default_factory=list)
    note: str = ""

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("fail", "error")]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def to_json(self) -> str:
        body = asdict(self)
        body["summary"] = self.counts()
        body["passed"] = not self.failed
        for r in body["results"]:
            if r["error"] is not None and r["error"] == float("inf"):
                r["error"] = "inf"
        return json.dumps(body, indent=1)


def all_cases(shapes: str) -> list[Case]:
    return [c for fam in FAMILIES for c in fam.cases(shapes)]


def all_bad_inputs() -> list[BadInput]:
    return [b for fam in FAMILIES for b in fam.bad_inputs()]


def _op(name: str) -> Callable:
    return getattr(ops, name)


def _run(case: Case, kwargs: dict[str, Any]) -> Any:
    fn = _op(case.op)
    return case.run(fn, kwargs) if case.run else fn(**kwargs)


def _served_by(op: str) -> tuple[str, bool]:
    impl, fallback = dispatch.last_resolution(op)
    return ("reference (fallback)" if fallback else f"{impl.backend}/{impl.provider}"), fallback


def _device_for(backend: str) -> str:
    return require(backend).device_type  # device types are torch device names


def _environment(device: str) -> dict[str, str]:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["compute_capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    for var in ("DEEPINFER_ACCELERATOR", "TRITON_INTERPRET", "DEEPINFER_PLUGINS"):
        if os.environ.get(var):
            env[var] = os.environ[var]
    return env


def _accuracy_of(case: Case, kwargs: dict, out: Any, ref: Any, overrides: dict, note: str = "") -> CaseResult:
    """The accuracy result of ``out`` (just computed by the backend) against the reference's ``ref``."""
    tol, why = tolerance(case.op, case.variant, overrides)
    impl, fallback = _served_by(case.op)
    err = (case.compare or (lambda o, r, kw: error(o, r)))(out, ref, kwargs)
    status = "fallback" if fallback else ("pass" if err <= tol else "fail")
    detail = "; ".join(d for d in (note, "" if why == "default" else why) if d)
    return CaseResult(case.op, case.name, "accuracy", status, impl, err, tol, detail)


LAYOUTS = {True: "every stride doubled", False: "rows of twice their width"}


def _strided(case: Case, kwargs: dict, backend: str, ref: Any, contiguous: Any, overrides: dict) -> CaseResult:
    """The accuracy of the case with every tensor argument replaced by a non-contiguous view of the same values
    (``cases.strided``), except those the op's contract requires contiguous (its ``InputError`` says which). Where
    the backend leaves views with a strided last dim to the reference, views whose rows are unit-stride follow. A
    ``reproducible`` case must also give the bits of the backend's run on contiguous inputs (``contiguous``)."""
    for inner, layout in LAYOUTS.items():
        views = {k: strided(v, inner=inner) for k, v in kwargs.items()}
        kept = []
        try:
            with use(backend):
                while True:
                    try:
                        out = _run(case, views)
                        break
                    except InputError as e:
                        name = e.arg.split(".")[0]
                        if views.get(name) is kwargs.get(name):
                            raise  # not about a view: the case itself is invalid
                        views[name] = kwargs[name]
                        kept.append(name)
            result = _accuracy_of(case, views, out, ref, overrides, note=f"non-contiguous inputs: {layout}")
        except Exception as e:
            detail = f"non-contiguous inputs: {layout}; {type(e).__name__}: {e}"
            return CaseResult(case.op, case.name, "strided", "error", backend, detail=detail)
        if kept:
            result.detail += f"; contiguous as the contract requires: {', '.join(sorted(kept))}"
        result.check = "strided"
        if result.status != "fallback":
            break
    if case.reproducible and result.status == "pass" and not bitwise_equal(out, contiguous):
        result.status, result.detail = "fail", f"{result.detail}; differs from the result on contiguous inputs"
    return result


def _invariance(
    case: Case, kwargs: dict, backend: str, gen: Gen, ref: Any, default_impl: str, overrides: dict
) -> list[CaseResult]:
    """Bitwise checks for implementations declared batch-invariant: sub-batches and a repeated run; and the
    accuracy of the batch-invariant implementation where it is not the one the default mode runs."""
    if not any(i.batch_invariant for i in registry.get().impls_for(backend, case.op)):
        return []  # nothing declared, nothing to check
    results = []
    with use(backend), dispatch.batch_invariant(True):
        full = _run(case, kwargs)
        impl, fallback = _served_by(case.op)
        if fallback:
            return [
                CaseResult(
                    case.op, case.name, "batch_invariance", "fallback", impl, detail="no batch-invariant implementation"
                )
            ]
        if impl != default_impl:
            results.append(_accuracy_of(case, kwargs, full, ref, overrides, note="batch-invariant mode"))
        again = _run(case, kwargs)
        same = bitwise_equal(full, again)
        results.append(
            CaseResult(
                case.op,
                case.name,
                "determinism",
                "pass" if same else "fail",
                impl,
                detail="" if same else "two runs on the same input differ",
            )
        )
        if case.sub_batch is None:
            return results
        size = case.batch(kwargs)
        # Up to four rows, each alone (a batch of one takes whatever small-batch path a kernel has), then a random
        # half. One row of a batch of one proves nothing.
        row_sets = [[r] for r in sorted(gen.perm(size)[:4].tolist())] if size >= 2 else []
        if size >= 3:
            row_sets.append(sorted(gen.perm(size)[: size // 2].tolist()))
        if not row_sets:
            return results
        for rows in row_sets:
            sub_kwargs, select = case.sub_batch(kwargs, rows)
            alone = _run(case, sub_kwargs)
            if not bitwise_equal(alone, select(full)):
                label = f"row {rows[0]} alone" if len(rows) == 1 else f"{len(rows)} of {size} rows"
                results.append(
                    CaseResult(
                        case.op,
                        case.name,
                        "batch_invariance",
                        "fail",
                        impl,
                        detail=f"{label} differs from the same rows inside the batch",
                    )
                )
                return results
        results.append(
            CaseResult(
                case.op,
                case.name,
                "batch_invariance",
                "pass",
                impl,
                detail=f"{len(row_sets)} sub-batches bitwise equal",
            )
        )
    return results


def run_conformance(
    backend: str,
    *,
    shapes: str = "small",
    device: str | None = None,
    only_ops: list[str] | None = None,
    seed: int | None = None,
    on_result: Callable[[CaseResult], None] | None = None,
) -> Report:
    """Checks ``backend`` against the reference on fresh random inputs: accuracy per case, batch invariance,
    determinism and accuracy for implementations declared invariant, and the documented error for each bad input.

    device: where inputs are made (default: the backend's device type); e.g. ``cpu`` for kernels run through an
    interpreter or a test double."""
    if shapes not in SHAPE_GRIDS:
        raise ValueError(f"shapes must be one of {SHAPE_GRIDS}, got {shapes!r}")
    with use(backend) as spec:
        backend = spec.name
    device = device or _device_for(backend)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    report = Report(backend, device, shapes, seed, datetime.date.today().isoformat(), _environment(device))

    def add(result: CaseResult) -> None:
        report.results.append(result)
        if on_result:
            on_result(result)

    cases = [c for c in all_cases(shapes) if only_ops is None or c.op in only_ops]
    bad = [b for b in all_bad_inputs() if only_ops is None or b.op in only_ops]
    for i, case in enumerate(cases):
        for result in check_case(case, backend, seed + i, device):
            add(result)
    for j, b in enumerate(bad):
        add(check_bad_input(b, backend, seed + len(cases) + j, device))
    return report


def check_case(case: Case, backend: str, seed: int, device: str | None = None) -> list[CaseResult]:
    """Accuracy, the same on non-contiguous inputs, then (where declared) determinism and batch invariance, of one
    case on ``backend``."""
    spec = require(backend)
    backend, device = spec.name, device or spec.device_type  # an alias must reach the same implementations
    overrides = spec.tolerances
    gen = Gen(seed, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        try:
            kwargs = case.make(gen)
            with use("reference"):
                ref = _run(case, kwargs)
            with use(backend):
                out = _run(case, kwargs)
                accuracy = _accuracy_of(case, kwargs, out, ref, overrides)
            if accuracy.status == "fallback":
                return [accuracy]
            strided_accuracy = _strided(case, kwargs, backend, ref, out, overrides)
            return [accuracy, strided_accuracy, *_invariance(case, kwargs, backend, gen, ref, accuracy.impl, overrides)]
        except Exception as e:  # a crashing backend is a failed case, not a crashed suite
            return [CaseResult(case.op, case.name, "accuracy", "error", backend, detail=f"{type(e).__name__}: {e}")]


def check_bad_input(bad: BadInput, backend: str, seed: int, device: str | None = None) -> CaseResult:
    """Whether ``bad`` raises the documented ``InputError`` on ``backend``."""
    with use(backend):
        try:
            _op(bad.op)(**bad.make(Gen(seed, device or _device_for(backend))))
        except InputError as e:
            ok = e.arg == bad.arg or e.arg.startswith(bad.arg + ".")
            return CaseResult(
                bad.op,
                bad.name,
                "bad_input",
                "pass" if ok else "fail",
                backend,
                detail=str(e) if ok else f"InputError about {e.arg!r}, expected {bad.arg!r}: {e}",
            )
        except Exception as e:
            return CaseResult(
                bad.op,
                bad.name,
                "bad_input",
                "fail",
                backend,
                detail=f"raised {type(e).__name__}: {e}, expected InputError about {bad.arg!r}",
            )
    return CaseResult(bad.op, bad.name, "bad_input", "fail", backend, detail="accepted invalid input")
