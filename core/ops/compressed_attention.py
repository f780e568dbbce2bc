"""DeepSeek-V4's hybrid attention: ``compress_kv``, ``indexer_topk_entries``, ``sparse_attention_sinks``.

A V4 layer attends, with one shared key=value head and per-head sinks, to the tokens of its sliding window plus
compressed entries: a compressor folds each window of ``m`` tokens into one entry (``compress_kv``, a gated
softmax pooling), and in compressed sparse attention a lightning indexer keeps the ``topk`` entries each query scores
highest (``indexer_topk_entries``). The attention itself takes, per query, the list of rows of a key=value pool it
attends to (``sparse_attention_sinks``): window tokens and chosen entries alike, so one op serves prefill and decode
of all three layer types. The semantics are those of transformers' ``DeepseekV4`` compressors, indexer and eager
attention with sinks.
"""

from __future__ import annotations

import torch

from ..dispatch import call
from ..validation import FLOAT_DTYPES, Check, value_checks_enabled


def compress_kv(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor) -> torch.Tensor:
    """One compressed entry per window: ``out[w, d] = sum_s softmax_s(gate[w, s, d] + position_bias[s, d]) *
    kv[w, s, d]`` (the softmax runs over the ``S`` slots of a window, per channel, in fp32).

    kv: ``[W, S, D]`` float; gate: ``[W, S, D]`` float (``-inf`` marks an empty slot, whose weight is 0; every
    window needs a finite gate in each channel); position_bias: ``[S, D]`` fp32, the learned per-slot bias.
    The weights are rounded to kv's dtype before the weighted sum (as transformers does), which is accumulated in
    fp32. Returns ``[W, D]`` in kv's dtype.
    """
    c = Check("compress_kv")
    c.tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=3)
    windows, slots, dim = kv.shape
    if slots < 1 or dim < 1:
        raise c.fail("kv", "at least one slot of at least one channel per window", f"shape {list(kv.shape)}")
    c.tensor("gate", gate, dtypes=FLOAT_DTYPES, shape=(windows, slots, dim))
    c.tensor("position_bias", position_bias, dtypes=(torch.float32,), shape=(slots, dim))
    c.same_device(kv=kv, gate=gate, position_bias=position_bias)
    return call("compress_kv", kv=kv, gate=gate, position_bias=position_bias)


def indexer_topk_entries(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_start: torch.Tensor,
    key_count: torch.Tensor,
    *,
    topk: int,
    max_count: int | None = None,
) -> torch.Tensor:
    """The lightning indexer over compressed entries: for each query, the rows of ``keys`` it scores highest.

    q: ``[T, H, D]`` float queries (rope applied); weights: ``[T, H]`` fp32 per-head weights with every scale folded
    in (DeepSeek-V4: ``weights_proj(x) * H^-0.5 * D^-0.5``); keys: ``[N, D]`` float, the compressed indexer keys of
    every sequence in the batch, one row per entry. Query ``t`` sees the rows ``[key_start[t], key_start[t] +
    key_count[t])`` (its sequence's entries whose window has closed by its position) and scores each
    ``I = sum_h weights[t, h] * relu(q[t, h] . k)`` in fp32. key_start, key_count: ``[T]`` int32 >= 0, the range
    inside ``keys``. max_count: a bound on every ``key_count`` that the caller knows (a decode step's entry capacity);
    given, no accelerator backend reads ``key_count`` on the host to size its work, so a CUDA graph can hold the
    call. The result does not depend on it.

    Returns ``[T, topk]`` int32: the rows of the ``min(topk, key_count[t])`` highest scores, a tie going to the lower
    row, in ascending order, then ``-1``.
    """
    c = Check("indexer_topk_entries")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    tokens, heads, dim = q.shape
    c.tensor("weights", weights, dtypes=(torch.float32,), shape=(tokens, heads))
    c.tensor("keys", keys, dtypes=FLOAT_DTYPES, shape=(None, dim))
    c.index("key_start", key_start, length=tokens)
    c.index("key_count", key_count, length=tokens)
    c.positive_int("topk", topk)
    if max_count is not None:
        c.positive_int("max_count", max_count, minimum=0)
    c.same_device(q=q, weights=weights, keys=keys, key_start=key_start, key_count=key_count)
    if value_checks_enabled(q) and tokens:
        n = keys.shape[0]
        c.values_in_range("key_start", key_start, 0, n, what="rows of 'keys'")
        most = n if max_count is None else min(n, max_count)
        what = "entry counts" if max_count is None else f"entry counts (max_count {max_count})"
        c.values_in_range("key_count", key_count, 0, most, what=what)
        end = key_start.long() + key_count.long()
        if bool((end > n).any()):
            t = int((end > n).nonzero()[0, 0])
            raise c.fail(
                "key_count",
                f"ranges inside the {n} rows of 'keys'",
                f"query {t}: rows {int(key_start[t])} .. {int(end[t]) - 1}",
            )
    return call(
        "indexer_topk_entries",
        q=q,
        weights=weights,
        keys=keys,
        key_start=key_start,
        key_count=key_count,
        topk=topk,
        max_count=max_count,
    )


def sparse_attention_sinks(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """Multi-query attention with one shared key=value head and a learned sink per head, over listed pool rows.

    q: ``[T, H, D]`` float; kv: ``[N, D]`` float, the pool of key=value rows (a token's key is its value);
    indices: ``[T, K]`` int32 rows of ``kv`` each query attends to, ``-1`` skipped (the list is the mask: window
    tokens and compressed entries alike; a row listed twice counts twice); sinks: ``[H]`` fp32.

    With ``s_j = softmax_scale * q[t, h] . kv[j]`` over the listed rows, ``p_j = exp(s_j) / (exp(sinks[h]) +
    sum_j exp(s_j))`` and ``out[t, h] = sum_j p_j kv[j]``: the sink takes its share of the softmax and contributes no
    value (transformers' ``eager_attention_forward`` of DeepseekV4 and gpt-oss). A query with no row listed gets
    zeros. Scores and softmax in fp32 (a backend may multiply 16-bit rows by the probabilities in two 16-bit parts,
    within the op's tolerance), returned ``[T, H, D]`` in q's dtype. softmax_scale: a finite number > 0.
    """
    c = Check("sparse_attention_sinks")
    c.tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    tokens, heads, dim = q.shape
    c.tensor("kv", kv, dtypes=FLOAT_DTYPES, shape=(None, dim))
    c.index("indices", indices, ndim=2, length=tokens)
    c.tensor("sinks", sinks, dtypes=(torch.float32,), shape=(heads,))
    c.positive_number("softmax_scale", softmax_scale)
    c.same_device(q=q, kv=kv, indices=indices, sinks=sinks)
    if value_checks_enabled(q) and indices.numel():
        c.values_in_range("indices", indices, -1, kv.shape[0] - 1, what="rows of 'kv' (or -1)")
    return call("sparse_attention_sinks", q=q, kv=kv, indices=indices, sinks=sinks, softmax_scale=softmax_scale)
