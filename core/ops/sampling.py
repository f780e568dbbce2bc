"""Sampling ops: ``sample`` with per-request seeds, and ``apply_token_bitmask`` (structured output's constraint)."""

from __future__ import annotations

import torch

from ..dispatch import call
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """Draws one token per row of ``logits [B, V]`` (``V >= 1``).

    temperature ``[B]`` fp32 (0 = greedy: the first index of the max logit); otherwise the logits are divided by
    the temperature, then filtered: top_k ``[B]`` int32 (0 = off) keeps the k largest (and any tied with the
    k-th), top_p ``[B]`` fp32 in (0, 1] (1 = off) keeps the smallest set of most likely remaining tokens whose
    probability reaches top_p; the token is drawn from the renormalised rest. seeds ``[B]`` int64.

    A row's token depends only on its logits, its parameters and its seed: never on the other rows, the batch
    size or earlier calls. The same seed gives the same token on every run of one backend; backends may use
    different random streams. The token always lies in the kept set. Logits are finite or ``-inf`` (a forbidden
    token), with at least one finite logit in every row: NaN, ``+inf`` or a row all ``-inf`` is an ``InputError``
    while value checks run. Returns ``[B]`` int32.
    """
    c = Check("sample")
    c.tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    batch = logits.shape[0]
    if logits.shape[1] == 0:
        raise c.fail("logits", "a vocabulary of at least one token", f"shape {list(logits.shape)}")
    c.tensor("temperature", temperature, dtypes=(torch.float32,), shape=(batch,))
    c.tensor("top_p", top_p, dtypes=(torch.float32,), shape=(batch,))
    c.index("top_k", top_k, length=batch)
    c.index("seeds", seeds, dtype=torch.int64, length=batch)
    c.same_device(logits=logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds)
    if value_checks_enabled(logits) and batch:
        bad_temperature, bad_top_p, bad_top_k, bad_logit, no_token = torch.stack(  # one host synchronisation
            [
                ((temperature < 0) | ~torch.isfinite(temperature)).any(),
                (~((top_p > 0) & (top_p <= 1))).any(),  # NaN fails too
                (top_k < 0).any(),
                (torch.isnan(logits) | (logits == float("inf"))).any(),
                (~torch.isfinite(logits)).all(dim=1).any(),
            ]
        ).tolist()
        if bad_logit:
            raise c.fail("logits", "finite values or -inf (a forbidden token)", "NaN or +inf")
        if no_token:
            row = int((~torch.isfinite(logits)).all(dim=1).nonzero()[0, 0])
            raise c.fail("logits", "at least one finite logit in every row", f"row {row} all -inf")
        if bad_temperature:
            raise c.fail("temperature", "finite values >= 0", f"{temperature.tolist()[:8]}")
        if bad_top_p:
            raise c.fail("top_p", "values in (0, 1]", f"{top_p.tolist()[:8]}")
        if bad_top_k:
            raise c.fail("top_k", "values >= 0 (0 = off)", f"{top_k.tolist()[:8]}")
    return call("sample", logits=logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with every token a row's grammar forbids set to ``-inf``; the others unchanged (bitwise).

    bitmask ``[B, ceil(V / 32)]`` int32, the layout grammar engines (xgrammar, llguidance) fill: token ``t`` of
    row ``b`` is allowed when bit ``t % 32`` (least significant first) of ``bitmask[b, t // 32]`` is set; the bits
    past ``V`` in the last word are ignored. A row with no allowed token comes back all ``-inf`` (the caller ends
    such a request before sampling). A row's result depends on its own logits and mask only. Returns a new
    ``[B, V]`` tensor of the logits' dtype.
    """
    c = Check("apply_token_bitmask")
    c.tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    batch, vocab = logits.shape
    c.tensor("bitmask", bitmask, dtypes=(torch.int32,), shape=(batch, (vocab + 31) // 32))
    c.same_device(logits=logits, bitmask=bitmask)
    return call("apply_token_bitmask", logits=logits, bitmask=bitmask)
