"""Conformance cases for ``mla_decode``, ``attention_varlen``, ``write_kv_cache``.

Cache pages are scattered (a random page order) and every cache position a sequence does not own holds NaN, so
an implementation that reads past ``seq_lens`` or through the wrong page fails loudly.
"""

from __future__ import annotations

import math

import torch

from ..kv_cache import allocate_kv_cache, kv_cache_width, pack_fp8_ds_mla, read_tokens
from .cases import BadInput, Case, Gen, rows_of, take_rows

NAN_BYTE = 0xFF  # e4m3 NaN, and an fp32/bf16 NaN when four/two of them meet


def scattered_pages(g: Gen, seq_lens: list[int], block_size: int, spare: int):
    """Pages for sequences of ``seq_lens`` tokens in a random order, ``spare`` pages left over: ``(num_blocks,
    block_table [B, max_pages] int32 on the CPU, each sequence's token slots on the device)``. Table entries past a
    sequence's pages point anywhere valid."""
    pages = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages) + spare
    order = g.perm(num_blocks).tolist()
    table = torch.zeros(len(seq_lens), max(max(pages, default=0), 1), dtype=torch.int32)
    slots = []
    for b, (n, p) in enumerate(zip(seq_lens, pages)):
        ids, order = order[:p], order[p:]
        table[b, :p] = torch.tensor(ids, dtype=torch.int32)
        table[b, p:] = order[0] if order else 0
        pos = torch.arange(n)
        slots.append((table[b, pos // block_size].long() * block_size + pos % block_size).to(g.device))
    return num_blocks, table, slots


def _paged_cache(g: Gen, seq_lens: list[int], block_size: int, kv_lora_rank: int, rope_dim: int, kv_format: str):
    """A cache holding random tokens for each sequence in scattered pages, NaN everywhere else."""
    num_blocks, table, slots = scattered_pages(g, seq_lens, block_size, spare=3)
    cache = allocate_kv_cache(
        num_blocks, block_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, kv_format=kv_format, device=g.device
    )
    cache.view(torch.uint8).fill_(NAN_BYTE)
    flat = cache.view(-1, cache.shape[-1])
    for n, seq_slots in zip(seq_lens, slots):
        if n:
            latent = g.randn(n, kv_lora_rank + rope_dim)
            flat[seq_slots] = latent if kv_format == "bf16" else pack_fp8_ds_mla(latent, kv_lora_rank)
    return cache, table.to(g.device)


def _mla_case(
    batch: int,
    s_q: int,
    heads: int,
    lens: tuple[int, int],
    block_size: int,
    kv_format: str,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    pad_row: bool = False,
    no_pages: bool = False,
) -> Case:
    def make(g: Gen):
        seq_lens = [0] * batch if no_pages else g.ints(max(lens[0], s_q), lens[1] + 1, batch)
        if pad_row:
            seq_lens[0] = 0  # a padding entry: sees nothing
        cache, table = _paged_cache(g, seq_lens, block_size, kv_lora_rank, rope_dim, kv_format)
        if no_pages:  # a block table of no columns: every query sees nothing
            table = table[:, :0]
        return {
            "q": g.randn(batch, s_q, heads, kv_lora_rank + rope_dim),
            "kv_cache": cache,
            "block_table": table,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=g.device),
            "softmax_scale": (128 + rope_dim) ** -0.5,
            "kv_lora_rank": kv_lora_rank,
        }

    name = (
        f"{kv_format} B={batch} S_q={s_q} H={heads} ctx={lens[0]}..{lens[1]} page={block_size} "
        f"D={kv_lora_rank}+{rope_dim}"
    )
    if no_pages:
        name = f"{kv_format} B={batch} S_q={s_q} H={heads} no pages D={kv_lora_rank}+{rope_dim}"
    return Case(
        "mla_decode",
        name + (" +pad" if pad_row else ""),
        kv_format,
        make,
        sub_batch=lambda kw, rows: (take_rows(kw, ("q", "block_table", "seq_lens"), rows), lambda o: rows_of(o, rows)),
        batch=lambda kw: kw["q"].shape[0],
    )


def _pack(parts: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = [p.shape[0] for p in parts]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return torch.cat(parts), cu


def _varlen_case(
    q_lens: list[int],
    prefix: list[int],
    heads: int,
    kv_heads: int,
    d_qk: int,
    d_v: int,
    causal: bool,
    dtype=torch.bfloat16,
) -> Case:
    def make(g: Gen):
        qs = [g.randn(n, heads, d_qk, dtype=dtype) for n in q_lens]
        ks = [g.randn(n + p, kv_heads, d_qk, dtype=dtype) for n, p in zip(q_lens, prefix)]
        vs = [g.randn(k.shape[0], kv_heads, d_v, dtype=dtype) for k in ks]
        q, cu_q = _pack(qs, g.device)
        k, cu_k = _pack(ks, g.device)
        return {
            "q": q,
            "k": k,
            "v": _pack(vs, g.device)[0],
            "cu_seqlens_q": cu_q,
            "cu_seqlens_k": cu_k,
            "softmax_scale": d_qk**-0.5,
            "causal": causal,
        }

    def sub_batch(kw, seqs):
        cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        q_rows = [r for s in seqs for r in range(cq[s], cq[s + 1])]
        q, cu_q = _pack([kw["q"][cq[s] : cq[s + 1]] for s in seqs], kw["q"].device)
        k, cu_k = _pack([kw["k"][ck[s] : ck[s + 1]] for s in seqs], kw["q"].device)
        return (
            {
                **kw,
                "q": q,
                "k": k,
                "v": torch.cat([kw["v"][ck[s] : ck[s + 1]] for s in seqs]),
                "cu_seqlens_q": cu_q,
                "cu_seqlens_k": cu_k,
            },
            lambda o: rows_of(o, q_rows),
        )

    name = (
        f"lens={q_lens} prefix={prefix} H={heads}/{kv_heads} D={d_qk}/{d_v} "
        f"{'causal' if causal else 'full'} {str(dtype).removeprefix('torch.')}"
    )
    return Case("attention_varlen", name, "default", make, sub_batch=sub_batch, batch=lambda kw: len(q_lens))


def _write_case(
    tokens: int,
    block_size: int,
    num_blocks: int,
    kv_format: str,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:
    def make(g: Gen):
        slots = g.perm(num_blocks * block_size)[:tokens]
        slots[g.perm(tokens)[: tokens // 5]] = -1  # some tokens are skipped
        cache = allocate_kv_cache(
            num_blocks, block_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, kv_format=kv_format, device=g.device
        )
        cache.view(torch.uint8).copy_(g.randint(0, 256, *cache.view(torch.uint8).shape, dtype=torch.uint8))
        return {
            "latent": g.randn(tokens, kv_lora_rank + rope_dim, dtype=dtype, scale=2.0),
            "kv_cache": cache,
            "slot_mapping": slots.to(device=g.device),
            "kv_lora_rank": kv_lora_rank,
        }

    def run(op, kw):
        cache = kw["kv_cache"].clone()
        op(**{**kw, "kv_cache": cache})
        slots = kw["slot_mapping"]
        written = read_tokens(cache, slots[slots >= 0], kw["kv_lora_rank"])
        untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool, device=cache.device)
        untouched[slots[slots >= 0]] = False
        return written, cache.view(torch.uint8).view(untouched.numel(), -1)[untouched]  # values; untouched bytes

    width = kv_cache_width(kv_format, kv_lora_rank, rope_dim)
    name = f"{kv_format} T={tokens} page={block_size} width={width}"
    if dtype == torch.float32:
        name += " fp32 latent"
    return Case("write_kv_cache", name, kv_format, make, run=run)


def cases(shapes: str) -> list[Case]:
    if shapes == "small":
        out = [
            _mla_case(3, 1, 4, (1, 40), 16, "bf16", 128, 64),
            _mla_case(2, 2, 8, (2, 9), 16, "bf16", 128, 64),
            _mla_case(4, 3, 4, (3, 70), 64, "bf16", 128, 32, pad_row=True),
            _mla_case(2, 1, 16, (100, 300), 64, "bf16"),
            _mla_case(1, 1, 16, (200, 300), 64, "bf16"),  # a grid of one program per span: the context splits
            _mla_case(3, 1, 4, (1, 40), 16, "fp8_ds_mla", 128, 64),
            _mla_case(2, 4, 4, (4, 90), 64, "fp8_ds_mla", 256, 64, pad_row=True),
            _mla_case(1, 2, 8, (150, 150), 64, "fp8_ds_mla"),
            _mla_case(0, 1, 4, (1, 40), 16, "bf16", 128, 64),
            _mla_case(2, 1, 4, (0, 0), 16, "bf16", 128, 64, no_pages=True),
            _mla_case(2, 2, 4, (0, 0), 64, "fp8_ds_mla", 512, 64, no_pages=True),
            _varlen_case([5, 1, 17], [0, 0, 0], 4, 4, 48, 32, True),
            _varlen_case([7, 3], [9, 0], 4, 2, 48, 32, True),
            _varlen_case([4, 0, 6], [3, 2, 0], 2, 1, 40, 40, False),
            _varlen_case([9, 2], [5, 0], 4, 4, 64, 32, True, torch.float32),
            _varlen_case([33], [20], 4, 4, 192, 128, True),
            _varlen_case([150, 70], [70, 0], 2, 1, 48, 32, True),  # key blocks below the diagonal
            _varlen_case([130], [3], 2, 2, 64, 32, False),
            _varlen_case([0, 0], [2, 3], 4, 4, 48, 32, True),  # no queries
            _write_case(9, 16, 4, "bf16", 128, 32),
            _write_case(20, 16, 4, "fp8_ds_mla", 128, 64),
            _write_case(6, 64, 2, "fp8_ds_mla"),
            _write_case(0, 16, 2, "bf16", 128, 32),
            _write_case(11, 16, 2, "bf16", 128, 32, torch.float32),  # rounded to the cache's bf16 (nearest even)
            _write_case(11, 16, 2, "fp8_ds_mla", 128, 32, torch.float32),
        ]
        return out
    out = []
    for fmt in ("bf16", "fp8_ds_mla"):
        out += [
            _mla_case(1, 1, 128, (1, 4096), 64, fmt),
            _mla_case(64, 1, 128, (1000, 4096), 64, fmt),
            _mla_case(32, 2, 128, (4000, 4096), 64, fmt),
            _mla_case(16, 4, 128, (1, 2048), 64, fmt, pad_row=True),
            _mla_case(128, 1, 16, (1, 1024), 64, fmt),
            _mla_case(4, 1, 128, (32768, 32768), 64, fmt),
        ]
        out.append(_write_case(4096, 64, 128, fmt))
    out += [
        _varlen_case([2048, 1024, 512, 333], [0, 0, 0, 0], 128, 128, 192, 128, True),
        _varlen_case([1000, 1], [3000, 777], 128, 128, 192, 128, True),
        _varlen_case([8192], [0], 16, 16, 192, 128, True),
    ]
    return out


def bad_inputs() -> list[BadInput]:
    def mla(g: Gen, **over):
        cache, table = _paged_cache(g, [5, 20], 16, 128, 64, "bf16")
        kw = {
            "q": g.randn(2, 1, 4, 192),
            "kv_cache": cache,
            "block_table": table,
            "seq_lens": torch.tensor([5, 20], dtype=torch.int32, device=g.device),
            "softmax_scale": 0.1,
            "kv_lora_rank": 128,
        }
        return {**kw, **over}

    def varlen(g: Gen, **over):
        cu = torch.tensor([0, 3, 5], dtype=torch.int32, device=g.device)
        kw = {
            "q": g.randn(5, 4, 48),
            "k": g.randn(5, 4, 48),
            "v": g.randn(5, 4, 32),
            "cu_seqlens_q": cu,
            "cu_seqlens_k": cu.clone(),
            "softmax_scale": 0.1,
            "causal": True,
        }
        return {**kw, **over}

    def write(g: Gen, **over):
        cache = allocate_kv_cache(2, 16, kv_lora_rank=128, rope_dim=64, device=g.device)
        kw = {
            "latent": g.randn(3, 192),
            "kv_cache": cache,
            "kv_lora_rank": 128,
            "slot_mapping": torch.tensor([0, 5, -1], device=g.device),
        }
        return {**kw, **over}

    i32 = torch.int32
    return [
        BadInput(
            "mla_decode", "fp32 cache", "kv_cache", lambda g: mla(g, kv_cache=torch.zeros(4, 16, 192, device=g.device))
        ),
        BadInput(
            "mla_decode",
            "cache width != D_qk",
            "kv_cache",
            lambda g: mla(g, kv_cache=torch.zeros(4, 16, 200, dtype=torch.bfloat16, device=g.device)),
        ),
        BadInput(
            "mla_decode",
            "int64 seq_lens",
            "seq_lens",
            lambda g: mla(g, seq_lens=torch.tensor([5, 20], device=g.device)),
        ),
        BadInput(
            "mla_decode",
            "seq_lens beyond the block table",
            "seq_lens",
            lambda g: mla(g, seq_lens=torch.tensor([5, 33], dtype=i32, device=g.device)),
        ),
        BadInput(
            "mla_decode",
            "page id outside the cache",
            "block_table",
            lambda g: mla(g, block_table=torch.tensor([[0, 0], [1, 99]], dtype=i32, device=g.device)),
        ),
        BadInput(
            "mla_decode",
            "block_table rows != batch",
            "block_table",
            lambda g: mla(g, block_table=torch.zeros(3, 2, dtype=i32, device=g.device)),
        ),
        BadInput("mla_decode", "3-D q", "q", lambda g: mla(g, q=g.randn(2, 4, 192))),
        BadInput(
            "mla_decode",
            "fp8 cache with kv_lora_rank not a multiple of 128",
            "kv_lora_rank",
            lambda g: mla(
                g,
                q=g.randn(2, 1, 4, 160),
                kv_lora_rank=96,
                kv_cache=torch.zeros(4, 16, 228, dtype=torch.uint8, device=g.device),
            ),
        ),
        BadInput("mla_decode", "negative softmax_scale", "softmax_scale", lambda g: mla(g, softmax_scale=-1.0)),
        BadInput("mla_decode", "infinite softmax_scale", "softmax_scale", lambda g: mla(g, softmax_scale=float("inf"))),
        BadInput("attention_varlen", "zero softmax_scale", "softmax_scale", lambda g: varlen(g, softmax_scale=0.0)),
        BadInput("attention_varlen", "v with another token count", "v", lambda g: varlen(g, v=g.randn(4, 4, 32))),
        BadInput(
            "attention_varlen",
            "head count not dividing H",
            "k",
            lambda g: varlen(g, k=g.randn(5, 3, 48), v=g.randn(5, 3, 32)),
        ),
        BadInput(
            "attention_varlen",
            "cu_seqlens_q not ending at T_q",
            "cu_seqlens_q",
            lambda g: varlen(g, cu_seqlens_q=torch.tensor([0, 3, 4], dtype=i32, device=g.device)),
        ),
        BadInput(
            "attention_varlen", "k of another dtype", "k", lambda g: varlen(g, k=g.randn(5, 4, 48, dtype=torch.float32))
        ),
        BadInput(
            "write_kv_cache",
            "int32 slot_mapping",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([0, 5, -1], dtype=i32, device=g.device)),
        ),
        BadInput(
            "write_kv_cache",
            "slot outside the cache",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([0, 32, -1], device=g.device)),
        ),
        BadInput(
            "write_kv_cache",
            "slot below -1",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([0, -2, 1], device=g.device)),
        ),
        BadInput(
            "write_kv_cache",
            "one slot twice",
            "slot_mapping",
            lambda g: write(g, slot_mapping=torch.tensor([4, 4, -1], device=g.device)),
        ),
        BadInput(
            "write_kv_cache", "latent width != cache width", "kv_cache", lambda g: write(g, latent=g.randn(3, 160))
        ),
    ]
