"""The records conformance cases are made of, and the comparisons they use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from ..ops.moe import DispatchHandle
from ..qtensor import FP4Tensor, QTensor


class Gen:
    """Fresh random inputs on one device, from one seeded generator."""

    def __init__(self, seed: int, device: str):
        self.device = device
        self.cpu = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.cpu) * scale).to(dtype=dtype, device=self.device)

    def uniform(self, *shape: int, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        return (torch.rand(*shape, generator=self.cpu) * (high - low) + low).to(self.device)

    def randint(self, low: int, high: int, *shape: int, dtype=torch.int32) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.cpu).to(dtype=dtype, device=self.device)

    def fp8_weight(self, *shape: int, block: int = 128) -> QTensor:
        """A random FP8 block-scaled weight ``[..., N, K]`` drawn on the device (finite e4m3 bytes of either sign,
        scales around ``1 / (448 sqrt(K))``): for sizes too large to draw on the CPU and quantise."""
        dev = torch.Generator(device=self.device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=self.cpu)))
        bits = torch.randint(0, 0x7F, shape, generator=dev, device=self.device, dtype=torch.uint8)  # 0x7F: NaN
        bits |= torch.randint(0, 2, shape, generator=dev, device=self.device, dtype=torch.uint8) << 7
        *lead, n, k = shape
        scale_shape = (*lead, -(-n // block), -(-k // block))
        scale = torch.rand(scale_shape, generator=dev, device=self.device) * 2 / (448 * k**0.5)
        return QTensor(bits.view(torch.float8_e4m3fn), scale + 1e-6, (block, block), "fp32")

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.cpu)

    def ints(self, low: int, high: int, n: int) -> list[int]:
        return torch.randint(low, high, (n,), generator=self.cpu).tolist()


@dataclass(frozen=True)
class Case:
    """One conformance case of one op.

    make: draws the op's keyword arguments. run: calls an op (the public function, under the backend being
        tested or under the reference) and returns what is compared; default ``op(**kwargs)``.
    compare: ``(out, ref, kwargs) -> error`` (default: worst row-relative error, exact for integer outputs).
    variant: the tolerance key is ``op/variant``.
    sub_batch: for the batch-invariance check, ``(kwargs, rows) -> (kwargs of those rows alone, select)`` where
        ``select(full_out)`` picks the same rows' results from a whole-batch output; None if not applicable.
    batch: the number of rows ``sub_batch`` chooses from.
    reproducible: the contract fixes a backend's output for given input values (``sample``: a seed fixes its draw),
        so the same values in non-contiguous tensors must give the same bits, not only an accurate result.
    """

    op: str
    name: str
    variant: str
    make: Callable[[Gen], dict[str, Any]]
    run: Callable[[Callable, dict[str, Any]], Any] | None = None
    compare: Callable[[Any, Any, dict[str, Any]], float] | None = None
    sub_batch: Callable[[dict[str, Any], list[int]], tuple[dict[str, Any], Callable[[Any], Any]]] | None = None
    batch: Callable[[dict[str, Any]], int] | None = None
    reproducible: bool = False


@dataclass(frozen=True)
class BadInput:
    """An invalid call: ``make`` returns keyword arguments that must raise ``InputError`` about ``arg``."""

    op: str
    name: str
    arg: str
    make: Callable[[Gen], dict[str, Any]]


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.numel() == 0:
        return 0.0
    o = out.detach().double().reshape(-1, out.shape[-1]) if out.dim() else out.double().reshape(1, 1)
    r = ref.detach().double().reshape(-1, ref.shape[-1]) if ref.dim() else ref.double().reshape(1, 1)
    ref_finite = torch.isfinite(r)
    if not torch.equal(torch.isfinite(o), ref_finite) or not torch.equal(o[~ref_finite], r[~ref_finite]):
        return float("inf")  # NaN or inf where the reference has none (or the other way round)
    o, r = torch.where(ref_finite, o, 0.0), torch.where(ref_finite, r, 0.0)
    ref_norm = r.norm(dim=-1)
    floor = max(float(ref_norm.max()) * 1e-6, 1e-30)
    return float(((o - r).norm(dim=-1) / ref_norm.clamp_min(floor)).max())


def error(out: Any, ref: Any) -> float:
    """Worst-row relative error ``|out - ref| / |ref|`` over float tensors (dequantised for ``QTensor``); integer
    and bool tensors must be equal (else inf); shapes must agree (else inf). Recurses into tuples and records."""
    if isinstance(out, QTensor) or isinstance(ref, QTensor):
        if not (isinstance(out, QTensor) and isinstance(ref, QTensor)):
            return float("inf")
        return error(out.dequantize(), ref.dequantize())
    if isinstance(out, torch.Tensor):
        if not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
            return float("inf")
        if out.is_floating_point():
            return _row_errors(out, ref)
        return 0.0 if torch.equal(out.cpu(), ref.cpu()) else float("inf")
    if isinstance(out, (tuple, list)):
        if not isinstance(ref, (tuple, list)) or len(out) != len(ref):
            return float("inf")
        return max((error(o, r) for o, r in zip(out, ref)), default=0.0)
    if isinstance(out, DispatchHandle):
        return 0.0  # opaque: checked through ep_combine
    if is_dataclass(out):
        return error([getattr(out, f.name) for f in fields(out)], [getattr(ref, f.name) for f in fields(ref)])
    if out is None and ref is None:
        return 0.0
    return 0.0 if out == ref else float("inf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).clone()


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same shapes and the same bits (NaN-safe), recursively."""
    if isinstance(a, QTensor):
        return isinstance(b, QTensor) and bitwise_equal((a.data, a.scale), (b.data, b.scale))
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(bitwise_equal, a, b))
    if isinstance(a, DispatchHandle):
        return True
    if is_dataclass(a):
        return bitwise_equal([getattr(a, f.name) for f in fields(a)], [getattr(b, f.name) for f in fields(b)])
    return a == b


