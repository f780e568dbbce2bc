"""Reference ``hc_pre``, ``hc_post``, ``hc_head``, in fp32."""

from __future__ import annotations

import torch

from ..dispatch import batch_invariant_enabled


def _mixes(streams, fn, norm_eps):
    """``[T, M]``: the flattened streams, RMS-normalised without a weight, times ``fn.T``."""
    x = streams.reshape(streams.shape[0], streams.shape[1] * streams.shape[2]).float()
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + norm_eps)
    if batch_invariant_enabled() and x.shape[0] > 1:  # a row's product must not depend on the batch's size
        return torch.stack([row @ fn.T for row in x])
    return x @ fn.T


def _collapse(streams, pre):
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def _per_row(fn, streams, *args, **kw):
    """``fn`` on each token alone, results stacked: in batch-invariant mode a row's elementwise transcendentals
    (sigmoid, exp) must not fall in another lane of a vectorised loop for another number of tokens."""
    outs = [fn(streams[t : t + 1], *args, **kw) for t in range(streams.shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def hc_pre(streams, fn, base, scale, *, sinkhorn_iters, eps, norm_eps):
    if batch_invariant_enabled() and streams.shape[0] > 1:
        return _per_row(hc_pre, streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps)
    tokens, n, _ = streams.shape
    m = _mixes(streams, fn, norm_eps)
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = m[:, 2 * n :].view(tokens, n, n) * scale[2] + base[2 * n :].view(n, n)
    comb = torch.softmax(comb_logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return _collapse(streams, pre), post, comb


def hc_post(block_out, streams, post, comb):
    mixed = torch.matmul(comb.transpose(-1, -2), streams.float())
    return (post.unsqueeze(-1) * block_out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_head(streams, fn, base, scale, *, eps, norm_eps):
    if batch_invariant_enabled() and streams.shape[0] > 1:
        return _per_row(hc_head, streams, fn, base, scale, eps=eps, norm_eps=norm_eps)
    pre = torch.sigmoid(_mixes(streams, fn, norm_eps) * scale[0] + base) + eps
    return _collapse(streams, pre)
