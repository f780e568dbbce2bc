"""Conformance cases for ``write_index_cache``, ``indexer_topk``, ``sparse_mla``.

Cache pages are scattered and every slot a sequence does not own holds NaN, so an implementation that reads past
``seq_lens``, through the wrong page or at a slot not listed fails loudly.

``indexer_topk`` returns integers, yet the scores behind them are sums a kernel may add in another order: where the
backend's choice differs from the reference's, each position chosen by one side only must score within the
tolerance of the reference's last kept score (relative to the row's largest score), and everything else (how many
positions, their order, the padding) must be exact. One case draws integer-valued inputs, whose scores every
order of addition gives exactly: there ties are frequent and the tie-break (the lower position) is compared
exactly.
"""

from __future__ import annotations

import torch

from ..index_cache import allocate_index_cache, index_cache_width, pack_fp8_ds_index, read_keys
from ..reference.sparse_attention import indexer_scores, sequence_slots
from .attention import NAN_BYTE, _paged_cache, scattered_pages
from .cases import BadInput, Case, Gen, rows_of, take_rows


def _index_cache(g: Gen, seq_lens: list[int], block_size: int, head_dim: int, fmt: str, integer: bool = False):
    """An indexer-key cache holding random keys for each sequence in scattered pages, NaN everywhere else."""
    num_blocks, table, slots = scattered_pages(g, seq_lens, block_size, spare=2)
    cache = allocate_index_cache(num_blocks, block_size, head_dim=head_dim, index_format=fmt, device=g.device)
    cache.view(torch.uint8).fill_(NAN_BYTE)
    flat = cache.view(-1, cache.shape[-1])
    for n, seq_slots in zip(seq_lens, slots):
        if not n:
            continue
        if integer:  # a few distinct integer keys repeated: many exact ties
            keys = g.randint(-2, 3, 3, head_dim).float()[g.randint(0, 3, n).long()]
        else:
            keys = g.randn(n, head_dim, dtype=torch.float32)
        flat[seq_slots] = keys.to(torch.bfloat16) if fmt == "bf16" else pack_fp8_ds_index(keys)
    return cache, table.to(g.device)