def strided(t: Any, *, inner: bool = True) -> Any:
    """A non-contiguous view holding the values of ``t`` (a tensor, ``QTensor`` or ``FP4Tensor``; anything else is
    returned as is).

    inner: every other element along the last dim of a tensor twice as wide, so that no stride is what a contiguous
    tensor of that shape would have. Else (a layout that kernels needing unit-stride rows still take) the first half
    of each row of a tensor twice as wide; a 1-D tensor has no rows and is strided as with ``inner``. The elements
    in between repeat the values: an implementation that reads the view as contiguous sees values that are valid
    (slots, offsets and lengths in range) but wrong."""
    if isinstance(t, QTensor):
        return QTensor(strided(t.data, inner=inner), strided(t.scale, inner=inner), t.block, t.scale_format)
    if isinstance(t, FP4Tensor):
        return FP4Tensor(strided(t.data, inner=inner), strided(t.scale, inner=inner))
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.numel() < 2:
        return t  # nothing that reads it can go wrong
    n = t.shape[-1]
    wide = torch.empty(*t.shape[:-1], 2 * n, dtype=t.dtype, device=t.device)
    if inner or t.dim() == 1:
        wide[..., ::2] = t
        wide[..., 1::2] = t
        return wide[..., ::2]
    wide[..., :n] = t
    wide[..., n:] = t
    return wide[..., :n]


def rows_of(out: Any, rows: list[int]) -> Any:
    """Selects ``rows`` along dim 0 of every tensor in ``out``."""
    index = torch.tensor(rows, dtype=torch.long)
    if isinstance(out, QTensor):
        return QTensor(
            out.data[index.to(out.data.device)], out.scale[index.to(out.data.device)], out.block, out.scale_format
        )
    if isinstance(out, torch.Tensor):
        return out[index.to(out.device)]
    if isinstance(out, (tuple, list)):
        return type(out)(rows_of(o, rows) for o in out)
    return out


def take_rows(kwargs: dict[str, Any], names: tuple[str, ...], rows: list[int]) -> dict[str, Any]:
    """``kwargs`` with the tensors named in ``names`` cut to ``rows`` along dim 0."""
    return {k: rows_of(v, rows) if k in names else v for k, v in kwargs.items()}


def _zero_masked_rows(out: Any, valid: torch.Tensor) -> Any:
    if isinstance(out, QTensor):
        return QTensor(
            _zero_masked_rows(out.data, valid), _zero_masked_rows(out.scale, valid), out.block, out.scale_format
        )
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    return torch.where(valid.to(out.device).unsqueeze(-1), out, zero)


def run_masked(op, kw: dict[str, Any]) -> Any:
    """Calls an op on the masked expert layout; rows at or past ``masked_m`` are unspecified, so they are zeroed in
    the output (data and scales alike) before it is compared."""
    out = op(**kw)
    rows = (out.data if isinstance(out, QTensor) else out).shape[1]
    valid = torch.arange(rows, device=kw["masked_m"].device)[None, :] < kw["masked_m"][:, None].long()
    return _zero_masked_rows(out, valid)


def take_masked_rows(kw: dict[str, Any], name: str, rows: list[int]):
    """``sub_batch`` of a masked-layout case: the same experts with only the chosen row positions of ``kw[name]``
    (a smaller max_m), and the matching cut of the full run's output. ``rows`` must be ascending, so that the
    positions below each expert's count stay first."""
    index = torch.tensor(rows, device=kw["masked_m"].device)

    def cut(t: Any) -> Any:  # the chosen positions along dim 1, data and scales alike
        if isinstance(t, QTensor):
            return QTensor(cut(t.data), cut(t.scale), t.block, t.scale_format)
        return t[:, index.to(t.device)]

    masked = (index[None, :] < kw["masked_m"][:, None]).sum(1).to(torch.int32)
    return {**kw, name: cut(kw[name]), "masked_m": masked}, cut
