"""Conformance cases for ``silu_and_mul``."""

from __future__ import annotations

import torch

from .cases import BadInput, Case, Gen, rows_of, run_masked, take_masked_rows, take_rows


def _case(
    shape: tuple[int, ...], quantize: bool, scale_format: str = "fp32", limit: float | None = None, scale: float = 2.0
) -> Case:
    """With ``limit``, ``scale`` puts a good share of the gate and up values beyond it (and below ``-limit``), so an
    implementation that ignores the clamp fails."""

    def make(g: Gen):
        kw = {"x": g.randn(*shape, scale=scale), "quantize": quantize, "scale_format": scale_format}
        return kw if limit is None else {**kw, "limit": limit}

    name = f"x{list(shape)}" + (f" fp8 {scale_format}" if quantize else "") + (f" limit={limit}" if limit else "")
    return Case(
        "silu_and_mul",
        name,
        "fp8" if quantize else "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x",), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["x"].shape[0],
    )


def _masked_case(experts: int, most: int, inter: int, quantize: bool, limit: float | None = None) -> Case:
    """The masked expert layout with ``masked_m``: rows past each expert's count are unspecified (zeroed before the
    comparison); an empty expert and a full one."""

    def make(g: Gen):
        counts = g.ints(0, most + 1, experts)
        counts[0], counts[-1] = 0, most
        kw = {
            "x": g.randn(experts, most, 2 * inter, scale=2.0),
            "quantize": quantize,
            "scale_format": "fp32",
            "masked_m": torch.tensor(counts, dtype=torch.int32, device=g.device),
        }
        return kw if limit is None else {**kw, "limit": limit}

    return Case(
        "silu_and_mul",
        f"masked E={experts} rows<={most} I={inter}"
        + (" fp8" if quantize else "")
        + (f" limit={limit}" if limit else ""),
        "fp8" if quantize else "default",
        make,
        run=run_masked,
        sub_batch=lambda kw, rows: take_masked_rows(kw, "x", rows),
        batch=lambda kw: kw["x"].shape[1],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _case((1, 256), False),
            _case((13, 512), False),
            _case((13, 512), True),
            _case((6, 256), True, "ue8m0"),
            _case((3, 4, 256), False),
            _case((3, 4, 256), True),
            _case((0, 256), True),
            _case((3, 0), False),
            _masked_case(3, 0, 128, True),
            _masked_case(4, 6, 256, True),
            _masked_case(3, 5, 200, False),
            # Clipped SwiGLU (DeepSeek-V4): about half the values lie beyond +-limit.
            _case((13, 512), False, limit=1.5),
            _case((1, 256), False, limit=0.75),
            _case((9, 512), True, limit=1.5),
            _case((7, 4096), False, limit=10.0, scale=12.0),  # V4's swiglu_limit and hidden size
            _masked_case(4, 6, 256, True, limit=1.5),
            _masked_case(3, 5, 200, False, limit=1.0),
        ]
    return [_case((t, 4096), q) for t in (1, 128, 8192) for q in (False, True)] + [
        _case((32, 256, 4096), True, "ue8m0"),
        _case((8192, 36864), False),
        _masked_case(256, 64, 2048, True),
        *(_case((t, 4096), q, limit=10.0, scale=12.0) for t in (1, 4096) for q in (False, True)),
        _masked_case(256, 64, 2048, True, limit=10.0),
    ]


def bad_inputs() -> list[BadInput]:
    return [
        BadInput("silu_and_mul", "odd last dim", "x", lambda g: {"x": g.randn(4, 255)}),
        BadInput(
            "silu_and_mul",
            "FP8 output with I not a multiple of 128",
            "x",
            lambda g: {"x": g.randn(4, 200), "quantize": True},
        ),
        BadInput("silu_and_mul", "1-D input", "x", lambda g: {"x": g.randn(256)}),
        BadInput(
            "silu_and_mul",
            "masked_m with a 2-D x",
            "masked_m",
            lambda g: {"x": g.randn(4, 256), "masked_m": torch.zeros(4, dtype=torch.int32, device=g.device)},
        ),
        BadInput(
            "silu_and_mul",
            "masked_m of the wrong length",
            "masked_m",
            lambda g: {"x": g.randn(3, 4, 256), "masked_m": torch.zeros(2, dtype=torch.int32, device=g.device)},
        ),
        BadInput(
            "silu_and_mul",
            "masked_m past max_m",
            "masked_m",
            lambda g: {"x": g.randn(2, 4, 256), "masked_m": torch.full((2,), 5, dtype=torch.int32, device=g.device)},
        ),
        *(
            BadInput(
                "silu_and_mul",
                f"limit {limit!r}",
                "limit",
                lambda g, limit=limit: {"x": g.randn(4, 256), "limit": limit},
            )
            for limit in (0.0, -1.0, float("nan"), float("inf"), "10", True)
        ),
    ]
