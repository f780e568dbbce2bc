"""Hyper-connections on Ascend (``hc_pre``, ``hc_post``, ``hc_head``): composed from documented operators.

The unweighted RMS norm of the flattened streams is ``npu_rms_norm`` (torch_npu, op-plugin docs) with a gamma of
ones, on an fp32 copy (the contract's math is fp32); the projection, sigmoids, softmax and Sinkhorn iterations on
``[T, N, N]`` and the collapse are plain torch on the NPU, in fp32. ``hc_post`` is plain torch: no torch_npu operator
fuses ``post * out + comb^T @ streams``.
"""

from __future__ import annotations

import torch

from deepinfer import Decline

from . import probe


def _mixes(streams, fn, norm_eps) -> torch.Tensor:
    x = streams.reshape(streams.shape[0], streams.shape[1] * streams.shape[2]).float().contiguous()
    ones = torch.ones(x.shape[1], dtype=torch.float32, device=x.device)
    normed, _ = probe.torch_npu().npu_rms_norm(x, ones, epsilon=norm_eps)
    return normed @ fn.T


def _collapse(streams, pre) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_pre_rms_norm(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps):
    tokens, n, _ = streams.shape
    m = _mixes(streams, fn, norm_eps)
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax(m[:, 2 * n :].view(tokens, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return _collapse(streams, pre), post, comb


def hc_head_rms_norm(streams, fn, base, scale, *, eps, norm_eps):
    return _collapse(streams, torch.sigmoid(_mixes(streams, fn, norm_eps) * scale[0] + base) + eps)


def _has_tokens(answer: bool | Decline, streams) -> bool | Decline:
    if answer and streams.shape[0] == 0:
        return Decline("streams has no tokens")
    return answer


def hc_pre_rms_norm_supports(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps) -> bool | Decline:
    return _has_tokens(probe.placed(streams=streams, fn=fn, base=base, scale=scale), streams)


def hc_head_rms_norm_supports(streams, fn, base, scale, *, eps, norm_eps) -> bool | Decline:
    return _has_tokens(probe.placed(streams=streams, fn=fn, base=base, scale=scale), streams)


def hc_post_torch(block_out, streams, post, comb):
    mixed = torch.matmul(comb.transpose(-1, -2), streams.float())
    return (post.unsqueeze(-1) * block_out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_pre_torch(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps):
    """The empty batch (npu_rms_norm takes no empty tensor)."""
    tokens, n, d = streams.shape
    return (
        streams.new_zeros(tokens, d),
        torch.zeros(tokens, n, device=streams.device),
        torch.zeros(tokens, n, n, device=streams.device),
    )


def hc_head_torch(streams, fn, base, scale, *, eps, norm_eps):
    """The empty batch."""
    return streams.new_zeros(streams.shape[0], streams.shape[2])
