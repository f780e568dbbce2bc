"""``example_cpu``: a correct third-party backend for a few ops, written independently of the reference.

A plugin module provides two hooks. ``deepinfer_backend`` describes the backend; ``deepinfer_op_impls`` lists
implementations, each with an optional ``supports`` predicate (arguments it declines go to the next
implementation, then to the reference) and a ``batch_invariant`` flag the conformance suite verifies bitwise.
``supports`` may answer a plain bool (``gemm_supports``) or, to say why it declines, ``Decline(reason)``
(``silu_and_mul_supports``), which ``deepinfer info --ops --shapes small`` shows.
"""

from __future__ import annotations

import torch

import deepinfer
from deepinfer import BackendSpec, Decline, OpImpl, QTensor
from deepinfer.kv_cache import read_tokens


def gemm(a, w, *, out_dtype, bias):
    """FP8 x FP8 accumulated block by block along K, scales applied per block (as DeepGEMM does)."""
    k_blocks = w.shape[1] // 128
    out = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32)
    w_scale = w.scale.repeat_interleave(128, dim=0)[: w.shape[0]]  # [N, K/128]
    for kb in range(k_blocks):
        cols = slice(kb * 128, (kb + 1) * 128)
        partial = a.data[:, cols].float() @ w.data[:, cols].float().T
        out += partial * a.scale[:, kb : kb + 1] * w_scale[:, kb][None, :]
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def gemm_supports(a, w, *, out_dtype, bias) -> bool:
    return isinstance(a, QTensor) and isinstance(w, QTensor) and a.device.type == "cpu"


def silu_and_mul_supports(x, *, quantize, scale_format, masked_m, limit) -> bool | Decline:
    return Decline("quantize=True: no FP8 output here") if quantize else True


def rms_norm(x, w, eps, residual):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    variance = (h.float() * h.float()).sum(-1, keepdim=True) / h.shape[-1]
    return (h.float() / torch.sqrt(variance + eps) * w.float()).to(x.dtype), h


def mla_decode(q, kv_cache, block_table, seq_lens, *, softmax_scale, kv_lora_rank, kv_format):
    """Gathers each sequence's tokens and runs plain attention on them with an explicit causal mask."""
    batch, s_q, heads, _ = q.shape
    block_size = kv_cache.shape[1]
    out = torch.zeros(batch, s_q, heads, kv_lora_rank)
    lse = torch.full((batch, s_q, heads), float("-inf"))
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        slots = torch.cat(
            [
                block_table[b, p].long() * block_size + torch.arange(block_size)
                for p in range((n + block_size - 1) // block_size)
            ]
        )[:n]
        kv = read_tokens(kv_cache, slots, kv_lora_rank)  # [n, D]
        scores = torch.einsum("qhd,nd->qhn", q[b].float(), kv) * softmax_scale
        limit = n - s_q + torch.arange(s_q)  # query i sees positions <= limit[i]
        scores = scores.masked_fill(torch.arange(n)[None, None, :] > limit[:, None, None], float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("qhn,nd->qhd", torch.softmax(scores, dim=-1), kv[:, :kv_lora_rank])
    return out.to(q.dtype), lse


def silu_and_mul(x, *, quantize, scale_format, masked_m, limit):
    half = x.shape[-1] // 2
    gate, up = x[..., :half].float(), x[..., half:].float()
    if limit is not None:  # DeepSeek-V4's clipped SwiGLU
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (gate / (1 + torch.exp(-gate)) * up).to(x.dtype)


@deepinfer.hookimpl
def deepinfer_backend() -> BackendSpec:
    return BackendSpec(
        name="example_cpu",
        device_type="cpu",
        probe=lambda: (True, "runs on any CPU"),
        capabilities=frozenset({"fp8_e4m3"}),
        version="0.1.0",
    )


@deepinfer.hookimpl
def deepinfer_op_impls() -> list[OpImpl]:
    return [
        OpImpl("gemm", "example_cpu", "torch-blocked", gemm, supports=gemm_supports),
        OpImpl("rms_norm", "example_cpu", "torch", rms_norm),
        OpImpl("mla_decode", "example_cpu", "torch-gather", mla_decode),
        OpImpl(
            "silu_and_mul",
            "example_cpu",
            "torch",
            silu_and_mul,
            supports=silu_and_mul_supports,
            batch_invariant=True,
        ),
    ]
