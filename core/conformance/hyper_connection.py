"""Conformance cases for ``hc_pre``, ``hc_post``, ``hc_head`` (DeepSeek-V4's hyper-connections).

Parameters are drawn so that every part matters: the projection's outputs are of order one (``fn`` scaled by
``1 / sqrt(N * D)`` over RMS-normalised streams), scales and biases spread the sigmoids and the softmax, and comb
is far from symmetric, so a transposed comb fails ``hc_post``.
"""

from __future__ import annotations

import torch

from .cases import BadInput, Case, Gen, rows_of, take_rows


def _params(g: Gen, n: int, d: int, mixes: int, scales: int) -> dict:
    return {
        "fn": g.randn(mixes, n * d, dtype=torch.float32, scale=(n * d) ** -0.5),
        "base": g.randn(mixes, dtype=torch.float32, scale=0.5),
        "scale": g.uniform(scales, low=0.5, high=2.0),
    }


def _streams(g: Gen, tokens: int, n: int, d: int, dtype) -> torch.Tensor:
    return g.randn(tokens, n, d, dtype=dtype, scale=1.5)


def _variant(dtype) -> str:
    return "fp32" if dtype == torch.float32 else "default"


def _rows(names: tuple[str, ...]):
    return lambda kw, rows: (take_rows(kw, names, rows), lambda o: rows_of(o, rows))


def _pre_case(tokens: int, n: int, d: int, iters: int = 20, dtype=torch.bfloat16) -> Case:
    def make(g: Gen):
        return {
            "streams": _streams(g, tokens, n, d, dtype),
            **_params(g, n, d, (2 + n) * n, 3),
            "sinkhorn_iters": iters,
            "eps": 1e-6,
            "norm_eps": 1e-6,
        }

    return Case(
        "hc_pre",
        f"T={tokens} N={n} D={d} iters={iters} {str(dtype)[6:]}",
        _variant(dtype),
        make,
        sub_batch=_rows(("streams",)),
        batch=lambda kw: kw["streams"].shape[0],
    )


def _comb(g: Gen, tokens: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """post in (0, 2) and a comb of positive entries, far from symmetric, as hc_pre gives them."""
    post = 2 * torch.sigmoid(g.randn(tokens, n, dtype=torch.float32))
    comb = torch.softmax(g.randn(tokens, n, n, dtype=torch.float32, scale=2.0), dim=-1)
    return post, comb


def _post_case(tokens: int, n: int, d: int, dtype=torch.bfloat16) -> Case:
    def make(g: Gen):
        post, comb = _comb(g, tokens, n)
        return {
            "block_out": g.randn(tokens, d, dtype=dtype),
            "streams": _streams(g, tokens, n, d, dtype),
            "post": post,
            "comb": comb,
        }

    return Case(
        "hc_post",
        f"T={tokens} N={n} D={d} {str(dtype)[6:]}",
        _variant(dtype),
        make,
        sub_batch=_rows(("block_out", "streams", "post", "comb")),
        batch=lambda kw: kw["streams"].shape[0],
    )


def _head_case(tokens: int, n: int, d: int, dtype=torch.bfloat16) -> Case:
    def make(g: Gen):
        return {"streams": _streams(g, tokens, n, d, dtype), **_params(g, n, d, n, 1), "eps": 1e-6, "norm_eps": 1e-6}

    return Case(
        "hc_head",
        f"T={tokens} N={n} D={d} {str(dtype)[6:]}",
        _variant(dtype),
        make,
        sub_batch=_rows(("streams",)),
        batch=lambda kw: kw["streams"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _pre_case(5, 4, 64),
            _pre_case(1, 2, 96, iters=1),
            _pre_case(7, 3, 40, iters=3, dtype=torch.float32),
            _pre_case(0, 4, 64),
            _pre_case(2, 4, 4096),  # V4-Flash: N=4, D=4096, 20 iterations
            _post_case(5, 4, 64),
            _post_case(7, 3, 40, dtype=torch.float32),
            _post_case(0, 4, 64),
            _post_case(3, 4, 4096),
            _head_case(5, 4, 64),
            _head_case(6, 3, 40, dtype=torch.float32),
            _head_case(2, 4, 4096),
        ]
    return [
        *(_pre_case(t, 4, 4096) for t in (1, 128, 4096)),
        *(_post_case(t, 4, 4096) for t in (1, 128, 4096)),
        *(_head_case(t, 4, 4096) for t in (1, 128)),
    ]


def bad_inputs() -> list[BadInput]:
    def pre(g: Gen, **over):
        kw = {"streams": g.randn(3, 4, 8), **_params(g, 4, 8, 24, 3), "sinkhorn_iters": 2}
        return {**kw, **over}

    def post(g: Gen, **over):
        p, c = _comb(g, 3, 4)
        return {**{"block_out": g.randn(3, 8), "streams": g.randn(3, 4, 8), "post": p, "comb": c}, **over}

    def head(g: Gen, **over):
        return {**{"streams": g.randn(3, 4, 8), **_params(g, 4, 8, 4, 1)}, **over}

    return [
        BadInput("hc_pre", "2-D streams", "streams", lambda g: pre(g, streams=g.randn(3, 32))),
        BadInput("hc_pre", "int streams", "streams", lambda g: pre(g, streams=torch.ones(3, 4, 8, dtype=torch.int32))),
        BadInput("hc_pre", "fn of the wrong shape", "fn", lambda g: pre(g, fn=g.randn(24, 31, dtype=torch.float32))),
        BadInput("hc_pre", "bf16 fn", "fn", lambda g: pre(g, fn=g.randn(24, 32))),
        BadInput("hc_pre", "base of the wrong length", "base", lambda g: pre(g, base=g.randn(20, dtype=torch.float32))),
        BadInput("hc_pre", "scale of two", "scale", lambda g: pre(g, scale=g.uniform(2))),
        BadInput("hc_pre", "no Sinkhorn iteration", "sinkhorn_iters", lambda g: pre(g, sinkhorn_iters=0)),
        BadInput("hc_pre", "negative eps", "eps", lambda g: pre(g, eps=-1e-6)),
        BadInput("hc_pre", "zero norm_eps", "norm_eps", lambda g: pre(g, norm_eps=0.0)),
        BadInput("hc_post", "block_out of another D", "block_out", lambda g: post(g, block_out=g.randn(3, 9))),
        BadInput(
            "hc_post", "block_out of another dtype", "block_out", lambda g: post(g, block_out=g.randn(3, 8).float())
        ),
        BadInput("hc_post", "post of the wrong shape", "post", lambda g: post(g, post=g.uniform(3, 3))),
        BadInput("hc_post", "bf16 comb", "comb", lambda g: post(g, comb=g.randn(3, 4, 4))),
        BadInput("hc_post", "comb of the wrong shape", "comb", lambda g: post(g, comb=g.uniform(3, 4, 3))),
        BadInput("hc_head", "fn of the wrong shape", "fn", lambda g: head(g, fn=g.randn(24, 32, dtype=torch.float32))),
        BadInput("hc_head", "scale of three", "scale", lambda g: head(g, scale=g.uniform(3))),
        BadInput("hc_head", "NaN eps", "eps", lambda g: head(g, eps=float("nan"))),
    ]
