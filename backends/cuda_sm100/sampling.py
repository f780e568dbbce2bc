"""``sample``: temperature, top-k and top-p filtering with torch on the device, then a seeded exponential race in
Triton: the token is argmax(p / E) with E = -log(u) and u drawn by Philox from (the row's seed, the token id), so a
row's draw depends on nothing but its own seed and logits. ``apply_token_bitmask``: one program per row and block
of tokens, each token's bit read from its word."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import Decline

from ._triton import PDL, next_pow2, pdl_wait, placed


@triton.jit
def _race_kernel(
    probs_ptr, seeds_ptr, best_ptr, best_idx_ptr, B, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    """Program (rows, chunk): for each of ``ROWS`` rows, the winner of the race among tokens ``[chunk * CHUNK,
    (chunk + 1) * CHUNK)``, its wait and its index (the lowest index among tied waits)."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = row < B
    chunk = tl.program_id(1)
    seed = tl.load(seeds_ptr + row, mask=rm, other=0)
    best = tl.full((ROWS, BLOCK), -1.0, tl.float32)
    best_idx = tl.zeros((ROWS, BLOCK), tl.int32)
    for v0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        mask = rm[:, None] & (idx[None, :] < V)
        p = tl.load(probs_ptr + row[:, None] * V + idx[None, :], mask=mask, other=0.0)
        u = tl.rand(seed[:, None], idx[None, :])
        race = tl.where(mask, p / -tl.log(u), -1.0)  # u = 0 gives an infinite wait: never chosen
        better = race > best
        best = tl.where(better, race, best)
        best_idx = tl.where(better, idx[None, :], best_idx)
    top = tl.max(best, axis=1)
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, top, mask=rm)
    tl.store(best_idx_ptr + out, tl.min(tl.where(best == top[:, None], best_idx, V), axis=1), mask=rm)


RACE_CHUNK = 4096  # tokens per program: a row of a large vocabulary spreads over many multiprocessors


def _filtered_probs(logits: torch.Tensor, temperature, top_p, top_k) -> torch.Tensor:
    vocab = logits.shape[1]
    x = logits.float() / torch.where(temperature == 0, 1.0, temperature)[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    keep_sorted = sorted_x >= sorted_x.gather(1, (k - 1)[:, None])  # ties with the k-th are kept
    p_sorted = sorted_x.masked_fill(~keep_sorted, float("-inf")).softmax(dim=-1)
    before = p_sorted.cumsum(dim=-1) - p_sorted
    keep_sorted &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return x.masked_fill(~keep, float("-inf")).softmax(dim=-1)


def sample(logits, temperature, top_p, top_k, seeds):
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.int32, device=logits.device)
    probs = _filtered_probs(logits, temperature, top_p, top_k).contiguous()
    block = min(1024, next_pow2(vocab))
    chunk = min(RACE_CHUNK, triton.cdiv(vocab, block) * block)
    rows = 1024 // block  # a small vocabulary: several rows per program
    chunks = triton.cdiv(vocab, chunk)
    best = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    grid = (triton.cdiv(batch, rows), chunks)
    seeds = seeds.contiguous()  # read at seeds_ptr + row
    _race_kernel[grid](probs, seeds, best, best_idx, batch, vocab, CHUNK=chunk, BLOCK=block, ROWS=rows, launch_pdl=PDL)
    drawn = best_idx.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]  # the first chunk holding the best wait
    return torch.where(temperature == 0, logits.argmax(dim=-1).to(torch.int32), drawn)


def supports(logits, temperature, top_p, top_k, seeds) -> bool | Decline:
    return placed(logits=logits, temperature=temperature, top_p=top_p, top_k=top_k, seeds=seeds)


@triton.jit
def _bitmask_kernel(logits_ptr, bitmask_ptr, out_ptr, V, W, stride_l, stride_b, stride_o, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tok < V
    x = tl.load(logits_ptr + row * stride_l + tok, mask=m)
    word = tl.load(bitmask_ptr + row * stride_b + tok // 32, mask=m, other=0)
    allowed = ((word >> (tok % 32)) & 1) != 0
    tl.store(out_ptr + row * stride_o + tok, tl.where(allowed, x, float("-inf")), mask=m)


def apply_token_bitmask(logits, bitmask):
    batch, vocab = logits.shape
    out = torch.empty_like(logits)
    if batch == 0 or vocab == 0:
        return out
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    bitmask = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
    block = 1024
    grid = (batch, triton.cdiv(vocab, block))
    _bitmask_kernel[grid](
        logits, bitmask, out, vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0), out.stride(0),
        BLOCK=block, launch_pdl=PDL,
    )  # fmt: skip
    return out


def apply_token_bitmask_supports(logits, bitmask) -> bool | Decline:
    return placed(logits=logits, bitmask=bitmask)
