"""Conformance cases for ``silu_and_mul``."""

from __future__ import annotations

from .cases import BadInput, Case, Gen, rows_of, take_rows


def _case(shape: tuple[int, ...], quantize: bool, scale_format: str = "fp32") -> Case:
    def make(g: Gen):
        return {"x": g.randn(*shape, scale=2.0), "quantize": quantize, "scale_format": scale_format}

    name = f"x{list(shape)}" + (f" fp8 {scale_format}" if quantize else "")
    return Case(
        "silu_and_mul",
        name,
        "fp8" if quantize else "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x",), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["x"].shape[0],
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
        ]
    return [_case((t, 4096), q) for t in (1, 128, 8192) for q in (False, True)] + [
        _case((32, 256, 4096), True, "ue8m0"),
        _case((8192, 36864), False),
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
    ]