def _pack_lens(q_lens: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _row_sequences(kw: dict) -> list[tuple[int, int, int]]:
    """Per query row: ``(sequence, query index i within it, queries of the sequence L)``."""
    cu = kw["cu_seqlens_q"].tolist()
    return [(b, t - cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1) for t in range(cu[b], cu[b + 1])]


def _compare_topk(out: torch.Tensor, ref: torch.Tensor, kw: dict) -> float:
    """0 where equal; else the largest gap, relative to the row's largest score, between the reference's last kept
    score and the score of a position only one side keeps; inf for any other difference."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
        return float("inf")
    out, ref = out.cpu(), ref.cpu()
    if torch.equal(out, ref):
        return 0.0
    block_size, head_dim = kw["index_cache"].shape[1], kw["q"].shape[2]
    worst = 0.0
    rows = _row_sequences(kw)
    for t in (out != ref).any(dim=1).nonzero()[:, 0].tolist():
        b, i, length = rows[t]
        n = int(kw["seq_lens"][b])
        slots = sequence_slots(kw["block_table"][b], n, block_size)
        keys = read_keys(kw["index_cache"], slots, head_dim)
        scores = indexer_scores(kw["q"][t : t + 1], kw["weights"][t : t + 1], keys, n - length + i + 1)[0].cpu()
        position = {s: p for p, s in enumerate(slots.tolist())}
        o, r = out[t][out[t] >= 0].tolist(), ref[t][ref[t] >= 0].tolist()
        if len(o) != len(r) or any(s not in position for s in o):
            return float("inf")
        o_pos = [position[s] for s in o]
        if o_pos != sorted(set(o_pos)):  # ascending and distinct
            return float("inf")
        threshold = float(min(scores[[position[s] for s in r]]))
        scale = max(float(scores[scores > float("-inf")].abs().max()), 1e-30)
        for p in set(o_pos) ^ {position[s] for s in r}:
            if scores[p] == float("-inf"):
                return float("inf")  # a position the query does not see
            worst = max(worst, abs(float(scores[p]) - threshold) / scale)
    return worst


def _topk_case(
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    head_dim: int,
    topk: int,
    block_size: int,
    fmt: str,
    integer: bool = False,
) -> Case:
    def make(g: Gen):
        cache, table = _index_cache(g, seq_lens, block_size, head_dim, fmt, integer)
        t = sum(q_lens)
        if integer:  # exact scores: small integers, power-of-two weights
            q = g.randint(-2, 3, t, heads, head_dim).to(torch.bfloat16)
            weights = torch.exp2(g.randint(-2, 3, t, heads).float()) * (g.randint(0, 2, t, heads).float() * 2 - 1)
        else:
            q, weights = g.randn(t, heads, head_dim), g.randn(t, heads, dtype=torch.float32, scale=heads**-0.5)
        return {
            "q": q,
            "weights": weights,
            "index_cache": cache,
            "block_table": table,
            "cu_seqlens_q": _pack_lens(q_lens, g.device),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=g.device),
            "topk": topk,
        }

    def sub_batch(kw, seqs):
        cu = kw["cu_seqlens_q"].tolist()
        rows = [r for s in seqs for r in range(cu[s], cu[s + 1])]
        sub = take_rows(take_rows(kw, ("q", "weights"), rows), ("block_table", "seq_lens"), seqs)
        sub["cu_seqlens_q"] = _pack_lens([cu[s + 1] - cu[s] for s in seqs], kw["q"].device)
        return sub, lambda o: rows_of(o, rows)

    name = f"{fmt} L={q_lens} ctx={seq_lens} H={heads} D={head_dim} topk={topk} page={block_size}"
    if len(q_lens) > 6:
        name = f"{fmt} B={len(q_lens)} L={min(q_lens)}..{max(q_lens)} ctx={min(seq_lens)}..{max(seq_lens)} "
        name += f"H={heads} D={head_dim} topk={topk} page={block_size}"
    return Case(
        "indexer_topk",
        name + (" integer (exact ties)" if integer else ""),
        "exact" if integer else fmt,
        make,
        compare=None if integer else _compare_topk,
        sub_batch=sub_batch,
        batch=lambda kw: len(q_lens),
    )


def _sparse_case(
    tokens: int,
    heads: int,
    topk: int,
    seq_lens: list[int],
    block_size: int,
    kv_format: str,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    repeats: bool = False,
) -> Case:
    """Each query picks a random sequence and up to ``topk`` of its positions (some rows fewer, one row none)."""

    def make(g: Gen):
        cache, table = _paged_cache(g, seq_lens, block_size, kv_lora_rank, rope_dim, kv_format)
        indices = torch.full((tokens, topk), -1, dtype=torch.int32)
        owners = g.ints(0, len(seq_lens), tokens)
        counts = g.ints(1, topk + 1, tokens)
        for t, (b, k) in enumerate(zip(owners, counts)):
            if t == tokens - 1 and tokens > 1:
                continue  # a query with nothing listed
            n = seq_lens[b]
            pos = g.perm(n)[: min(k, n, topk - 1 if t % 3 == 1 else topk)]
            if repeats and pos.numel() > 1:
                pos[-1] = pos[0]  # listed twice: counted twice
            slots = sequence_slots(table[b].cpu(), n, block_size)[pos]
            indices[t, : slots.numel()] = slots.to(torch.int32)
            if t % 3 == 1:  # -1 entries anywhere in a row are skipped: one first, the rest shuffled in
                indices[t] = torch.roll(indices[t], 1)
                indices[t, 1:] = indices[t, 1:][g.perm(topk - 1)]
        return {
            "q": g.randn(tokens, heads, kv_lora_rank + rope_dim),
            "kv_cache": cache,
            "indices": indices.to(g.device),
            "softmax_scale": (128 + rope_dim) ** -0.5,
            "kv_lora_rank": kv_lora_rank,
        }

    name = f"{kv_format} T={tokens} H={heads} topk={topk} ctx={min(seq_lens)}..{max(seq_lens)} page={block_size}"
    name += f" D={kv_lora_rank}+{rope_dim}" + (" repeated slots" if repeats else "")
    return Case(
        "sparse_mla",
        name,
        kv_format,
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("q", "indices"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["q"].shape[0],
    )


def _write_case(tokens: int, block_size: int, num_blocks: int, fmt: str, head_dim: int = 128, dtype=torch.bfloat16):
    def make(g: Gen):
        slots = g.perm(num_blocks * block_size)[:tokens]
        slots[g.perm(tokens)[: tokens // 5]] = -1
        cache = allocate_index_cache(num_blocks, block_size, head_dim=head_dim, index_format=fmt, device=g.device)
        cache.view(torch.uint8).copy_(g.randint(0, 256, *cache.view(torch.uint8).shape, dtype=torch.uint8))
        return {
            "k": g.randn(tokens, head_dim, dtype=dtype, scale=2.0),
            "index_cache": cache,
            "slot_mapping": slots.to(device=g.device),
        }

    def run(op, kw):
        cache = kw["index_cache"].clone()
        op(**{**kw, "index_cache": cache})
        slots = kw["slot_mapping"]
        written = read_keys(cache, slots[slots >= 0], head_dim)
        untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=cache.device)
        untouched[slots[slots >= 0]] = False
        return written, cache.view(torch.uint8).view(untouched.numel(), -1)[untouched]

    name = f"{fmt} T={tokens} page={block_size} width={index_cache_width(fmt, head_dim)}"
    return Case("write_index_cache", name + (" fp32 keys" if dtype == torch.float32 else ""), fmt, make, run=run)


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        return [
            _write_case(9, 16, 4, "bf16", 32),
            _write_case(20, 16, 4, "fp8_ds_index"),
            _write_case(0, 16, 2, "fp8_ds_index"),
            _write_case(11, 16, 2, "fp8_ds_index", 256, torch.float32),
            # decode rows, a chunk over a cached prefix, two queries of one sequence, an empty sequence
            _topk_case([1, 1, 10, 2, 0], [37, 5, 40, 19, 7], 4, 32, 8, 16, "bf16"),
            _topk_case([1, 3, 1], [70, 3, 130], 8, 128, 16, 64, "fp8_ds_index"),
            _topk_case([1, 1, 1], [20, 1, 9], 2, 64, 32, 16, "bf16"),  # topk above every context: padding
            _topk_case([1, 2, 1], [20, 0, 9], 4, 32, 8, 16, "bf16"),  # a padding sequence (no cached token)
            _topk_case([12, 1, 5], [60, 33, 5], 4, 32, 6, 16, "bf16", integer=True),
            _topk_case([1, 6], [50, 90], 4, 128, 10, 16, "fp8_ds_index", integer=True),
            _sparse_case(7, 4, 16, [40, 9, 70], 16, "bf16", 128, 64),
            _sparse_case(5, 8, 64, [130, 300], 64, "bf16"),
            _sparse_case(6, 4, 24, [30, 50], 16, "fp8_ds_mla", 128, 64),
            _sparse_case(4, 16, 40, [100, 7], 64, "fp8_ds_mla", 256, 32, repeats=True),
            _sparse_case(3, 4, 12, [20], 16, "bf16", 64, 32, repeats=True),
            _topk_case([0, 0], [5, 9], 4, 32, 8, 16, "bf16"),  # no queries
            _sparse_case(0, 4, 16, [40], 16, "bf16", 128, 64),
        ]
    out = []
    for fmt in ("bf16", "fp8_ds_index"):
        out += [
            _write_case(4096, 64, 128, fmt),
            _topk_case([1] * 64, [1 + 127 * i for i in range(64)], 64, 128, 2048, 64, fmt),
            _topk_case([1] * 4, [131072] * 4, 64, 128, 2048, 64, fmt),
            _topk_case([2] * 16, [2000 + 131 * i for i in range(16)], 64, 128, 2048, 64, fmt),
            _topk_case([8192], [8192], 64, 128, 2048, 64, fmt),
            _topk_case([2048, 1], [6000, 3000], 64, 128, 2048, 64, fmt),
        ]
    out.append(_topk_case([64, 1, 7], [4000, 4097, 100], 64, 128, 2048, 64, "fp8_ds_index", integer=True))
    for fmt in ("bf16", "fp8_ds_mla"):
        out += [
            _sparse_case(64, 128, 2048, [8192, 16384, 32768], 64, fmt),
            _sparse_case(128, 128, 2048, [4096, 65536], 64, fmt),
            _sparse_case(64, 64, 2048, [131072], 64, fmt),
            _sparse_case(2048, 128, 2048, [8192], 64, fmt),
        ]
    return out


def bad_inputs() -> list[BadInput]:
    i32 = torch.int32

    def write(g: Gen, **over):
        cache = allocate_index_cache(2, 16, head_dim=128, index_format="fp8_ds_index", device=g.device)
        kw = {"k": g.randn(3, 128), "index_cache": cache, "slot_mapping": torch.tensor([0, 5, -1], device=g.device)}
        return {**kw, **over}

    def topk(g: Gen, **over):
        cache, table = _index_cache(g, [5, 20], 16, 32, "bf16")
        kw = {
            "q": g.randn(3, 4, 32),
            "weights": g.randn(3, 4, dtype=torch.float32),
            "index_cache": cache,
            "block_table": table,
            "cu_seqlens_q": torch.tensor([0, 1, 3], dtype=i32, device=g.device),
            "seq_lens": torch.tensor([5, 20], dtype=i32, device=g.device),
            "topk": 4,
        }
        return {**kw, **over}

    def sparse(g: Gen, **over):
        cache, _ = _paged_cache(g, [20], 16, 128, 64, "bf16")
        kw = {
            "q": g.randn(2, 4, 192),
            "kv_cache": cache,
            "indices": torch.tensor([[0, 3, -1], [5, -1, -1]], dtype=i32, device=g.device),
            "softmax_scale": 0.1,
            "kv_lora_rank": 128,
        }
        return {**kw, **over}

    return [
        BadInput(
            "write_index_cache",
            "int32 slot_mapping",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([0, 5, -1], dtype=i32, device=g.device)),
        ),
        BadInput(
            "write_index_cache",
            "slot outside the cache",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([0, 32, -1], device=g.device)),
        ),
        BadInput(
            "write_index_cache",
            "one slot twice",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([4, 4, -1], device=g.device)),
        ),
        BadInput("write_index_cache", "key width != cache width", "index_cache", lambda g: write(g, k=g.randn(3, 96))),
        BadInput(
            "write_index_cache",
            "fp32 cache",
            "index_cache",
            lambda g: write(g, index_cache=torch.zeros(2, 16, 128, device=g.device)),
        ),
        BadInput(
            "indexer_topk",
            "bf16 weights",
            "weights",
            lambda g: topk(g, weights=g.randn(3, 4)),
        ),
        BadInput("indexer_topk", "2-D q", "q", lambda g: topk(g, q=g.randn(3, 32))),
        BadInput(
            "indexer_topk",
            "block_table rows != sequences",
            "block_table",
            lambda g: topk(g, block_table=torch.zeros(3, 2, dtype=i32, device=g.device)),
        ),
        BadInput(
            "indexer_topk",
            "fewer cached tokens than queries",
            "seq_lens",
            lambda g: topk(g, seq_lens=torch.tensor([5, 1], dtype=i32, device=g.device)),
        ),
        BadInput(
            "indexer_topk",
            "seq_lens beyond the block table",
            "seq_lens",
            lambda g: topk(g, seq_lens=torch.tensor([5, 40], dtype=i32, device=g.device)),
        ),
        BadInput(
            "indexer_topk",
            "page id outside the cache",
            "block_table",
            lambda g: topk(g, block_table=torch.tensor([[0, 0], [1, 99]], dtype=i32, device=g.device)),
        ),
        BadInput(
            "indexer_topk",
            "queries but no sequence",
            "cu_seqlens_q",
            lambda g: topk(
                g,
                block_table=torch.zeros(0, 2, dtype=i32, device=g.device),
                cu_seqlens_q=torch.zeros(1, dtype=i32, device=g.device),
                seq_lens=torch.zeros(0, dtype=i32, device=g.device),
            ),
        ),
        BadInput(
            "indexer_topk",
            "cu_seqlens_q not ending at T",
            "cu_seqlens_q",
            lambda g: topk(g, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=i32, device=g.device)),
        ),
        BadInput("indexer_topk", "topk 0", "topk", lambda g: topk(g, topk=0)),
        BadInput(
            "indexer_topk",
            "key width != head_dim",
            "index_cache",
            lambda g: topk(g, q=g.randn(3, 4, 48)),
        ),
        BadInput(
            "sparse_mla",
            "int64 indices",
            "indices",
            lambda g: sparse(g, indices=torch.tensor([[0, 3, -1], [5, -1, -1]], device=g.device)),
        ),
        BadInput(
            "sparse_mla",
            "slot outside the cache",
            "indices",
            lambda g: sparse(g, indices=torch.tensor([[0, 3, -1], [500, -1, -1]], dtype=i32, device=g.device)),
        ),
        BadInput(
            "sparse_mla",
            "slot below -1",
            "indices",
            lambda g: sparse(g, indices=torch.tensor([[0, -2, -1], [5, -1, -1]], dtype=i32, device=g.device)),
        ),
        BadInput(
            "sparse_mla",
            "indices rows != tokens",
            "indices",
            lambda g: sparse(g, indices=torch.tensor([[0, 3, -1]], dtype=i32, device=g.device)),
        ),
        BadInput("sparse_mla", "4-D q", "q", lambda g: sparse(g, q=g.randn(2, 1, 4, 192))),
        BadInput("sparse_mla", "NaN softmax_scale", "softmax_scale", lambda g: sparse(g, softmax_scale=float("nan"))),
        BadInput(
            "sparse_mla",
            "cache width != D_qk",
            "kv_cache",
            lambda g: sparse(g, q=g.randn(2, 4, 200)),
        ),
    ]
