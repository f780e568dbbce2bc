"""Conformance cases for ``sample`` (greedy rows exact, sampled rows inside the kept set, and the distribution) and
``apply_token_bitmask`` (bitwise)."""

from __future__ import annotations

import torch

from ..reference.sampling import _keep_mask
from .cases import BadInput, Case, Gen, rows_of, take_rows


def _kwargs(g: Gen, batch: int, vocab: int, greedy_every: int = 3):
    temperature = g.uniform(batch, low=0.3, high=1.5)
    temperature[::greedy_every] = 0.0
    top_k = g.randint(0, min(vocab, 50), batch)
    top_p = g.uniform(batch, low=0.5, high=1.0)
    top_p[1::2] = 1.0
    return {
        "logits": g.randn(batch, vocab, dtype=torch.float32, scale=3.0),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seeds": torch.randint(0, 2**62, (batch,), generator=g.cpu).to(g.device),
    }


def _allowed(out, ref, kw) -> float:
    """0 if greedy rows match and every sampled token is in its row's kept set, else inf."""
    for b in range(out.shape[0]):
        temp = float(kw["temperature"][b])
        if temp == 0.0:
            if int(out[b]) != int(ref[b]):
                return float("inf")
            continue
        row = kw["logits"][b].float() / temp
        if not bool(_keep_mask(row, int(kw["top_k"][b]), float(kw["top_p"][b]))[int(out[b])]):
            return float("inf")
    return 0.0


def _rows_case(batch: int, vocab: int) -> Case:
    return Case(
        "sample",
        f"B={batch} V={vocab} mixed greedy/top-k/top-p",
        "default",
        lambda g: _kwargs(g, batch, vocab),
        compare=_allowed,
        sub_batch=lambda kw, rows: (take_rows(kw, tuple(kw), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["logits"].shape[0],
        reproducible=True,
    )


def _distribution_case(draws: int, vocab: int) -> Case:
    """Many seeds over one distribution: the empirical frequencies must match softmax(logits / T)."""

    def make(g: Gen):
        logits = g.randn(1, vocab, dtype=torch.float32).expand(draws, vocab).contiguous()
        return {
            "logits": logits,
            "temperature": torch.full((draws,), 0.8, device=g.device),
            "top_p": torch.ones(draws, device=g.device),
            "top_k": torch.zeros(draws, dtype=torch.int32, device=g.device),
            "seeds": torch.randperm(2**20, generator=g.cpu)[:draws].to(g.device),
        }

    def total_variation(out, ref, kw) -> float:
        expected = (kw["logits"][0] / 0.8).softmax(-1).double().cpu()
        seen = torch.bincount(out.long().cpu(), minlength=vocab).double() / draws
        return float((seen - expected).abs().sum() / 2)

    return Case(
        "sample", f"{draws} seeds over V={vocab}", "distribution", make, compare=total_variation, reproducible=True
    )


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool -> the ``[B, ceil(V / 32)]`` int32 words ``apply_token_bitmask`` takes (bit ``t % 32`` of
    word ``t // 32``)."""
    batch, vocab = allowed.shape
    bits = torch.zeros(batch, (vocab + 31) // 32 * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :vocab] = allowed.long()
    words = (bits.view(batch, (vocab + 31) // 32, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _bitmask_kwargs(g: Gen, batch: int, vocab: int, dtype: torch.dtype):
    """Random masks (about a third of the tokens allowed), and among the rows one with every token allowed, one
    with a single token and one with none; the bits past ``V`` in the last word are set (they must be ignored)."""
    allowed = g.uniform(batch, vocab) < 0.3
    for row, fill in zip(range(batch), ("all", "one", "none")):
        allowed[row] = fill == "all"
        if fill == "one":
            allowed[row, int(g.randint(0, vocab, 1))] = True
    bitmask = pack_bitmask(allowed)
    if vocab % 32:
        bitmask[:, -1] |= pack_bitmask(torch.ones(batch, 32, dtype=torch.bool, device=g.device))[:, 0] << (vocab % 32)
    return {"logits": g.randn(batch, vocab, dtype=dtype, scale=3.0), "bitmask": bitmask}


def _bitmask_case(batch: int, vocab: int, dtype: torch.dtype = torch.float32) -> Case:
    return Case(
        "apply_token_bitmask",
        f"B={batch} V={vocab} {str(dtype).removeprefix('torch.')}",
        "default",
        lambda g: _bitmask_kwargs(g, batch, vocab, dtype),
        sub_batch=lambda kw, rows: (take_rows(kw, tuple(kw), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["logits"].shape[0],
    )


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _rows_case(12, 64),
            _rows_case(5, 1000),
            _rows_case(0, 64),
            _distribution_case(4000, 8),
            _bitmask_case(9, 100),
            _bitmask_case(5, 4096, torch.bfloat16),
            _bitmask_case(0, 64),
        ]
    return [
        _rows_case(256, 129280),
        _rows_case(1, 129280),
        _distribution_case(20000, 16),
        _bitmask_case(256, 129280),
        _bitmask_case(3, 129280, torch.bfloat16),
    ]


def _logits_with(g: Gen, values: list[float]) -> torch.Tensor:
    """``[4, 32]`` logits whose row 2 starts with ``values`` (a whole row of them for 32)."""
    logits = g.randn(4, 32, dtype=torch.float32)
    logits[2, : len(values)] = torch.tensor(values, device=g.device)
    return logits


def bad_inputs() -> list[BadInput]:
    def kw(g: Gen, **over):
        return {**_kwargs(g, 4, 32), **over}

    def bkw(g: Gen):
        return _bitmask_kwargs(g, 4, 100, torch.float32)

    return [
        BadInput(
            "sample",
            "negative temperature",
            "temperature",
            lambda g: kw(g, temperature=torch.tensor([1.0, -1.0, 0.0, 1.0], device=g.device)),
        ),
        BadInput("sample", "top_p of 0", "top_p", lambda g: kw(g, top_p=torch.zeros(4, device=g.device))),
        BadInput("sample", "a NaN logit", "logits", lambda g: kw(g, logits=_logits_with(g, [float("nan")]))),
        BadInput("sample", "a +inf logit", "logits", lambda g: kw(g, logits=_logits_with(g, [float("inf")]))),
        BadInput("sample", "a row all -inf", "logits", lambda g: kw(g, logits=_logits_with(g, [-float("inf")] * 32))),
        BadInput(
            "sample", "int64 top_k", "top_k", lambda g: kw(g, top_k=torch.zeros(4, dtype=torch.int64, device=g.device))
        ),
        BadInput(
            "sample", "int32 seeds", "seeds", lambda g: kw(g, seeds=torch.zeros(4, dtype=torch.int32, device=g.device))
        ),
        BadInput(
            "sample",
            "seeds of another length",
            "seeds",
            lambda g: kw(g, seeds=torch.zeros(3, dtype=torch.int64, device=g.device)),
        ),
        *(
            BadInput("apply_token_bitmask", name, arg, lambda g, arg=arg, make=make: {**bkw(g), arg: make(g.device)})
            for name, arg, make in (
                ("int64 bitmask", "bitmask", lambda d: torch.zeros(4, 4, dtype=torch.int64, device=d)),
                ("a word short", "bitmask", lambda d: torch.zeros(4, 3, dtype=torch.int32, device=d)),
                ("a bool per token", "bitmask", lambda d: torch.ones(4, 100, dtype=torch.bool, device=d)),
                ("int32 logits", "logits", lambda d: torch.zeros(4, 100, dtype=torch.int32, device=d)),
            )
        ),
    ]
