"""Conformance cases for ``rms_norm`` and ``layer_norm``."""

from __future__ import annotations

import torch

from .cases import BadInput, Case, Gen, rows_of, take_rows


def _case(tokens: int, hidden: int, residual: bool, dtype=torch.bfloat16, gap: int = 0) -> Case:
    """``gap`` > 0: x's rows are the first ``hidden`` columns of rows ``hidden + gap`` wide (a view, as MLA's latent
    is of its projection)."""

    def make(g: Gen):
        return {
            "x": g.randn(tokens, hidden + gap, dtype=dtype, scale=3.0)[:, :hidden],
            "w": g.randn(hidden, dtype=dtype),
            "eps": 1e-6,
            "residual": g.randn(tokens, hidden, dtype=dtype) if residual else None,
        }

    name = f"T={tokens} H={hidden} {'residual' if residual else 'plain'} {str(dtype).removeprefix('torch.')}"
    name += f" rows of {hidden + gap}" if gap else ""
    return Case(
        "rms_norm",
        name,
        "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x", "residual"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["x"].shape[0],
    )


def _layer_norm_case(tokens: int, hidden: int, dtype=torch.bfloat16) -> Case:
    def make(g: Gen):
        return {
            "x": g.randn(tokens, hidden, dtype=dtype, scale=3.0) + 2.0,  # an offset the mean must remove
            "w": g.randn(hidden, dtype=dtype),
            "b": g.randn(hidden, dtype=dtype),
            "eps": 1e-6,
        }

    return Case(
        "layer_norm",
        f"T={tokens} H={hidden} {str(dtype).removeprefix('torch.')}",
        "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x",), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["x"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _case(1, 128, False),
            _case(17, 96, True),
            _case(64, 512, True),
            _case(0, 64, True),
            _case(5, 64, True, torch.float32),
            _case(7, 96, False, gap=32),
            _case(6, 64, True, gap=16),
            _case(3, 0, True),
            _layer_norm_case(9, 128),
            _layer_norm_case(3, 40, torch.float32),
            _layer_norm_case(0, 128),
            _layer_norm_case(3, 0),
        ]
    out = [_case(t, h, r) for t in (1, 128, 8192) for h in (7168, 1536, 512) for r in (False, True)]
    out += [_case(t, 512, False, gap=64) for t in (4, 8192)]  # MLA's latent: 512 of the 576 columns projected
    return out + [_layer_norm_case(t, 128) for t in (1, 64, 8192)]


def bad_inputs() -> list[BadInput]:
    return [
        BadInput(
            "rms_norm", "weight of the wrong size", "w", lambda g: {"x": g.randn(4, 64), "w": g.randn(32), "eps": 1e-6}
        ),
        BadInput(
            "rms_norm",
            "residual of another shape",
            "residual",
            lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "eps": 1e-6, "residual": g.randn(3, 64)},
        ),
        BadInput(
            "rms_norm",
            "residual of another dtype",
            "residual",
            lambda g: {
                "x": g.randn(4, 64),
                "w": g.randn(64),
                "eps": 1e-6,
                "residual": g.randn(4, 64, dtype=torch.float32),
            },
        ),
        BadInput("rms_norm", "negative eps", "eps", lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "eps": -1.0}),
        BadInput(
            "rms_norm", "infinite eps", "eps", lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "eps": float("inf")}
        ),
        BadInput(
            "layer_norm",
            "infinite eps",
            "eps",
            lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "b": g.randn(64), "eps": float("inf")},
        ),
        BadInput(
            "layer_norm",
            "bias of the wrong size",
            "b",
            lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "b": g.randn(32), "eps": 1e-6},
        ),
        BadInput(
            "layer_norm",
            "weight of another dtype family",
            "w",
            lambda g: {"x": g.randn(4, 64), "w": g.randint(0, 2, 64), "b": g.randn(64), "eps": 1e-6},
        ),
        BadInput(
            "layer_norm",
            "negative eps",
            "eps",
            lambda g: {"x": g.randn(4, 64), "w": g.randn(64), "b": g.randn(64), "eps": -1.0},
        ),
    ]
