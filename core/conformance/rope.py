"""Conformance cases for ``rope`` (with DeepSeek-V3's YaRN table)."""

from __future__ import annotations

import torch

from ..ops.rope import rope_cos_sin_cache
from .cases import BadInput, Case, Gen, rows_of, take_rows

V3_YARN = {
    "rope_type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _case(tokens: int, heads: int, dim: int, interleaved: bool, max_pos: int, yarn: bool) -> Case:
    def make(g: Gen):
        table = rope_cos_sin_cache(dim, max_pos, 10000.0, V3_YARN if yarn else None).to(g.device)
        return {
            "x": g.randn(tokens, heads, dim),
            "positions": g.randint(0, max_pos, tokens),
            "cos_sin_cache": table,
            "interleaved": interleaved,
        }

    name = f"T={tokens} H={heads} D={dim} {'interleaved' if interleaved else 'neox'} {'yarn' if yarn else 'plain'}"
    return Case(
        "rope",
        name,
        "default",
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("x", "positions"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["x"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _case(7, 4, 64, True, 4096, True),
            _case(5, 1, 64, True, 100, False),
            _case(9, 3, 32, False, 500, False),
            _case(9, 20, 64, True, 4096, False),  # a second, partial block of heads
            _case(0, 4, 64, True, 64, False),
            _case(3, 0, 64, True, 64, False),
        ]
    return [_case(t, h, 64, True, 163840, True) for t in (1, 4096) for h in (128, 1)]


def bad_inputs() -> list[BadInput]:
    def kw(g: Gen, **over):
        base = {
            "x": g.randn(3, 2, 16),
            "positions": g.randint(0, 10, 3),
            "cos_sin_cache": rope_cos_sin_cache(16, 10).to(g.device),
            "interleaved": True,
        }
        return {**base, **over}

    return [
        BadInput(
            "rope",
            "position past the table",
            "positions",
            lambda g: kw(g, positions=torch.tensor([0, 10, 1], dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "rope", "int64 positions", "positions", lambda g: kw(g, positions=torch.tensor([0, 1, 2], device=g.device))
        ),
        BadInput(
            "rope",
            "table of another width",
            "cos_sin_cache",
            lambda g: kw(g, cos_sin_cache=rope_cos_sin_cache(8, 10).to(g.device)),
        ),
        BadInput("rope", "odd rotary dim", "x", lambda g: kw(g, x=g.randn(3, 2, 15))),
    ]
