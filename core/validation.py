"""Input validation shared by every backend: each op checks its arguments here before dispatch."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Iterator, Sequence

import torch

from .errors import InputError
from .qtensor import FP4_DATA_DTYPE, FP4_GROUP, FP8_DTYPE, SCALE_FORMATS, UE8M0_DTYPE, FP4Tensor, QTensor, scale_shape

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_name(dtypes) -> str:
    """``torch.bfloat16``, or ``torch.bfloat16 or torch.float32``: dtypes as torch prints them, in every message."""
    return " or ".join(str(d) for d in dtypes)


def _range(low: float | None, high: float | None) -> str:
    """The values a number may take, in words: ``in [low, high]``, ``>= low`` or ``<= high``."""
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def _shape(t: torch.Tensor) -> str:
    return str(list(t.shape))


_checks_off: list[bool] = []


def value_checks_enabled(*tensors: torch.Tensor) -> bool:
    """Whether checks that read index values (and so synchronise with the device) run.

    On by default. ``DEEPINFER_VALUE_CHECKS=0`` turns them off, and so does ``value_checks(False)`` inside its block.
    They are skipped while a CUDA graph is being captured (reading values there is impossible).
    """
    if os.environ.get("DEEPINFER_VALUE_CHECKS", "1") == "0" or (_checks_off and _checks_off[-1]):
        return False
    return not (any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def value_checks(enabled: bool = True) -> Iterator[None]:
    """Inside the block, the checks that read index values run (``enabled``, unless ``DEEPINFER_VALUE_CHECKS=0``) or
    not. For callers that build the index tensors themselves, such as an engine's page tables: each check waits for
    the device, so an eager caller that keeps them loses the overlap of its host and device work."""
    _checks_off.append(not enabled)
    try:
        yield
    finally:
        _checks_off.pop()


class Check:
    """Validation helpers bound to one op name, so every message names the op and the argument."""

    def __init__(self, op: str):
        self.op = op

    def fail(self, arg: str, expected: str, actual: str) -> InputError:
        return InputError(self.op, arg, expected, actual)

    def tensor(
        self,
        arg: str,
        t,
        *,
        dtypes: Sequence[torch.dtype] | None = None,
        ndim: int | Sequence[int] | None = None,
        shape: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """Checks type, dtype, rank and shape (``None`` in ``shape`` matches any size)."""
        if not isinstance(t, torch.Tensor):
            raise self.fail(arg, "a torch.Tensor", type(t).__name__)
        if dtypes is not None and t.dtype not in dtypes:
            raise self.fail(arg, f"dtype {_dtype_name(dtypes)}", f"dtype {_dtype_name([t.dtype])}")
        if shape is not None:
            ndim = len(shape)
        if ndim is not None:
            allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
            if t.dim() not in allowed:
                dims = " or ".join(str(d) for d in allowed)
                raise self.fail(arg, f"a {dims}-D tensor", f"shape {_shape(t)}")
        if shape is not None and any(e is not None and e != s for e, s in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise self.fail(arg, f"shape {want}", f"shape {_shape(t)}")
        return t

    def qtensor(self, arg: str, q, *, block: tuple[int, int], ndim: int) -> QTensor:
        """An FP8 ``QTensor`` with the given block and rank, its scales in the logical shape."""
        if not isinstance(q, QTensor):
            raise self.fail(arg, "an FP8 QTensor", type(q).__name__)
        self.tensor(f"{arg}.data", q.data, dtypes=(FP8_DTYPE,), ndim=ndim)
        if not isinstance(q.block, (tuple, list)) or tuple(q.block) != tuple(block):
            raise self.fail(f"{arg}.block", f"{tuple(block)}", repr(q.block))
        self.tensor(f"{arg}.scale", q.scale, dtypes=(torch.float32,), shape=scale_shape(q.data.shape, block))
        self.choice(f"{arg}.scale_format", q.scale_format, SCALE_FORMATS)
        self.same_device(**{f"{arg}.data": q.data, f"{arg}.scale": q.scale})
        return q

    def fp4tensor(self, arg: str, q, *, ndim: int) -> FP4Tensor:
        """An ``FP4Tensor`` of the given rank: int8 data ``[..., N, K/2]`` with ``K % 32 == 0``, ue8m0 scales
        ``[..., N, K/32]`` on the data's device."""
        if not isinstance(q, FP4Tensor):
            raise self.fail(arg, "an FP4Tensor", type(q).__name__)
        self.tensor(f"{arg}.data", q.data, dtypes=(FP4_DATA_DTYPE,), ndim=ndim)
        k = q.shape[-1]
        if k % FP4_GROUP:
            raise self.fail(arg, f"K (twice data's last dim) a multiple of {FP4_GROUP}", f"K = {k}")
        want = (*q.data.shape[:-1], k // FP4_GROUP)
        self.tensor(f"{arg}.scale", q.scale, dtypes=(UE8M0_DTYPE,), shape=want)
        self.same_device(**{f"{arg}.data": q.data, f"{arg}.scale": q.scale})
        return q

    def index(self, arg: str, t, *, ndim: int = 1, dtype: torch.dtype = torch.int32, length: int | None = None):
        """An index tensor: integer dtype as the contract says (int32 unless stated), given rank and length."""
        self.tensor(arg, t, dtypes=(dtype,), ndim=ndim)
        if length is not None and t.shape[0] != length:
            raise self.fail(arg, f"{length} entries along dim 0", f"shape {_shape(t)}")
        return t

    def same_device(self, **tensors: torch.Tensor | None) -> None:
        items = [(k, v) for k, v in tensors.items() if v is not None]
        first_name, first = items[0]
        for name, t in items[1:]:
            if t.device != first.device:
                raise self.fail(name, f"a tensor on {first.device} (the device of '{first_name}')", str(t.device))

    def choice(self, arg: str, value, allowed: Sequence) -> None:
        if value not in allowed:
            raise self.fail(arg, f"one of {list(allowed)}", repr(value))

    def positive_int(self, arg: str, value, *, minimum: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(arg, f"an int >= {minimum}", repr(value))

    def number(
        self, arg: str, value, *, low: float | None = None, high: float | None = None, finite: bool = False
    ) -> None:
        """An int or float (never NaN) in ``[low, high]``; with ``finite``, never infinite either (an epsilon or a
        scale of infinity would make every result zero or infinite)."""
        what = "a finite number" if finite else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(arg, what, repr(value))
        bad = value != value or (finite and value in (math.inf, -math.inf))  # NaN, or infinity where finite
        if bad or (low is not None and value < low) or (high is not None and value > high):
            raise self.fail(arg, what + ("" if low is None and high is None else f" {_range(low, high)}"), repr(value))

    def positive_number(self, arg: str, value) -> None:
        """A finite number > 0 (a scale: zero, infinity or NaN would make every result meaningless)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise self.fail(arg, "a finite number > 0", repr(value))

    def values_in_range(self, arg: str, t: torch.Tensor, low: int, high: int, *, what: str = "values") -> None:
        """All entries in [low, high] (a value check: call only where ``value_checks_enabled``)."""
        if t.numel() == 0:
            return
        lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one host synchronisation
        self.bounds_in_range(arg, lo, hi, low, high, what=what)

    def bounds_in_range(self, arg: str, lo: int, hi: int, low: int, high: int, *, what: str = "values") -> None:
        """The smallest and largest entry, already read on the host, in [low, high]."""
        if lo < low or hi > high:
            raise self.fail(arg, f"{what} in [{low}, {high}]", f"values in [{lo}, {hi}]")

    def nondecreasing_offsets(self, arg: str, t: torch.Tensor, total: int) -> None:
        """offsets[0] == 0, nondecreasing, offsets[-1] == total (a value check)."""
        values = t.tolist()  # one copy to the host (E + 1 ints), no kernel launches
        if values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
            raise self.fail(arg, f"nondecreasing offsets from 0 to {total}", f"{values if len(values) <= 16 else t}")
