"""Reference ``mla_decode``, ``attention_varlen``, ``write_kv_cache``: one sequence at a time, fp32 math."""

from __future__ import annotations

import torch

from ..kv_cache import pack_fp8_ds_mla, read_tokens

SCORES_PER_CHUNK = 2**28  # fp32 scores held at once (1 GiB): long sequences go a few heads at a time


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float):
    """q [S, H, D], k [N, H or 1, D], v [N, H or 1, Dv], visible [S, N] bool -> out [S, H, Dv], lse [S, H] (fp32).
    Heads are taken in chunks of at most ``SCORES_PER_CHUNK`` scores; each head's result is the same either way."""
    heads = q.shape[1]
    k, v = k.float().expand(-1, heads, -1), v.float().expand(-1, heads, -1)
    step = max(1, SCORES_PER_CHUNK // max(1, q.shape[0] * k.shape[0]))
    outs, lses = [], []
    for h in range(0, max(heads, 1), step):
        scores = torch.einsum("shd,nhd->hsn", q[:, h : h + step].float(), k[:, h : h + step]) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
        outs.append(torch.einsum("hsn,nhd->shd", probs, v[:, h : h + step]))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _causal_visible(s_q: int, n_k: int, device) -> torch.Tensor:
    """Query i sees keys j <= i + (n_k - s_q) (bottom-right aligned)."""
    i = torch.arange(s_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - s_q)


def mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format):
    batch, s_q, heads, _ = q.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(batch, s_q, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, s_q, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[b, pos // block_size].long() * block_size + pos % block_size
        kv = read_tokens(kv_cache, slots, kv_lora_rank).unsqueeze(1)  # [n, 1, D_qk]
        out[b], lse[b] = _attend(q[b], kv, kv[..., :kv_lora_rank], _causal_visible(s_q, n, q.device), softmax_scale)
    return out.to(q.dtype), lse


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale, causal):
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bq) - 1):
        q_i, k_i, v_i = q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]]
        if q_i.shape[0] == 0 or k_i.shape[0] == 0:
            continue
        k_i, v_i = k_i.repeat_interleave(group, dim=1), v_i.repeat_interleave(group, dim=1)
        if causal:
            visible = _causal_visible(q_i.shape[0], k_i.shape[0], q.device)
        else:
            visible = torch.ones(q_i.shape[0], k_i.shape[0], dtype=torch.bool, device=q.device)
        out[bq[i] : bq[i + 1]] = _attend(q_i, k_i, v_i, visible, softmax_scale)[0]
    return out.to(q.dtype)


def write_kv_cache(latent, kv_cache, slot_mapping, *, kv_lora_rank, kv_format):
    keep = slot_mapping >= 0
    slots, rows = slot_mapping[keep], latent[keep]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if kv_format == "fp8_ds_mla":
        flat[slots] = pack_fp8_ds_mla(rows, kv_lora_rank)
    else:
        flat[slots] = rows.to(kv_cache.dtype)
