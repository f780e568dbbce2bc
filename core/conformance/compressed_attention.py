"""Conformance cases for ``compress_kv``, ``indexer_topk_entries``, ``sparse_attention_sinks`` (DeepSeek-V4).

``compress_kv`` cases include the compressed-sparse layout (``2m`` slots, the first ``m`` of the first window empty,
gate ``-inf``) and V4-Flash's heavily compressed windows (128 slots of 512 channels). ``indexer_topk_entries`` takes
integer-valued queries, keys and weights, so every score is exact and ties (frequent: a key all of whose heads give
``relu = 0`` scores 0) must go to the lower row; the ranges are ragged, some empty. ``sparse_attention_sinks``
draws sinks of the size of the scores, so a backend that drops the sink or keeps its value share fails, and lists
with ``-1`` holes, repeated rows and empty rows.
"""

from __future__ import annotations

import torch

from .cases import BadInput, Case, Gen, rows_of, take_rows


def _variant(dtype) -> str:
    return "fp32" if dtype == torch.float32 else "default"


def _compress_case(windows: int, slots: int, dim: int, dtype=torch.bfloat16, empty_half: bool = False) -> Case:
    def make(g: Gen):
        gate = g.randn(windows, slots, dim, dtype=torch.float32, scale=2.0)
        if empty_half and windows:
            gate[0, : slots // 2] = float("-inf")  # the first compressed-sparse window has no previous half
        return {
            "kv": g.randn(windows, slots, dim, dtype=dtype),
            "gate": gate.to(dtype=dtype, device=g.device),
            "position_bias": g.randn(slots, dim, dtype=torch.float32, scale=0.5),
        }

    return Case(
        "compress_kv",
        f"W={windows} S={slots} D={dim} {str(dtype)[6:]}" + (" first half empty" if empty_half else ""),
        _variant(dtype),
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("kv", "gate"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["kv"].shape[0],
    )


def _ranges(g: Gen, tokens: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.tensor(g.ints(0, max(n, 1), tokens), dtype=torch.int32).clamp_max(n)
    count = (torch.rand(tokens, generator=g.cpu) * (n - start + 1).float()).floor().to(torch.int32)
    if tokens:
        count[0] = 0  # a query with no closed window yet
    return start.to(g.device), count.to(g.device)


def _topk_case(
    tokens: int, heads: int, dim: int, n: int, topk: int, dtype=torch.bfloat16, max_count: int | None = None
) -> Case:
    def make(g: Gen):
        start, count = _ranges(g, tokens, n)
        if max_count is not None:  # ranges of at most max_count rows
            count = count.clamp(max=max_count)
        return {
            "q": g.randint(-3, 4, tokens, heads, dim).to(dtype),
            "weights": g.randint(-2, 4, tokens, heads).float(),
            "keys": g.randint(-3, 4, n, dim).to(dtype),
            "key_start": start,
            "key_count": count,
            "topk": topk,
            "max_count": max_count,
        }

    bound = "" if max_count is None else f" max_count={max_count}"
    return Case(
        "indexer_topk_entries",
        f"T={tokens} H={heads} D={dim} N={n} topk={topk} {str(dtype)[6:]}{bound}",
        "exact",
        make,
        sub_batch=lambda kw, rows: (
            take_rows(kw, ("q", "weights", "key_start", "key_count"), rows),
            lambda o: rows_of(o, rows),
        ),
        batch=lambda kw: kw["q"].shape[0],
    )


def _indices(g: Gen, tokens: int, width: int, n: int) -> torch.Tensor:
    idx = g.randint(-1, n, tokens, width)
    if tokens > 1:
        idx[1] = -1  # a query with nothing listed
    if tokens > 2 and width > 1:
        idx[2, 1] = idx[2, 0] = max(int(idx[2, 0]), 0)  # a row listed twice
    return idx


def _attn_case(tokens: int, heads: int, dim: int, n: int, width: int, dtype=torch.bfloat16) -> Case:
    def make(g: Gen):
        return {
            "q": g.randn(tokens, heads, dim, dtype=dtype),
            "kv": g.randn(n, dim, dtype=dtype),
            "indices": _indices(g, tokens, width, n),
            "sinks": g.randn(heads, dtype=torch.float32, scale=2.0),
            "softmax_scale": dim**-0.5,
        }

    return Case(
        "sparse_attention_sinks",
        f"T={tokens} H={heads} D={dim} N={n} K={width} {str(dtype)[6:]}",
        _variant(dtype),
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("q", "indices"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["q"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _compress_case(5, 4, 64),
            _compress_case(3, 8, 40, empty_half=True),
            _compress_case(4, 6, 24, dtype=torch.float32, empty_half=True),
            _compress_case(0, 4, 64),
            _compress_case(2, 128, 512),  # V4-Flash heavily compressed windows
            _compress_case(3, 8, 512, empty_half=True),  # V4-Flash compressed sparse, m = 4
            _topk_case(9, 4, 32, 40, 8),
            _topk_case(6, 3, 16, 12, 20, dtype=torch.float32),
            _topk_case(0, 4, 32, 5, 4),
            _topk_case(3, 64, 128, 300, 64),  # V4-Flash indexer: 64 heads of 128
            _topk_case(9, 4, 32, 40, 8, max_count=30),  # a bound above some counts, as a decode step's capacity
            _topk_case(4, 4, 32, 10, 4, max_count=0),  # no entry visible yet anywhere
            _topk_case(2, 64, 1024, 50, 8, dtype=torch.float32),  # wide fp32 heads: products over column blocks
            _attn_case(6, 4, 64, 30, 12),
            _attn_case(5, 3, 40, 9, 7, dtype=torch.float32),
            _attn_case(0, 4, 64, 5, 3),
            _attn_case(4, 64, 512, 200, 160),  # V4-Flash: 64 heads of 512, window 128 + entries
        ]
    return [
        *(_compress_case(w, 128, 512) for w in (1, 32)),
        *(_compress_case(w, 8, 512, empty_half=True) for w in (1, 1024)),
        *(_topk_case(t, 64, 128, 4096, 512) for t in (1, 64)),
        *(_attn_case(t, 64, 512, 8192, 640) for t in (1, 64)),
    ]


def bad_inputs() -> list[BadInput]:
    def comp(g: Gen, **over):
        kw = {"kv": g.randn(2, 4, 8), "gate": g.randn(2, 4, 8), "position_bias": g.randn(4, 8, dtype=torch.float32)}
        return {**kw, **over}

    def topk(g: Gen, **over):
        kw = {
            "q": g.randn(3, 2, 8),
            "weights": g.randn(3, 2, dtype=torch.float32),
            "keys": g.randn(5, 8),
            "key_start": torch.zeros(3, dtype=torch.int32, device=g.device),
            "key_count": torch.full((3,), 2, dtype=torch.int32, device=g.device),
            "topk": 2,
        }
        return {**kw, **over}

    def attn(g: Gen, **over):
        kw = {
            "q": g.randn(3, 2, 8),
            "kv": g.randn(5, 8),
            "indices": torch.zeros(3, 2, dtype=torch.int32, device=g.device),
            "sinks": g.randn(2, dtype=torch.float32),
            "softmax_scale": 0.3,
        }
        return {**kw, **over}

    return [
        BadInput("compress_kv", "2-D kv", "kv", lambda g: comp(g, kv=g.randn(2, 32))),
        BadInput("compress_kv", "gate of another shape", "gate", lambda g: comp(g, gate=g.randn(2, 3, 8))),
        BadInput("compress_kv", "bf16 position_bias", "position_bias", lambda g: comp(g, position_bias=g.randn(4, 8))),
        BadInput(
            "compress_kv",
            "position_bias of other slots",
            "position_bias",
            lambda g: comp(g, position_bias=g.randn(5, 8, dtype=torch.float32)),
        ),
        BadInput("compress_kv", "no slot", "kv", lambda g: comp(g, kv=g.randn(2, 0, 8), gate=g.randn(2, 0, 8))),
        BadInput("indexer_topk_entries", "keys of another dim", "keys", lambda g: topk(g, keys=g.randn(5, 9))),
        BadInput("indexer_topk_entries", "bf16 weights", "weights", lambda g: topk(g, weights=g.randn(3, 2))),
        BadInput("indexer_topk_entries", "zero topk", "topk", lambda g: topk(g, topk=0)),
        BadInput(
            "indexer_topk_entries",
            "int64 key_start",
            "key_start",
            lambda g: topk(g, key_start=torch.zeros(3, dtype=torch.int64, device=g.device)),
        ),
        BadInput(
            "indexer_topk_entries",
            "a range past the keys",
            "key_count",
            lambda g: topk(g, key_start=torch.tensor([0, 4, 0], dtype=torch.int32, device=g.device)),
        ),
        BadInput("indexer_topk_entries", "negative max_count", "max_count", lambda g: topk(g, max_count=-1)),
        BadInput("indexer_topk_entries", "a key_count above max_count", "key_count", lambda g: topk(g, max_count=1)),
        BadInput(
            "indexer_topk_entries",
            "negative key_count",
            "key_count",
            lambda g: topk(g, key_count=torch.tensor([1, -1, 0], dtype=torch.int32, device=g.device)),
        ),
        BadInput("sparse_attention_sinks", "kv of another dim", "kv", lambda g: attn(g, kv=g.randn(5, 9))),
        BadInput("sparse_attention_sinks", "3-D kv", "kv", lambda g: attn(g, kv=g.randn(5, 1, 8))),
        BadInput(
            "sparse_attention_sinks",
            "indices past the pool",
            "indices",
            lambda g: attn(g, indices=torch.full((3, 2), 5, dtype=torch.int32, device=g.device)),
        ),
        BadInput(
            "sparse_attention_sinks",
            "indices below -1",
            "indices",
            lambda g: attn(g, indices=torch.full((3, 2), -2, dtype=torch.int32, device=g.device)),
        ),
        BadInput("sparse_attention_sinks", "a sink per head missing", "sinks", lambda g: attn(g, sinks=g.randn(1))),
        BadInput("sparse_attention_sinks", "bf16 sinks", "sinks", lambda g: attn(g, sinks=g.randn(2))),
        BadInput("sparse_attention_sinks", "zero scale", "softmax_scale", lambda g: attn(g, softmax_scale=0.0)),
    ]
